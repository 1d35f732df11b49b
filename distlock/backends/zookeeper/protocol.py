"""The ZooKeeper lock protocol: a queue of ephemeral sequential znodes per lock, its rules, a contender's turns."""

import re
import threading
import zlib
from contextlib import suppress
from urllib.parse import quote, unquote

from kazoo.exceptions import (
    BadVersionError,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
    RolledBackError,
    RuntimeInconsistency,
)

from distlock.backends.zookeeper.options import BUCKETS, FLAT
from distlock.backends.zookeeper.reads import children_of, data_of
from distlock.backends.zookeeper.session import NoAnswer
from distlock.holder import holder_record, read_holder_record

__all__ = ["BUCKET_COUNT", "READ", "WRITE", "Contender", "NodeGone", "Taken", "ahead_of", "blocker_of", "bucket_of",
           "decode_name", "delete_owned", "encode_name", "foreign_nodes", "holders", "holders_of", "parent_path",
           "read_cursor", "release", "successor_of"]

# -- Znode layout and protocol ---------------------------------------------------------------------
#
#   KEY_PREFIX/<encoded name>                            persistent; exists only while someone holds or waits
#   KEY_PREFIX/<encoded name>/<owner>-<kind>-<sequence>  ephemeral sequential: one per holder or waiter;
#                                                        kind "write" (lock(), write_lock()) or "read";
#                                                        data: JSON {"owner", "host", "pid", "task_id"}
#
# - Layouts (option LAYOUT). "flat" (the default, and the only one before it): as above. "buckets":
#   each lock's parent one level down, KEY_PREFIX/bucket=<NNN>/<encoded name>, NNN the CRC-32 of the
#   encoded name modulo BUCKET_COUNT, zero-padded. A bucket is persistent, made by the first create
#   that finds it missing, and never deleted. Everything below a lock's parent is the same in both.
#   Why: ZooKeeper lists a znode's children all at once, so a flat listing of the held locks reads
#   every lock's name on every page; by bucket, a page reads the buckets it needs ("Listing" below).
#   "=" is never in an encoded name, so neither layout's znodes can pass for the other's. The two
#   layouts do not see each other's locks: two processes of one alias with different LAYOUTs can
#   both hold one lock. ``foreign_nodes()`` reports the other layout's znodes (``distlock check``).
# - Who holds: a "write" node holds when no node with a lower sequence exists; a "read" node holds
#   when no *write* node with a lower sequence exists. A waiter watches only the nearest node it waits
#   for (a writer its predecessor, a reader the nearest earlier writer), so a release wakes one waiter
#   instead of the herd. The watch is a child watch: ZooKeeper fires it when the node is deleted, never
#   for a write to its data (a re-stamp, below), and the request that sets it returns the node's stat,
#   which tells a planted persistent node ("Foreign children") from a contender at no extra request.
# - Fencing token: the zxid (ensemble-wide transaction id) of the holder node at its grant: its czxid
#   when our node was the parent's only child at that zxid, else the mzxid of a set_data on our own
#   node (the re-stamp), sent behind a listing that shows it holds. A waiter's czxid dates from when it
#   queued, older than tokens other names were granted meanwhile; and a node first in the listing read
#   behind its create may still have had a predecessor at its czxid, granted a larger (re-stamped)
#   token and gone in between. Re-stamping makes every token larger than every token granted before
#   it, for any name of the ensemble, as the foundation contract promises. Uncontended: no extra request.
#   Invariant: a token is a zxid at which its node holds (the czxid of a node alone, or a write to the
#   node that succeeded after a listing showed it holds: a holder holds until its node is deleted).
#   So, per name, a holder's token is below the delete that ends its hold, hence below the next
#   holder's; and alias-wide, a grant acknowledged before another holder's grant (the delete of its
#   last blocker) carries a smaller token.
# - Hand-off: the woken waiter sends its listing and, right behind it, the re-stamp, before knowing
#   whether it holds: one round trip instead of two. ZooKeeper answers a session's requests in order,
#   so the write commits after the state the listing was read from; if the listing shows we hold, we
#   still hold at the write's zxid (it succeeded, so our node was there), and its mzxid is the token,
#   as for a re-stamp sent after the reply. If the listing shows we wait, the write changed only our
#   own node's data (same bytes), which no watch of ours fires on and no token was taken from. A holder
#   whose grant listing showed a contender behind it releases with multi[delete our node, check that
#   node]: committed, it proves the parent is not empty, so no listing follows the delete; if that node
#   went meanwhile, nothing was deleted and the release falls back to the delete alone, with its listing.
#   Why the releaser does not stamp its successor instead (multi[delete ours, set_data theirs], one write
#   less per hand-off): set_data replaces the data, the successor's holder record, which the releaser
#   has not read; reading it puts a read on the hand-off path, the cost the stamp was to save. A token
#   taken from a stat read anyway (the parent's pzxid behind the listing) needs no write at all, but
#   nothing on the holder's node would then show it: held_locks() could not report the lease's token.
# - Every write, even one that fails, is a transaction through the quorum, so each step below costs
#   one transaction; reads sent right behind it on the same session (ZooKeeper answers a session's
#   requests in order) add no round trip.
# - Acquire, nobody else queuing: multi[create parent, create our node, set_data parent]: one request.
#   Our node gets sequence 0 in the fresh parent, so we hold the lock without listing; the set_data
#   returns the parent's stat at the multi's zxid: its mzxid is our node's czxid, its child count tells
#   whether our node was alone. If the parent exists (NodeExists rolls the multi back), or the name
#   was recently crowded: create our node alone (same multi without the parent), with a listing sent
#   behind it. NoNode means a leaver just deleted the parent: start over.
# - Release, alone since acquiring: multi[delete our node, delete parent]. NotEmpty (someone queued
#   meanwhile) rolls it back; then, and when the name is crowded, delete our node alone. A holder
#   whose grant listing showed a contender behind it sends multi[delete our node, check theirs]
#   instead ("Hand-off" above); NoNode on theirs rolls it back, and our node is deleted alone.
# - Whoever deletes its node alone (release, ttl expiry, a non-blocking miss, a timed-out or cancelled
#   wait) lists the parent right behind the delete and deletes it if empty: the last one out removes
#   the parent, so no empty znode is left behind. A delete racing a create fails harmlessly (NotEmpty),
#   a create racing a delete gets NoNode and starts over.
# - Lost replies: our node's name starts with the random owner id, so after a connection loss during
#   its create we find it by listing (the trick kazoo took from Netflix Curator); a node we gave up on
#   is deleted when its late reply arrives, or after reconnecting.
# - Tries (blocking=False) make a node only where it would hold. A try that queued like a waiter
#   made every try behind it fail until its owner, having lost, deleted it: with tries always in
#   flight the lock was free nearly all the time and nobody got it (1 grant in ~5,700 tries). A try:
#   1. Sends multi[create parent, create our node, set_data parent], with a listing of the parent
#      and its stat behind it, on a crowded name too: when the lock is free a try wins in one
#      request. It commits only if the parent did not exist: our node is alone, and holds.
#   2. Else nothing was made, and the listing shows why. A node the try would wait for (any node for
#      a writer, a writer for a reader): the lock is held, or a waiter queued first: fail, leaving
#      nothing. Else send multi[check parent version = the listed one, create our node, set_data
#      parent] with a listing behind it; if it commits, our node holds or waits by the rules above,
#      like any node. If it fails (BadVersion: a contender was created since the listing; NoNode:
#      the parent went) nothing was made: back to 2 with its listing (1 if the parent is gone).
#   3. After TRY_ROUNDS multis that made nothing, it creates its node unconditionally and decides
#      from the listing behind it, as every try once did.
#   The parent's data version counts creates: every create of every version of this module stamps
#   the parent in the same multi. (It restarts when the parent is deleted and made again, so it can
#   come back to a listed value: the check only spares nodes, it is never a reason to hold.)
#   Why this is sound:
#   - No two holders: multis decide whether a node is made, never whether it holds. A try's node
#     holds by the rules above, from its multi's child count (alone at its zxid) or from the listing
#     behind it, as a waiter's does; sequences follow zxid order, so one write node is lowest.
#   - A try fails only if the lock is held or a waiter queued first: it fails only on a listing that
#     shows a node it would wait for: the lowest such node holds, any other one queued before the
#     try. (As of the zxid the member serving the listing has applied, as for every read; the
#     listings of steps 1 and 2 come behind a write of this session, so they are at least that new.)
#   - Concurrent tries resolve to one winner, the first to commit: the leader serialises their
#     multis; the first to commit makes the parent (1) or passes its check (2), and its set_data moves
#     the version, so every later multi of step 2 fails without making a node, and, looking again,
#     sees the winner. Losers make no node (before step 3), so the winner is the lowest try node.
#   - No livelock: a try goes round again only after a multi of step 2 made nothing, which takes
#     another contender's create, or a leaver's delete of the parent, committed since its listing:
#     every lost round is matched by someone else's progress, and of the tries racing from one
#     listing the first to commit wins.
#   - Bounded: a try sends at most TRY_ROUNDS multis, each with its listing, then at most one plain
#     create with its listing, and never waits for a watch; each request is bounded by REQUEST_TIMEOUT
#     cut to the caller's timeout (0 for every try of the public API), but never below
#     REQUEST_MINIMUM (1 s). (Like every create, one that meets the parent's delete starts over.)
#   - Tokens follow the rules above (fresh only when alone at the create's zxid, else re-stamped),
#     so tokens keep their order across the alias for tries too; sessions, SUSPENDED and LOST are
#     untouched. The node format is unchanged: a process of the previous version sees a try's node
#     as the plain node it is, and its own tries' nodes are plain nodes this version fails on.
# - Foreign children. The protocol counts only children whose name parses (owner, kind, and a
#   sequence of digits: never negative) and that are ephemeral. Anything else under a lock's parent
#   (a persistent node planted by hand or by a hostile client, say "x-write--000000001", which would
#   sort first and block the lock forever) is ignored: names by the pattern, persistence by the stat
#   of the node a contender would wait for or fail on (read once, remembered), and by the holder's
#   stat in ``holders()``. ``foreign_nodes()`` reports them, for ``distlock check``.
# - Listing (``holders()``): flat, one request lists every lock's name, sorted in the process; a page
#   goes on after the name its cursor gives. By bucket, a page lists buckets in order (a few at a
#   time, in one multiRead) and goes on after its cursor "<NNN>:<encoded name>" (bucket, last name): pages
#   follow bucket order, as Redis pages follow SCAN order, and each page is sorted by name. A name
#   prefix cannot pick buckets: every bucket is listed. Both then read only the page's locks: their
#   children, then their holders' data, each in one multiRead (``reads``; pipelined single reads on
#   an ensemble older than 3.6).

WRITE, READ = "write", "read"

#: A contender's node name. ZooKeeper's sequence suffix is 10 digits and never negative in a parent
#: (parents are deleted when empty, long before 2**31 creates): a "-" sequence is planted, not ours.
_NODE_NAME = re.compile(r"^(?P<owner>[^-]+)-(?P<kind>read|write)-(?P<sequence>\d+)$")

#: How many multis of a try may make nothing (see "Tries" above) before it creates its node
#: unconditionally, as a waiter does, and lets the listing behind it decide.
TRY_ROUNDS = 3


#: Buckets of the "buckets" layout. Part of the layout: a process with another count would look for a
#: lock in another bucket, so it is a constant, not an option.
BUCKET_COUNT = 256

#: A bucket's znode name: "=" is never in an encoded lock name (``encode_name``).
_BUCKET_NAME = re.compile(r"^bucket=(?P<index>\d{3})$")

#: A cursor of the "buckets" layout: the bucket and the encoded name a page ended on.
_BUCKET_CURSOR = re.compile(r"^(?P<index>\d{3}):(?P<node>[A-Za-z0-9_~%-]+)$")

#: How many buckets a page lists at once at first; each further round lists twice as many, up to the last.
_FIRST_BUCKETS, _MOST_BUCKETS = 4, 16


def encode_name(name):
    """Return lock ``name`` as one valid znode name, reversibly.

    Percent-encoded UTF-8 keeps only ``A-Z a-z 0-9 _ - ~ %``: no "/", no characters ZooKeeper refuses,
    and "." is escaped as well because "." and ".." are not valid node names.
    """
    return quote(name, safe="").replace(".", "%2E")


def decode_name(node):
    return unquote(node)


def _bucket(index):
    return f"bucket={index:03d}"


def bucket_of(node):
    """Return the bucket (its znode name) of the encoded lock name ``node`` in the "buckets" layout."""
    return _bucket(zlib.crc32(node.encode()) % BUCKET_COUNT)


def parent_path(root, layout, name):
    """Return the path of lock ``name``'s parent znode under ``root`` (KEY_PREFIX) in ``layout``."""
    node = encode_name(name)
    return f"{root}/{bucket_of(node)}/{node}" if layout == BUCKETS else f"{root}/{node}"


class NodeGone(Exception):
    """Our znode is no longer there (its session ended, or an operator deleted it): queue again."""


class Taken(Exception):
    """A try saw a node it would wait for (the lock is held, or a waiter queued first): it made no node."""


def blocker_of(node, children):
    """Return the child ``node`` must wait for, None if it holds the lock; raise ``NodeGone`` if it is gone.

    Pure function of one listing, so the rules of the layout above live in one place.
    """
    mine = _NODE_NAME.match(node)
    if node not in children or mine is None:
        raise NodeGone(node)
    return _nearest_before(mine["kind"], int(mine["sequence"]), children)


def successor_of(node, children):
    """Return the child queued right behind ``node`` (whatever its kind), None if none."""
    sequence = int(_NODE_NAME.match(node)["sequence"])
    behind = [(int(m["sequence"]), child) for child in children
              if (m := _NODE_NAME.match(child)) and int(m["sequence"]) > sequence]
    return min(behind)[1] if behind else None


def ahead_of(kind, children):
    """Return the child a node of ``kind`` queued behind all of ``children`` would wait for; None if none."""
    return _nearest_before(kind, None, children)


def _nearest_before(kind, sequence, children):
    """Return the nearest child before ``sequence`` (None: after every child) that a ``kind`` node waits for."""
    nearest, nearest_sequence = None, None
    for child in children:
        other = _NODE_NAME.match(child)
        if other is None or (kind == READ and other["kind"] != WRITE):
            continue
        other_sequence = int(other["sequence"])
        if (sequence is None or other_sequence < sequence) and (
                nearest_sequence is None or other_sequence > nearest_sequence):
            nearest, nearest_sequence = child, other_sequence
    return nearest


def holders_of(children):
    """Return the children holding the lock: the first writer, or the readers before the first writer."""
    contenders = sorted((int(m["sequence"]), m["kind"], child)
                        for child in children if (m := _NODE_NAME.match(child)))
    holders = []
    for _, kind, child in contenders:
        if kind == WRITE:
            return holders or [child]
        holders.append(child)
    return holders


class Contender:
    """One attempt's place in a lock's queue: its node's name prefix, and the node once created.

    Made on the attempt's first try and kept in ``attempt.place``; its requests go through ``session``
    (``distlock.backends.zookeeper.session.Session``).
    """

    def __init__(self, session, parent, owner, kind):
        self.session = session
        self.parent = parent
        self.owner = owner
        self.kind = kind
        self.prefix = f"{owner}-{kind}-"
        self.data = holder_record(owner=owner).encode()
        #: Full path of our node once its create answered; None before.
        self.path = None
        #: The node's czxid once created, its mzxid once re-stamped at the grant.
        self.token = None
        #: True while ``token`` was issued by the request that showed the grant (no re-stamp needed).
        self.token_fresh = False
        #: True after a create whose reply was lost: the node may exist, findable by ``prefix``.
        self.uncertain = False
        #: The session epoch before the node was created: a LOST since then took the node.
        self.epoch = None
        #: After a turn that did not hold: the path of the node to wait for, and the client that listed it.
        self.blocker = None
        self.client = None
        #: After a turn that held: the path of the nearest contender queued behind ours in its listing, or None.
        self.successor = None

    @property
    def node(self):
        return self.path.rsplit("/", 1)[1]

    def forget_node(self):
        """The node went with its session (or was deleted, or given back): the next turn creates a new one."""
        self.path = self.token = None
        self.uncertain = False
        self.token_fresh = False

    def take_turn(self, epoch, io_deadline, *, trying):
        """Queue (or list the queue) and return True if our node holds the lock; else set ``blocker``.

        ``epoch`` is the session epoch read before this turn's first request. A try (``trying``)
        raises ``Taken`` instead of queuing behind a node it would wait for. Raises ``NodeGone`` if
        our node went, and kazoo's errors as they come.
        """
        self.token_fresh = False
        self.blocker = self.successor = None
        client = self.client = self.session.connect(io_deadline)
        stamp = None
        if self.path is None:
            children = self._enter(client, io_deadline, trying=trying)
            self.epoch = epoch
            if children is None:
                return True
        else:
            # Woken (or back after a connection loss): the stamp goes right behind the listing, before
            # knowing whether we hold ("Hand-off" above).
            listing = client.get_children_async(self.parent)
            stamp = client.set_async(self.path, self.data)
            try:
                children = self.session.result(listing, io_deadline)
            except NoNodeError:
                children = []
        blocker, children = self._live_blocker(children)
        if len(children) > 1:
            self.session.crowd(self.parent)
        if blocker is not None:
            self.blocker = f"{self.parent}/{blocker}"
            return False
        successor = successor_of(self.node, children)
        self.successor = successor and f"{self.parent}/{successor}"
        if not self.token_fresh:
            self._restamp(client, io_deadline, stamp)
        return True

    def wait(self, remaining, io_deadline, job):
        """Sleep until ``blocker`` goes, the connection changes state, ``job`` is cancelled, or ``remaining`` passes.

        The watch is a child watch on the blocker: it fires when the node is deleted, never for a
        write to its data (a holder's re-stamp), so a re-stamp wakes nobody and costs no re-arm. The
        same request returns the blocker's stat: a persistent blocker is no contender ("Foreign
        children" above): noted, and the next turn passes it by.
        """
        client, path, wake = self.client, self.blocker, threading.Event()
        with self.session.waiting(wake):
            job.wake = wake
            try:
                _, stat = self.session.result(
                    client.get_children_async(path, watch=lambda event: wake.set(), include_data=True), io_deadline)
                if stat.ephemeralOwner == 0:
                    self.session.note_persistent(path)
                elif not job.cancelled:
                    wake.wait(remaining)
            except NoNodeError:
                return
            finally:
                job.wake = None

    def give_up(self):
        """Withdraw from the queue (timed out, missed, or interrupted); never blocks."""
        if self.path is not None:
            self.session.send_leave(self.path)
        elif self.uncertain:
            self.session.add_leftover(self.parent, self.prefix, None)

    def _enter(self, client, io_deadline, *, trying):
        """Create our node (or find the one a lost reply created); record its path and token.

        Return the children listed right behind the create, or None if the node is the first one in a
        parent it created itself: then it holds the lock. A try raises ``Taken`` instead of queuing
        behind a node it would wait for.
        """
        session = self.session
        if self.uncertain:
            self.uncertain = False
            children = session.children(client, self.parent, io_deadline)
            for child in children:
                if child.startswith(self.prefix):
                    stat = session.result(client.exists_async(f"{self.parent}/{child}"), io_deadline)
                    if stat is not None:
                        self.path, self.token = f"{self.parent}/{child}", stat.czxid
                        return children
        while True:
            crowded = session.is_crowded(self.parent)
            try:
                if trying:
                    return self._try_create(client, io_deadline)
                return self._create(client, io_deadline, with_parent=not crowded)
            except NodeExistsError:
                session.crowd(self.parent)  # the parent exists: others queue
            except NoNodeError:
                if crowded:
                    session.crowd(self.parent, False)  # a leaver deleted the parent: start over
                else:  # no KEY_PREFIX, or no bucket, yet (first use of this alias, or of this bucket)
                    with suppress(NodeExistsError):
                        session.result(client.create_async(self.parent.rsplit("/", 1)[0], makepath=True),
                                       io_deadline)

    def _create(self, client, io_deadline, *, with_parent):
        """Create our node in one multi, with its parent if ``with_parent``; record its path and token.

        Return the children listed right behind the multi, or None when the multi made the parent too:
        the node is then its first child and holds the lock.
        """
        committed = self._send_create(client, with_parent=with_parent)
        listing = None if with_parent else client.get_children_async(self.parent)
        self._made(committed, io_deadline)
        if listing is None:
            return None
        try:
            return self.session.result(listing, io_deadline)
        except NoNodeError:
            return []

    def _try_create(self, client, io_deadline):
        """Create a try's node only where it would hold ("Tries" above); return as ``_create``.

        Raise ``Taken``, with no node made, when a listing shows a node the try would wait for.
        """
        version = None  # the parent's data version last listed; None: make the parent with the node
        for _ in range(TRY_ROUNDS):
            committed = self._send_create(client, with_parent=version is None, parent_version=version)
            # Behind the multi, even a failed one, so it shows why it failed.
            listing = client.get_children_async(self.parent, include_data=True)
            try:
                self._made(committed, io_deadline)
            except (NodeExistsError, BadVersionError, NoNodeError) as exc:
                if version is None and isinstance(exc, NoNodeError):
                    raise  # no KEY_PREFIX, or no bucket, yet
            else:
                if version is None:
                    return None
                with suppress(NoNodeError):
                    return self.session.result(listing, io_deadline)[0]
                return []
            try:
                children, stat = self.session.result(listing, io_deadline)
            except NoNodeError:
                version = None  # the parent went since the multi: make it
                continue
            if self._live_ahead(client, children, io_deadline) is not None:
                raise Taken(self.parent)
            version = stat.version
        return self._create(client, io_deadline, with_parent=version is None)

    def _send_create(self, client, *, with_parent, parent_version=None):
        """Send the multi that creates our node; return its async reply for ``_made``.

        It makes the parent first if ``with_parent``, or first checks that the parent's data version is
        still ``parent_version`` if given; it ends by stamping the parent (set_data): all operations of
        a multi share one zxid, so the stamp's mzxid is our node's czxid and comes with the reply.
        """
        transaction = client.transaction()
        if parent_version is not None:
            transaction.check(self.parent, parent_version)
        if with_parent:
            transaction.create(self.parent)
        transaction.create(f"{self.parent}/{self.prefix}", self.data, ephemeral=True, sequence=True)
        transaction.set_data(self.parent, b"")
        return transaction.commit_async()

    def _made(self, committed, io_deadline):
        """Wait for a create multi; record the node's path and token, or raise the failed operation's error."""
        try:
            results = self.session.result(committed, io_deadline)
        except NoAnswer:
            committed.rawlink(self._delete_late_node)
            raise
        made_node, stamped = results[-2:]
        if not isinstance(made_node, str):
            raise next(result for result in results if not isinstance(result, (RolledBackError, RuntimeInconsistency)))
        self.path, self.token = made_node, stamped.mzxid
        # The czxid is a safe token only if our node was alone at that zxid. The listing behind the
        # multi is read later: a node queued before ours may have been granted (re-stamped above our
        # czxid) and released in between, so "first in the listing" alone would hand us a lower token.
        self.token_fresh = stamped.numChildren == 1

    def _restamp(self, client, io_deadline, stamp=None):
        """Give a holder that queued a token of its grant: the mzxid of a write to its own node.

        ``stamp``: that write's reply, if it was sent behind the listing that showed the grant.
        """
        try:
            stat = self.session.result(stamp or client.set_async(self.path, self.data), io_deadline)
        except NoNodeError:
            raise NodeGone(self.path) from None
        self.token = stat.mzxid

    def _delete_late_node(self, reply):
        """kazoo callback for a create we gave up on: delete the node if it was made after all."""
        if not reply.successful():
            return
        made_node = reply.value[-2]  # the multi's results: [check or create parent,] create node, set_data parent
        if isinstance(made_node, str):
            self.session.send_leave(made_node)

    def _live_blocker(self, children):
        """Return the child we wait for (None: we hold) and the listing without foreign nodes.

        A child known to be persistent is no contender ("Foreign children" above): it is dropped and
        the rules applied again. One not known yet is found out by ``wait()``, which reads its stat
        in the request that watches it. Raise ``NodeGone`` as ``blocker_of``.
        """
        while True:
            blocker = blocker_of(self.node, children)
            if blocker is None or not self.session.is_persistent(f"{self.parent}/{blocker}"):
                return blocker, children
            children = [child for child in children if child != blocker]

    def _live_ahead(self, client, children, io_deadline):
        """Return the (ephemeral) child a try would wait for, as ``ahead_of``; None if none."""
        while True:
            ahead = ahead_of(self.kind, children)
            if ahead is None or self.session.is_ephemeral(client, f"{self.parent}/{ahead}", io_deadline):
                return ahead
            children = [child for child in children if child != ahead]


# -- The other requests of the protocol: release, listing, compare-and-delete -----------------------

def release(session, client, path, io_deadline, successor=None):
    """Delete the held node ``path`` ("Release" above); return False if it was gone already.

    ``successor``: the path of a contender the grant's listing showed queued behind ours, if any.
    """
    parent = path.rsplit("/", 1)[0]
    if successor is not None:
        transaction = client.transaction()
        transaction.delete(path)
        transaction.check(successor, -1)
        deleted_node, checked = session.result(transaction.commit_async(), io_deadline)
        if checked is True:
            return True  # someone is left behind us: the parent stays, nothing to list
        if isinstance(deleted_node, NoNodeError):
            return False
        if not isinstance(checked, NoNodeError):
            raise checked if isinstance(deleted_node, RolledBackError) else deleted_node
    elif not session.is_crowded(parent):
        transaction = client.transaction()
        transaction.delete(path)
        transaction.delete(parent)
        deleted_node, deleted_parent = session.result(transaction.commit_async(), io_deadline)
        if deleted_parent is True:
            return True
        if isinstance(deleted_node, NoNodeError):
            return False  # gone already: expired, released by an operator, or its session ended
        if not isinstance(deleted_parent, NotEmptyError):
            raise deleted_parent if isinstance(deleted_node, RolledBackError) else deleted_node
        session.crowd(parent)  # someone queued since we acquired
    try:
        session.result(session.send_leave(path, awaited=True), io_deadline)
    except NoNodeError:
        return False
    return True


def holders(session, client, prefix, io_deadline, *, limit=None, cursor=None):
    """Return the (name, data, stat) of the holders of the locks whose name starts with ``prefix``, by name, and
    the cursor of the next page: of every such lock, or of the first ``limit`` held after ``cursor``.

    Pages as "Listing" above says for the alias's layout. Persistent children are no holders ("Foreign
    children" above). Raise ``ValueError`` for a cursor no page of this layout gave (``read_cursor``).
    """
    if session.settings["LAYOUT"] == BUCKETS:
        return _holders_by_bucket(session, client, prefix, io_deadline, limit, read_cursor(BUCKETS, cursor))
    names = sorted((decode_name(node), node) for node in session.children(client, session.root, io_deadline))
    names = [(name, f"{session.root}/{node}") for name, node in names
             if name.startswith(prefix) and (cursor is None or name > cursor)]
    found, more = _held_among(session, client, names, io_deadline, limit)
    return found, (found[-1][0] if more else None)


def read_cursor(layout, cursor):
    """Return what a page's ``cursor`` stands for in ``layout``: flat, the name; by bucket, (bucket index,
    encoded name); None for the first page. Raise ``ValueError`` for a cursor no page of ``layout`` gave."""
    if cursor is None or layout != BUCKETS:
        return cursor
    match = _BUCKET_CURSOR.match(cursor)
    if match is None or int(match["index"]) >= BUCKET_COUNT:
        raise ValueError(f"cursor {cursor!r} is no page's: a ZooKeeper cursor of LAYOUT {BUCKETS!r} is "
                         f"\"<bucket below {BUCKET_COUNT}, 3 digits>:<encoded lock name>\"")
    return int(match["index"]), match["node"]


def _holders_by_bucket(session, client, prefix, io_deadline, limit, cursor):
    """``holders()`` in the "buckets" layout: list the buckets from the cursor's on, a few at a time, until
    they name enough locks for the page, then read those locks.

    A bucket's children whose name falls in another bucket are ignored, as the protocol ignores them.
    """
    first_index, after = cursor if cursor is not None else (0, None)
    index, batch, found = first_index, _FIRST_BUCKETS, []
    while True:
        wanted = None if limit is None else limit - len({held[0] for held in found})
        names = []  # (name, parent path, bucket index), in cursor order: by bucket, then by name
        while index < BUCKET_COUNT and (wanted is None or len(names) < wanted):
            indexes = range(index, min(index + batch, BUCKET_COUNT))
            listings = children_of(session, client, [f"{session.root}/{_bucket(i)}" for i in indexes], io_deadline)
            for i, nodes in zip(indexes, listings):
                if isinstance(nodes, NoNodeError):
                    continue  # no lock has used this bucket yet
                bucket, first = _bucket(i), decode_name(after) if after is not None and i == first_index else None
                names.extend((name, f"{session.root}/{bucket}/{node}", i)
                             for name, node in sorted((decode_name(node), node) for node in nodes
                                                      if bucket_of(node) == bucket)
                             if name.startswith(prefix) and (first is None or name > first))
            index += len(indexes)
            batch = min(batch * 2, _MOST_BUCKETS)
        page, more = _held_among(session, client, names, io_deadline, wanted)
        found.extend(page)
        if limit is not None and len({held[0] for held in found}) == limit and (more or index < BUCKET_COUNT):
            last = page[-1][0]
            last_index, last_parent = next((i, parent) for name, parent, i in reversed(names) if name == last)
            found.sort(key=lambda held: held[0])
            return found, f"{last_index:03d}:{last_parent.rsplit('/', 1)[1]}"
        if index == BUCKET_COUNT and not more:
            found.sort(key=lambda held: held[0])
            return found, None


def _held_among(session, client, names, io_deadline, limit):
    """Return the holders of the first ``limit`` held locks of ``names`` ((name, parent, ...) in page order),
    and whether a name is left after the last of them. Reads ``limit`` names at a time (all if None)."""
    step = max(len(names) if limit is None else limit, 1)
    found, locks_found = [], 0
    for start in range(0, len(names), step):
        chunk = names[start:start + step]
        for position, held in enumerate(_holders_of_locks(session, client, chunk, io_deadline)):
            found.extend(held)
            locks_found += bool(held)
            if limit is not None and locks_found == limit:
                return found, start + position + 1 < len(names)
    return found, False


def _holders_of_locks(session, client, names, io_deadline):
    """Return the holders of each lock of ``names`` ((name, parent, ...)): every lock's children, then every
    holder's data, each in as few requests as the ensemble takes (``reads``)."""
    children = [[] if isinstance(listing, NoNodeError) else listing
                for listing in children_of(session, client, [entry[1] for entry in names], io_deadline)]
    wanted = [(index, child) for index, listing in enumerate(children) for child in holders_of(listing)]
    reads = [[] for _ in names]
    for (index, child), read in zip(wanted, data_of(session, client, [f"{names[index][1]}/{child}"
                                                                      for index, child in wanted], io_deadline)):
        reads[index].append((child, read))
    return [_holders_of_lock(session, client, entry[0], entry[1], listing, lock_reads, io_deadline)
            for entry, listing, lock_reads in zip(names, children, reads)]


def _holders_of_lock(session, client, name, parent, children, reads, io_deadline):
    """Return the (name, data, stat) of the holders of one lock, from its ``children`` and the ``reads``
    ((child, (data, stat) or NoNodeError)) of the holders among them."""
    while True:
        held, foreign = [], set()
        for child, read in reads:
            if isinstance(read, NoNodeError):
                continue
            data, stat = read
            if stat.ephemeralOwner == 0:
                foreign.add(child)
            else:
                held.append((name, data, stat))
        if not foreign:
            return held
        children = [child for child in children if child not in foreign]
        holding = holders_of(children)
        reads = list(zip(holding, data_of(session, client, [f"{parent}/{child}" for child in holding], io_deadline)))


def foreign_nodes(session, client, io_deadline):
    """Return a description (its path and why) of every znode under KEY_PREFIX that the protocol ignores.

    Those are children of a lock's parent that are not contenders, and the znodes of the other layout
    ("Layouts" above): locks that processes with another LAYOUT hold without excluding this alias's.
    """
    bucketed = session.settings["LAYOUT"] == BUCKETS
    found, parents, buckets = [], [], []
    for node in sorted(session.children(client, session.root, io_deadline)):
        path = f"{session.root}/{node}"
        if bucketed and _BUCKET_NAME.match(node):
            buckets.append((node, path, client.get_children_async(path)))
        elif bucketed:
            found.append(f"{path}: lock {decode_name(node)!r} of LAYOUT {FLAT!r}, which this alias (LAYOUT "
                         f"{BUCKETS!r}) does not see: its holders and this alias's exclude nothing of each other; "
                         "give every process of the alias the same LAYOUT")
        elif _BUCKET_NAME.match(node):
            found.append(f"{path}: a bucket of LAYOUT {BUCKETS!r}, whose locks this alias (LAYOUT {FLAT!r}) does "
                         "not see: their holders and this alias's exclude nothing of each other; give every "
                         "process of the alias the same LAYOUT")
        else:
            parents.append(path)
    for bucket, path, listing in buckets:
        try:
            nodes = session.result(listing, io_deadline)
        except NoNodeError:
            continue
        for node in sorted(nodes):
            if bucket_of(node) == bucket:
                parents.append(f"{path}/{node}")
            else:
                found.append(f"{path}/{node}: not in the bucket its name falls in ({bucket_of(node)}); the lock "
                             "protocol ignores it")
    listings = [(parent, client.get_children_async(parent)) for parent in parents]
    stats = []
    for parent, listing in listings:
        try:
            children = session.result(listing, io_deadline)
        except NoNodeError:
            continue
        stats.extend((f"{parent}/{child}", _NODE_NAME.match(child) is not None,
                      client.exists_async(f"{parent}/{child}")) for child in sorted(children))
    for path, named, reply in stats:
        stat = session.result(reply, io_deadline)
        if stat is None:
            continue  # gone meanwhile
        problems = []
        if not named:
            problems.append("its name is not <owner>-<read|write>-<non-negative sequence>")
        if stat.ephemeralOwner == 0:
            problems.append("it is persistent, not ephemeral")
        if problems:
            found.append(f"{path}: {' and '.join(problems)}; the lock protocol ignores it")
    return found


def delete_owned(session, client, parent, owner, io_deadline):
    """Delete ``owner``'s node under ``parent``, checked by its data and version; return True if deleted."""
    for child in session.children(client, parent, io_deadline):
        match = _NODE_NAME.match(child)
        if match is None or match["owner"] != owner:
            continue
        path = f"{parent}/{child}"
        try:
            data, stat = session.result(client.get_async(path), io_deadline)
            if read_holder_record(data)["owner"] != owner:
                return False
            reply = client.delete_async(path, version=stat.version)
            client.delete_async(parent)
            session.result(reply, io_deadline)
        except (NoNodeError, BadVersionError):
            return False
        return True
    return False
