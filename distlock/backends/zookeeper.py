"""ZooKeeper locks (kazoo): ephemeral sequential znodes, the holder's czxid as fencing token, session-aware leases.

Interrupts. kazoo is not safe against exceptions raised asynchronously on the thread that calls it,
so every operation goes through ``distlock.backends.offload`` (a runner thread for main-thread callers
of a process with a raising signal handler, a green thread of its own under gevent or eventlet). A
cancelled blocking acquire stops waiting and withdraws its node; an interrupted caller's grant is
given back (the node deleted). Every grant is registered with the ttl timer on the runner before it
is handed over, so even an interrupt after the hand-over frees the lock at its ttl. Under gevent or
eventlet (detected when the alias is built: ``is_module_patched("socket")`` /
``is_monkey_patched("socket")``) kazoo also gets its own sequential gevent/eventlet handler, with
retry objects built for its sleep function.
"""

import heapq
import json
import logging
import math
import os
import queue
import re
import socket
import ssl
import threading
import time
import weakref
from contextlib import contextmanager, suppress
from datetime import datetime, timezone
from functools import partial
from urllib.parse import quote, unquote

from django.core.exceptions import ImproperlyConfigured
from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import (
    BadVersionError,
    ConnectionClosedError,
    ConnectionLoss,
    KazooException,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
    RolledBackError,
    RuntimeInconsistency,
    SessionExpiredError,
    SessionMovedError,
)
from kazoo.handlers.threading import KazooTimeoutError, SequentialThreadingHandler
from kazoo.protocol.connection import ConnectionHandler
from kazoo.protocol.serialization import Connect
from kazoo.protocol.states import EventType
from kazoo.retry import KazooRetry
from kazoo.security import ACL, Id, Permissions, make_digest_acl_credential

from distlock.backends.base import (
    NOTIFICATIONS,
    READ_WRITE,
    SAFE_FENCING_TOKENS,
    Attempt,
    BaseLockBackend,
    Grant,
    LockInfo,
    Option,
    positive_number,
    refuse_after_late_grants,
)
from distlock.backends.green import Daemon, green_library, killed
from distlock.backends.offload import Abandoned, Offloader
from distlock.exceptions import BackendUnavailable, LockNotAcquired
from distlock.holder import holder_record, new_owner
from distlock.redaction import REDACTED, redact

logger = logging.getLogger("distlock.backends.zookeeper")

# -- Znode layout and protocol ---------------------------------------------------------------------
#
#   ROOT/<encoded name>                            persistent; exists only while someone holds or waits
#   ROOT/<encoded name>/<owner>-<kind>-<sequence>  ephemeral sequential: one per holder or waiter;
#                                                  kind "write" (lock(), write_lock()) or "read";
#                                                  data: JSON {"owner", "host", "pid", "task_id"}
#
# - Who holds: a "write" node holds when no node with a lower sequence exists; a "read" node holds
#   when no *write* node with a lower sequence exists. A waiter watches only the nearest node it waits
#   for (a writer its predecessor, a reader the nearest earlier writer), so a release wakes one waiter
#   instead of the herd.
# - Fencing token: the zxid (ensemble-wide transaction id) of the holder node at its grant: its czxid
#   when our node was the parent's only child at that zxid, else the mzxid of a set_data on our own
#   node, sent once it finds it holds. A waiter's czxid dates from when it queued, older than tokens
#   other names were granted meanwhile; and a node first in the listing read behind its create may
#   still have had a predecessor at its czxid, granted a larger (re-stamped) token and gone in between.
#   Re-stamping makes every token larger than every token granted before it, for any name of the
#   ensemble, as the foundation contract promises. Uncontended: no extra request.
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
#   meanwhile) rolls it back; then, and when the name is crowded, delete our node alone.
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
#     create with its listing, and never waits for a watch; each request is bounded by the caller's
#     timeout (0 for every try of the public API) plus REQUEST_GRACE. (Like every create, one that
#     meets the parent's delete starts over.)
#   - Tokens follow the rules above (fresh only when alone at the create's zxid, else re-stamped),
#     so tokens keep their order across the alias for tries too; sessions, SUSPENDED and LOST are
#     untouched. The node format is unchanged: a process of the previous version sees a try's node
#     as the plain node it is, and its own tries' nodes are plain nodes this version fails on.
# - Foreign children. The protocol counts only children whose name parses (owner, kind, and a
#   sequence of digits: never negative) and that are ephemeral. Anything else under a lock's parent
#   (a persistent node planted by hand or by a hostile client, say "x-write--000000001", which would
#   sort first and block the lock forever) is ignored: names by the pattern, persistence by the stat
#   of the node a contender would wait for or fail on (read once, remembered), and by the holder's
#   stat in ``held_locks()``. ``foreign_records()`` reports them, for ``distlock check``.

ROOT_DEFAULT = "/distlock"
WRITE, READ = "write", "read"

#: A contender's node name. ZooKeeper's sequence suffix is 10 digits and never negative in a parent
#: (parents are deleted when empty, long before 2**31 creates): a "-" sequence is planted, not ours.
_NODE_NAME = re.compile(r"^(?P<owner>[^-]+)-(?P<kind>read|write)-(?P<sequence>\d+)$")

#: Seconds a request may outlast the caller's timeout: a non-blocking attempt (timeout 0) still needs
#: one round trip. So a caller's timeout is honoured to within this when the ensemble does not answer.
REQUEST_GRACE = 1.0

#: kazoo reconnects with this back-off (seconds), instead of its default that grows to a minute.
RECONNECT = {"max_tries": -1, "delay": 0.05, "backoff": 2, "max_delay": 1.0}

#: How many recently crowded lock names a backend remembers (to skip a multi bound to fail).
CROWDED_NAMES = 1024

#: How many multis of a try may make nothing (see "Tries" above) before it creates its node
#: unconditionally, as a waiter does, and lets the listing behind it decide.
TRY_ROUNDS = 3

#: kazoo sends the session timeout as a signed 32-bit number of milliseconds; a larger one kills its
#: connection thread (struct.error) and the alias never connects.
MAX_SESSION_TIMEOUT = (2**31 - 1) / 1000

#: How many znodes a backend remembers as checked ephemeral (the protocol ignores persistent ones).
CHECKED_NODES = 4096

_UNKNOWN = object()


def encode_name(name):
    """Return lock ``name`` as one valid znode name, reversibly.

    Percent-encoded UTF-8 keeps only ``A-Z a-z 0-9 _ - ~ %``: no "/", no characters ZooKeeper refuses,
    and "." is escaped as well because "." and ".." are not valid node names.
    """
    return quote(name, safe="").replace(".", "%2E")


def decode_name(node):
    return unquote(node)


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


def _valid_session_timeout(value):
    problem = positive_number(value)
    if problem is None and value > MAX_SESSION_TIMEOUT:
        problem = (f"must be at most {MAX_SESSION_TIMEOUT} seconds (2**31-1 milliseconds: kazoo sends it as a "
                   "32-bit number, and the server caps it at 20 ticks anyway)")
    return problem


def _kazoo_handler(green):
    """Return kazoo's handler for this process: its gevent or eventlet one under that library's patching."""
    if green == "gevent":
        from kazoo.handlers.gevent import SequentialGeventHandler  # noqa: PLC0415

        return SequentialGeventHandler()
    if green == "eventlet":
        from kazoo.handlers.eventlet import SequentialEventletHandler  # noqa: PLC0415

        return SequentialEventletHandler()
    return SequentialThreadingHandler()


def _valid_hosts(value):
    if not value.strip() or any(not host.strip() for host in value.split(",")):
        return 'must list the ensemble as "host:port,host:port,..."'
    return None


def _valid_root(value):
    segments = value.split("/")[1:]
    if not value.startswith("/") or value == "/" or any(s in ("", ".", "..") for s in segments):
        return 'must be an absolute znode path such as "/distlock", without a trailing "/"'
    if segments[0] == "zookeeper":
        return 'must not be under "/zookeeper", which the server reserves'
    return None


# -- Security options (AUTH_DATA, DEFAULT_ACL, TLS) --------------------------------------------------
#
# Passed to KazooClient as kazoo names them (auth_data, default_acl, use_ssl, ca, certfile, keyfile,
# keyfile_password, verify_certs). kazoo gives ``default_acl`` to every create that names no ACL, and
# this module names none: ROOT, lock parents and contenders all carry it. Who may delete a contender is
# decided by its parent's ACL (ZooKeeper checks DELETE on the parent), so the parent's ACL is what
# keeps other clients from deleting holders' znodes or planting children.
#
# Secrets (the credentials of AUTH_DATA, a digest ACL's password and hash, KEYFILE_PASSWORD) are kept
# as ``_Secret`` strings: the string itself for kazoo and the server, ``'***'`` in every repr. kazoo
# logs each request it sends at DEBUG with its repr ("Sending request(xid=None): Auth(auth_type=0,
# scheme='digest', auth=...)"), and the cleaned options are shown wherever settings are. Option errors
# describe the shape of a bad value, never the value.

#: ZooKeeper's permission names, as DEFAULT_ACL's dict form spells them ("all": every one).
PERMISSIONS = {"read": Permissions.READ, "write": Permissions.WRITE, "create": Permissions.CREATE,
               "delete": Permissions.DELETE, "admin": Permissions.ADMIN}

#: Permissions that let a client change the lock znodes (not just read them).
_WRITING = Permissions.WRITE | Permissions.CREATE | Permissions.DELETE


class _Secret(str):
    """A credential: the string itself wherever it is used, ``'***'`` in every repr."""

    __slots__ = ()

    def __repr__(self):
        return repr(REDACTED)


def _shape(value):
    """Describe ``value`` by its type (and length), never its content: it may hold a secret."""
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} item(s): ({', '.join(type(v).__name__ for v in value)})"
    return f"a {type(value).__name__}"


class _SecretOption(Option):
    """An option that may hold a credential: ``parse`` cleans it, and an error describes its shape only.

    ``parse(value)`` returns the cleaned value or raises ``ValueError`` with a message that quotes no
    part of the value.
    """

    def __init__(self, parse, *, expected):
        super().__init__(object, parse(None), expected=expected)
        self._parse = parse

    def clean(self, alias, name, value):
        try:
            return self._parse(value)
        except ValueError as exc:
            raise ImproperlyConfigured(
                f"DISTLOCK['{alias}']['OPTIONS']['{name}'] must be {self.expected}; {exc} (the value is not "
                "shown: it may hold a secret)."
            ) from None


def _clean_auth_data(value):
    """Return AUTH_DATA as a tuple of (scheme, secret credential) pairs."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"got {_shape(value)}")
    pairs = []
    for index, pair in enumerate(value):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2
                and all(isinstance(part, str) and part for part in pair)):
            raise ValueError(f"item {index} is {_shape(pair)}, not a (scheme, credential) pair of non-empty strings")
        scheme, credential = pair
        if scheme == "sasl":
            raise ValueError(f'item {index} uses the "sasl" scheme, which kazoo no longer takes in auth_data')
        pairs.append((scheme, _Secret(credential)))
    return tuple(pairs)


def _permissions(value, index):
    if value == "all":
        return Permissions.ALL
    if (isinstance(value, (list, tuple)) and value
            and all(isinstance(name, str) and name in PERMISSIONS for name in value)):
        perms = 0
        for name in value:
            perms |= PERMISSIONS[name]
        return perms
    raise ValueError(f'entry {index}: "perms" must be "all" or a list of {", ".join(PERMISSIONS)}')


def _clean_acl_entry(entry, index):
    if isinstance(entry, ACL):
        if not (isinstance(entry.perms, int) and 0 < entry.perms <= Permissions.ALL and isinstance(entry.id, Id)
                and isinstance(entry.id.scheme, str) and isinstance(entry.id.id, str)):
            raise ValueError(f"entry {index} is a malformed kazoo ACL")
        scheme, identity, perms = entry.id.scheme, entry.id.id, entry.perms
    elif isinstance(entry, dict):
        keys = set(entry)
        if not ({"scheme", "perms"} <= keys <= {"scheme", "perms", "id", "credential"}) or len(keys) != 3:
            # The keys themselves are not quoted: a misplaced credential could be one.
            raise ValueError(f'entry {index} is a dict of {len(keys)} key(s); give exactly "scheme", "perms", and '
                             '"id" or (digest only) "credential"')
        scheme, perms = entry["scheme"], _permissions(entry["perms"], index)
        if not isinstance(scheme, str) or not scheme:
            raise ValueError(f'entry {index}: "scheme" must be a non-empty str')
        if "credential" in entry:
            credential = entry["credential"]
            if scheme != "digest" or not isinstance(credential, str) or ":" not in credential:
                raise ValueError(f'entry {index}: "credential" goes with the "digest" scheme, as a '
                                 '"user:password" str')
            identity = make_digest_acl_credential(*credential.split(":", 1))
        else:
            identity = entry["id"]
            if not isinstance(identity, str):
                raise ValueError(f'entry {index}: "id" must be a str, not {_shape(identity)}')
    else:
        raise ValueError(f"entry {index} is {_shape(entry)}, neither a kazoo ACL nor a dict")
    if scheme == "digest":
        identity = _Secret(identity)  # "user:<hash of the password>": a hash is still a secret
    return ACL(perms, Id(scheme, identity))


def _clean_default_acl(value):
    """Return DEFAULT_ACL as a tuple of kazoo ``ACL`` objects, None if not set (kazoo's open ACL)."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"got {_shape(value)}")
    return tuple(_clean_acl_entry(entry, index) for index, entry in enumerate(value))


def _clean_keyfile_password(value):
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"got {_shape(value)}")
    return _Secret(value)


def _valid_path(value):
    return None if value is None or os.fspath(value) else "must be a file path, not empty"


def _is_open(acl):
    """Return True if ``acl`` (cleaned DEFAULT_ACL) is missing or lets anyone change the znodes."""
    return not acl or any(entry.id.scheme == "world" and entry.perms & _WRITING for entry in acl)


def _tls_connection(address, hostname=None, timeout=None, *, ca=None, certfile=None, keyfile=None,
                    keyfile_password=None, verify_certs=True, **_):
    """Return a TLS socket connected to ``address``: kazoo's ``create_connection`` under ``USE_SSL``.

    It differs from kazoo's (``kazoo.handlers.utils.create_tcp_connection``) in two ways. A failed
    handshake closes its socket; kazoo drops it unclosed, once per retry against a server that refuses
    the certificate. And with ``CA`` set only that CA is trusted; kazoo adds the system's store, where,
    as it checks no host names, a certificate any public CA issued for any name would pass. Without
    ``CA``, the system store is used and the certificate must name the host as written in ``HOSTS``.
    Under gevent or eventlet, ``socket`` is the patched module. Called on kazoo's connection thread.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if ca:
        context.load_verify_locations(ca)
    else:
        context.load_default_certs(ssl.Purpose.SERVER_AUTH)
    context.check_hostname = verify_certs and not ca
    context.verify_mode = ssl.CERT_REQUIRED if verify_certs else ssl.CERT_NONE
    if certfile and keyfile:
        context.load_cert_chain(certfile=certfile, keyfile=keyfile, password=keyfile_password)
    family = socket.getaddrinfo(address[0], address[1], 0, socket.SOCK_STREAM)[0][0]
    raw = socket.socket(family)
    try:
        sock = context.wrap_socket(raw, server_hostname=hostname)
    except BaseException:
        raw.close()
        raise
    try:
        sock.settimeout(timeout)
        sock.connect(address)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except BaseException:
        sock.close()
        raise
    return sock


class _NegotiatingConnection(ConnectionHandler):
    """kazoo's connection handler, remembering the negotiated session timeout and the last proof of life.

    kazoo reads the timeout from the Connect reply but keeps it in a local variable; ``lease.session_timeout``
    must report it, because the server frees a dead holder's lock after that time, not after the
    one asked for (the server clamps it between 2 and 20 ticks). Pinned by test_zookeeper.py.

    ``last_answered_sent`` is when the newest request (or ping, or the Connect) that the server has
    answered was sent (monotonic): the server touched the session after that, so it expires no sooner
    than that plus the negotiated timeout. ``session_valid_until`` is bounded by it, so a holder frozen
    past its session fails ``check()`` the moment it wakes, before kazoo's thread hears of the expiry.
    Only kazoo's connection thread writes these; readers see whole floats.
    """

    negotiated_timeout = None
    last_answered_sent = None
    #: Why the last attempt to connect failed (a TLS handshake, an auth failure), as its repr (holding
    #: no traceback, whose frames would keep the failed socket alive); None once connected.
    last_failure = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._sent_at = {}  # xid -> when it was sent (pings share one xid, one at a time)

    def _connect(self, host, hostip, port):
        try:
            result = super()._connect(host, hostip, port)
        except Exception as exc:
            self.last_failure = repr(exc)
            raise
        self.last_failure = None
        return result

    def _invoke(self, timeout, request, xid=None):
        sent = time.monotonic()
        if isinstance(request, Connect):
            self._sent_at.clear()  # a new connection: nothing sent on the old one will be answered
        result = super()._invoke(timeout, request, xid)
        if isinstance(request, Connect):
            self.negotiated_timeout = result[0].time_out / 1000
            self.last_answered_sent = sent
        return result

    def _submit(self, request, timeout, xid=None):
        if xid is not None:
            self._sent_at[xid] = time.monotonic()
        return super()._submit(request, timeout, xid)

    def _read_header(self, timeout):
        header, buffer, offset = super()._read_header(timeout)
        sent = self._sent_at.pop(header.xid, None)
        if sent is not None and header.err not in (SessionExpiredError.code, SessionMovedError.code):
            if self.last_answered_sent is None or sent > self.last_answered_sent:
                self.last_answered_sent = sent
        return header, buffer, offset


class _Contender:
    """One acquisition attempt: its node's name prefix, and the node once created."""

    def __init__(self, parent, owner, kind):
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
        #: The backend's session epoch before the node was created: a LOST since then took the node.
        self.epoch = None

    @property
    def node(self):
        return self.path.rsplit("/", 1)[1]

    @property
    def sequence(self):
        return int(_NODE_NAME.match(self.node)["sequence"])

    def forget_node(self):
        """The node went with its session (or was deleted): the next round creates a new one."""
        self.path = self.token = None
        self.uncertain = False
        self.token_fresh = False


class _ExpiryTimer:
    """Delete holders' znodes when their ttl runs out: ZooKeeper itself knows only sessions.

    One daemon thread (a greenlet under gevent) per kazoo client, waiting on a condition for the
    earliest deadline (monotonic); an extension moves a deadline (a shorter ttl, earlier), a release
    cancels it. ``expire`` must not block.
    """

    def __init__(self, expire, name):
        self._expire = expire
        self._deadlines = {}
        self._heap = []  # (deadline, path); entries whose deadline moved are skipped when they surface
        self._changed = threading.Condition()
        self._stopped = False
        self._thread = Daemon(self._run, name=name)
        self._thread.start()

    def schedule(self, path, deadline):
        with self._changed:
            self._deadlines[path] = deadline
            heapq.heappush(self._heap, (deadline, path))
            if self._heap[0] == (deadline, path):
                self._changed.notify()  # wake the thread only if it now has to wake sooner

    def move(self, path, deadline):
        """Set ``path``'s deadline, earlier or later; return False if it already expired or was cancelled."""
        with self._changed:
            if path not in self._deadlines:
                return False
            self._deadlines[path] = deadline
            heapq.heappush(self._heap, (deadline, path))
            if self._heap[0] == (deadline, path):
                self._changed.notify()
            self._compact()
            return True

    def cancel(self, path):
        with self._changed:
            self._deadlines.pop(path, None)
            self._compact()

    def _compact(self):
        """Drop stale heap entries once they outnumber live ones, so long ttls cannot pile them up."""
        if len(self._heap) > 2 * len(self._deadlines) + 1024:
            self._heap = [(deadline, path) for path, deadline in self._deadlines.items()]
            heapq.heapify(self._heap)

    def stop(self):
        with self._changed:
            self._stopped = True
            self._changed.notify()
        if not self._thread.is_current():
            self._thread.join()

    def end_in_child(self):
        """In a forked child: end the parent's greenlet, which would delete the parent's znodes."""
        self._thread.end_in_child()

    def _due(self):
        """Pop and return the paths whose deadline passed; the caller holds the condition."""
        now, due = time.monotonic(), []
        while self._heap and self._heap[0][0] <= now:
            deadline, path = heapq.heappop(self._heap)
            if self._deadlines.get(path) == deadline:
                del self._deadlines[path]
                due.append(path)
        return due

    def _run(self):
        while True:
            with self._changed:
                due = self._due()
                if not due:
                    if self._stopped:
                        return
                    wait = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._changed.wait(wait)
                    continue
            for path in due:
                try:
                    self._expire(path)
                except BaseException as exc:  # noqa: BLE001 - the timer must outlive any one failure
                    if killed(exc):
                        raise  # ended on purpose (a forked child)
                    logger.exception("Deleting the expired znode %s failed; the timer carries on.", path)


def _detach(sock):
    """Point this process's descriptor of ``sock`` at /dev/null: the connection stays the parent's, out of reach."""
    if sock is not None and sock.fileno() >= 0:
        devnull = os.open(os.devnull, os.O_RDWR)
        try:
            os.dup2(devnull, sock.fileno())
        finally:
            os.close(devnull)


#: Every live backend of this process, for the fork hook (``_after_fork_in_child``).
_BACKENDS = weakref.WeakSet()


def _after_fork_in_child():
    for backend in list(_BACKENDS):
        backend._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


class ZooKeeperBackend(BaseLockBackend):
    """Locks as ephemeral sequential znodes on a ZooKeeper ensemble (layout and protocol above).

    One kazoo client per backend, hence per alias and process, shared by every lease and thread and
    connected on first use. kazoo's connection states (``kazoo/protocol/states.py``) map onto leases:

    - SUSPENDED, "the connection has been lost but may be recovered ... A client should not assume
      that locks are valid during this time": held leases are suspended, ``check()`` raises
      ``LockSuspended``.
    - CONNECTED again, same session: a suspended lease whose znode still exists is valid again; one
      whose znode is gone is marked lost.
    - LOST, "the connection has been confirmed dead ... locks ... can be considered lost": held leases
      are marked lost and ``lock_lost`` is sent. So are leases whose connection stayed suspended longer
      than the session timeout: the server has expired the session by then, even if this client
      cannot reach a server to hear it. Every affected lease fails ``check()`` before the first
      ``lock_lost`` is sent, and the thread that sends them logs a receiver's exception and goes on.
    - Between state changes, ``check()`` is bounded by the session: a lease is lost once the
      negotiated timeout has passed since the newest answered request or ping was *sent*, whether or
      not kazoo's thread has run since (a holder frozen past its session finds out when it wakes).

    ``ttl`` keeps its meaning: this process deletes the znode when it runs out unless extended. A
    holder that dies or hangs is freed by the server only when its session expires,
    ``lease.session_timeout`` seconds (as negotiated with the server) after its last heartbeat.
    """

    #: safe_fencing_tokens: czxids never go backwards. read_write: ``acquire_shared()``.
    #: notifications: waiters watch their predecessor's znode.
    capabilities = frozenset({SAFE_FENCING_TOKENS, READ_WRITE, NOTIFICATIONS})

    options = {
        "HOSTS": Option(str, required=True, check=_valid_hosts,
                        expected='the ensemble as "host:port,host:port,..."'),
        "ROOT": Option(str, ROOT_DEFAULT, check=_valid_root, expected='an absolute znode path such as "/distlock"'),
        "SESSION_TIMEOUT": Option((int, float), 10, check=_valid_session_timeout, expected="a number of seconds"),
        "CONNECTION_TIMEOUT": Option((int, float), 5, check=positive_number, expected="a number of seconds"),
        # Security (see "Security options" above), named after KazooClient's arguments.
        "AUTH_DATA": _SecretOption(_clean_auth_data, expected='a list of (scheme, credential) pairs such as '
                                                             '[("digest", "user:password")]'),
        "DEFAULT_ACL": _SecretOption(_clean_default_acl, expected='a non-empty list of kazoo ACLs or of dicts such as '
                                                                 '{"scheme": "digest", "credential": "user:password", '
                                                                 '"perms": "all"}, or None'),
        "USE_SSL": Option(bool, False),
        "CA": Option((str, os.PathLike, type(None)), None, check=_valid_path,
                     expected="the path of a PEM file of CA certificates, or None"),
        "CERTFILE": Option((str, os.PathLike, type(None)), None, check=_valid_path,
                           expected="the path of the client's PEM certificate, or None"),
        "KEYFILE": Option((str, os.PathLike, type(None)), None, check=_valid_path,
                          expected="the path of the client's PEM private key, or None"),
        "KEYFILE_PASSWORD": _SecretOption(_clean_keyfile_password, expected="the password of KEYFILE (a str), or None"),
        "VERIFY_CERTS": Option(bool, True),
    }

    @classmethod
    def check_combination(cls, alias, options):
        where = f"DISTLOCK['{alias}']['OPTIONS']"
        if not options["USE_SSL"]:
            ignored = [name for name in ("CA", "CERTFILE", "KEYFILE", "KEYFILE_PASSWORD") if options[name] is not None]
            ignored += [] if options["VERIFY_CERTS"] else ["VERIFY_CERTS"]
            if ignored:
                raise ImproperlyConfigured(f"{where} sets {', '.join(ignored)}, which only apply with USE_SSL True: "
                                           "set USE_SSL, or remove them.")
        if (options["CERTFILE"] is None) != (options["KEYFILE"] is None):
            raise ImproperlyConfigured(f"{where} must set CERTFILE and KEYFILE together: kazoo presents a client "
                                       "certificate only with both.")
        if options["KEYFILE_PASSWORD"] is not None and options["KEYFILE"] is None:
            raise ImproperlyConfigured(f"{where} sets KEYFILE_PASSWORD without KEYFILE.")

    @classmethod
    def security_warnings(cls, alias, options):
        """Warn when znodes are open to any client that reaches the ensemble, or TLS trusts anyone."""
        warnings = []
        acl_protects = bool(options["AUTH_DATA"]) and not _is_open(options["DEFAULT_ACL"])
        if not options["USE_SSL"] and not acl_protects:
            warnings.append(
                "ZooKeeper znodes are created with the open ACL (world:anyone) and the connection uses no TLS: any "
                "host that can reach the ensemble can delete holders' znodes (taking their locks) or plant children "
                "that block a lock. Set AUTH_DATA and a DEFAULT_ACL for those credentials (for example "
                '[{"scheme": "digest", "credential": "user:password", "perms": "all"}]), or USE_SSL with client '
                "certificates that the ensemble requires."
            )
        elif options["AUTH_DATA"] and _is_open(options["DEFAULT_ACL"]):
            warnings.append("AUTH_DATA authenticates the session, but DEFAULT_ACL is unset or lets world:anyone "
                            "write: the lock znodes are open to every client. Set a DEFAULT_ACL for those credentials.")
        if acl_protects and options["ROOT"].count("/") == 1:
            warnings.append(
                f"ROOT {options['ROOT']!r} sits directly under \"/\", which ZooKeeper leaves open: while no lock is "
                "held, a client without the credentials can delete it and make it again with the open ACL, then "
                "delete holders' znodes. Use a ROOT two levels deep such as \"/distlock/locks\": the backend creates "
                "both levels with DEFAULT_ACL, and never deletes ROOT, so neither can be deleted by others."
            )
        if options["USE_SSL"] and not options["VERIFY_CERTS"]:
            warnings.append("VERIFY_CERTS is False: the TLS connection accepts any server certificate, so anyone on "
                            "the path can pose as the ensemble. Set CA to the ensemble's CA and keep VERIFY_CERTS.")
        return warnings

    def __init__(self, alias, options):
        super().__init__(alias, options)
        self._root = self.settings["ROOT"]
        self._client = None
        self._client_lock = threading.Lock()
        #: Set while kazoo reports CONNECTED; cleared by SUSPENDED and LOST.
        self._connected = threading.Event()
        #: Guards the state below, and orders lease suspension and registration against state changes.
        self._registry_lock = threading.Lock()
        self._held = weakref.WeakValueDictionary()  # node path -> Lease
        self._waiters = set()  # Events of threads waiting for a predecessor, woken on state changes
        self._litter = set()  # (parent, prefix, path or None): nodes to delete once connected again
        self._crowded_parents = {}  # parents recently seen with other contenders, oldest first
        #: Incremented (under the registry lock) on every LOST: leases of an older epoch died with it.
        self._session_epoch = 0
        self._expiry = None
        self._states = None
        self._queue_empty = queue.Empty
        self._state_thread = None
        #: Lease -> the session epoch it was granted in; None once marked lost (``session_valid_until``).
        self._lease_epochs = weakref.WeakKeyDictionary()
        #: Znode paths seen to be ephemeral: the protocol ignores persistent (planted) children.
        self._checked_ephemeral = {}
        #: "gevent" or "eventlet" if this process is monkey-patched by it: kazoo gets that library's handler.
        self._green = green_library()
        self._offload = Offloader(alias, f"distlock-zk-runner:{alias}", self._green)
        _BACKENDS.add(self)

    # -- the client and its connection states ------------------------------------------------------

    def _session(self, io_deadline):
        """Return the kazoo client once connected, waiting until ``io_deadline``; raise ``BackendUnavailable``."""
        client = self._client or self._start_client()
        if not self._connected.wait(max(io_deadline - time.monotonic(), 0)):
            failure = client._connection.last_failure
            failure = f" The last attempt failed with {redact(failure)}." if failure is not None else ""
            tls = " and that the TLS options (CA, CERTFILE, KEYFILE) fit it" if self.settings["USE_SSL"] else ""
            raise BackendUnavailable(
                f"ZooKeeper alias '{self.alias}' could not connect to {self.settings['HOSTS']} in time; "
                f"check that the ensemble is up and reachable{tls} (OPTIONS['CONNECTION_TIMEOUT'] bounds the "
                f"wait).{failure}"
            )
        return client

    def _start_client(self):
        with self._client_lock:
            if self._client is None:
                handler = _kazoo_handler(self._green)
                if self.settings["USE_SSL"]:
                    handler.create_connection = _tls_connection
                # A dict would make kazoo build a retry with the threading sleep, which it then refuses
                # next to a gevent or eventlet handler.
                client = KazooClient(hosts=self.settings["HOSTS"], timeout=self.settings["SESSION_TIMEOUT"],
                                     handler=handler,
                                     connection_retry=KazooRetry(sleep_func=handler.sleep_func, **RECONNECT),
                                     command_retry=KazooRetry(sleep_func=handler.sleep_func),
                                     auth_data=list(self.settings["AUTH_DATA"]) or None,
                                     default_acl=self.settings["DEFAULT_ACL"],
                                     use_ssl=self.settings["USE_SSL"], verify_certs=self.settings["VERIFY_CERTS"],
                                     ca=self.settings["CA"], certfile=self.settings["CERTFILE"],
                                     keyfile=self.settings["KEYFILE"],
                                     keyfile_password=self.settings["KEYFILE_PASSWORD"])
                client._connection = _NegotiatingConnection(client, client._conn_retry.copy(), logger=client.logger)
                self._expiry = _ExpiryTimer(self._expire, name=f"distlock-zk-expiry:{self.alias}")
                # A C SimpleQueue would block the whole hub of a green process in the state thread's get().
                self._states = handler.queue_impl() if self._green else queue.SimpleQueue()
                self._queue_empty = handler.queue_empty if self._green else queue.Empty
                self._state_thread = Daemon(self._follow_states, client, self._states,
                                            name=f"distlock-zk-states:{self.alias}")
                self._state_thread.start()
                client.add_listener(self._on_state)
                client.start_async()
                self._client = client
            return self._client

    def _after_fork_in_child(self):
        """Leave the parent's session to the parent: a forked child opens its own at its first call.

        The parent's threads do not exist here; under gevent its greenlets do, kazoo's among them, which
        would read the parent's replies and ping on its socket: they are ended, and the parent's sockets
        are detached first, against a greenlet woken before the fork that runs before its end. Never
        takes the old locks (a thread of the parent may have held one). The parent's leases fail
        ``check()`` here, and releasing or extending one does nothing.
        """
        client, self._client = self._client, None
        self._client_lock = threading.Lock()
        self._registry_lock = threading.Lock()
        self._connected = threading.Event()
        self._session_epoch += 1
        self._held = weakref.WeakValueDictionary()
        self._waiters, self._litter, self._crowded_parents = set(), set(), {}
        if client is None:
            return
        client.remove_listener(self._on_state)
        if self._green == "gevent":
            connection = client._connection
            for sock in (connection._socket, connection._read_sock, connection._write_sock):
                _detach(sock)
            for greenlet in (connection._connection_routine, *client.handler._workers):
                if greenlet is not None:
                    greenlet.kill(block=False)
        self._expiry.end_in_child()
        self._state_thread.end_in_child()
        self._expiry = self._states = self._state_thread = None

    @property
    def session_timeout(self):
        """Seconds after which the server expires this client's session if it stops heartbeating."""
        connection = self._client and self._client._connection
        return (connection and connection.negotiated_timeout) or self.settings["SESSION_TIMEOUT"]

    def session_valid_until(self, lease):
        """Return when ``lease``'s session may have expired on the server: fail closed (``check()`` calls it).

        -inf once the lease is marked lost or its session ended (LOST); else the negotiated timeout
        after the newest answered request or ping was sent. Lock-free and local.
        """
        epoch = self._lease_epochs.get(lease, _UNKNOWN)
        if epoch is _UNKNOWN:
            return None  # not granted by this backend
        client = self._client
        connection = client and client._connection
        answered = connection and connection.last_answered_sent
        if epoch is None or epoch != self._session_epoch or answered is None:
            return -math.inf
        return answered + (connection.negotiated_timeout or self.settings["SESSION_TIMEOUT"])

    def _mark_dead(self, leases):
        """Make every one of ``leases`` fail ``check()`` at once, before any ``lock_lost`` is sent."""
        for lease in leases:
            self._lease_epochs[lease] = None

    def _announce_lost(self, leases, reason):
        """Mark each lease lost and send ``lock_lost``: a receiver that raises stops neither the rest nor us."""
        for lease in leases:
            try:
                lease.mark_lost(reason)
            except BaseException:  # noqa: BLE001 - a backend thread must outlive any receiver
                logger.exception("Reporting the loss of lock %r (alias %r) raised; the other leases are "
                                 "reported and the ZooKeeper state thread carries on.", lease.name, self.alias)

    # -- running operations out of reach of signal handlers (see "Interrupts" above) ---------------------

    def _call(self, fn, *, abandon=None):
        """Return ``fn(job)``, run where no exception raised asynchronously in the caller can cut it short."""
        return self._offload.call(fn, abandon=abandon)

    def _give_back(self, lease):
        """Release a lease granted to a caller that was interrupted before it could take it."""
        logger.info("Releasing lock %r (alias %r, token %s): the call that acquired it was interrupted.",
                    lease.name, self.alias, lease.token)
        self._mark_dead([lease])
        self._release(lease)

    def _on_state(self, state):
        """Run in kazoo's connection thread: flag leases and wake waiters, hand everything else off."""
        if state == KazooState.CONNECTED:
            self._connected.set()
        else:
            self._connected.clear()
            with self._registry_lock:
                if state == KazooState.LOST:
                    self._session_epoch += 1
                for lease in self._held.values():
                    lease.mark_suspended(True)
        with self._registry_lock:
            waiters = list(self._waiters)
        for wake in waiters:
            wake.set()
        self._states.put(state)

    def _follow_states(self, client, states):
        """React to connection states off kazoo's thread, where blocking requests are allowed.

        Runs for the life of the client: anything that raises while handling one state (a receiver,
        a request) is logged, and the next state is followed all the same.
        """
        suspended_since = None
        while True:
            try:
                wait = None
                if suspended_since is not None:
                    wait = max(suspended_since + self.session_timeout - time.monotonic(), 0)
                try:
                    state = states.get(timeout=wait)
                except self._queue_empty:
                    suspended_since = None
                    self._lose_all(f"the connection stayed suspended longer than the session timeout "
                                   f"({self.session_timeout:g}s), so the server has expired the session")
                    continue
                if state is None:
                    return
                if state == KazooState.SUSPENDED:
                    suspended_since = suspended_since or time.monotonic()
                elif state == KazooState.LOST:
                    suspended_since = None
                    self._lose_all("the ZooKeeper session expired (its ephemeral znodes are gone)")
                else:
                    suspended_since = None
                    self._revalidate(client)
                    self._sweep_litter(client)
            except BaseException as exc:  # noqa: BLE001 - loss detection must outlive any one failure
                if killed(exc):
                    raise  # ended on purpose (a forked child)
                logger.exception("Following the ZooKeeper connection state of alias %r raised; carrying on.",
                                 self.alias)

    def _lose_all(self, reason):
        with self._registry_lock:
            leases = list(self._held.values())
            self._held.clear()
            self._mark_dead(leases)
            # If the session survives after all, its nodes must not block others: delete them on reconnect.
            self._litter.update((lease.handle.rsplit("/", 1)[0], None, lease.handle) for lease in leases)
        for lease in leases:
            self._expiry.cancel(lease.handle)
        self._announce_lost(leases, reason)

    def _revalidate(self, client):
        """After a reconnection within the session: unsuspend leases whose znode is still ours."""
        with self._registry_lock:
            suspended = [lease for lease in self._held.values() if lease.suspended]
        if not suspended:
            return
        replies = [(lease, client.exists_async(lease.handle)) for lease in suspended]
        session_id = (client.client_id or (None,))[0]
        io_deadline = self._io_deadline(None)
        gone = []
        for lease, reply in replies:
            try:
                stat = self._result(reply, io_deadline)
            except (KazooException, BackendUnavailable):
                continue  # still uncertain: the next reconnection, or the session timeout, decides
            if stat is not None and stat.ephemeralOwner == session_id:
                with self._registry_lock:
                    # The listener clears _connected before suspending under this lock: no lost update.
                    if self._connected.is_set():
                        lease.mark_suspended(False)
            else:
                self._mark_dead([lease])
                gone.append(lease)
        for lease in gone:
            self._forget(lease.handle)
        self._announce_lost(gone, "its znode was gone when the connection came back")

    def _sweep_litter(self, client):
        with self._registry_lock:
            litter, self._litter = self._litter, set()
        io_deadline = self._io_deadline(None)
        for parent, prefix, path in litter:
            try:
                paths = [path] if path else [f"{parent}/{child}" for child in self._children(client, parent, io_deadline)
                                             if child.startswith(prefix)]
                for node in paths:
                    with suppress(NoNodeError):
                        self._result(client.delete_async(node), io_deadline)
                client.delete_async(parent)
            except (KazooException, BackendUnavailable):
                with self._registry_lock:
                    self._litter.add((parent, prefix, path))

    def _children(self, client, parent, io_deadline):
        try:
            return self._result(client.get_children_async(parent), io_deadline)
        except NoNodeError:
            return []

    # -- requests --------------------------------------------------------------------------------

    def _io_deadline(self, deadline):
        """Return when a request must have answered: CONNECTION_TIMEOUT from now, sooner near the caller's deadline."""
        now = time.monotonic()
        bound = self.settings["CONNECTION_TIMEOUT"]
        if deadline is not None:
            bound = min(bound, max(deadline - now, 0) + REQUEST_GRACE)
        return now + bound

    def _result(self, reply, io_deadline):
        """Return a request's result, raising its kazoo error; ``BackendUnavailable`` if it is late."""
        # wait() then ready(): each handler's get() raises its own kind of timeout (gevent's is a
        # gevent.Timeout, which must never be confused with a caller's own time limit).
        reply.wait(max(io_deadline - time.monotonic(), 0))
        if not reply.ready():
            raise BackendUnavailable(
                f"ZooKeeper alias '{self.alias}' ({self.settings['HOSTS']}) did not answer in time; "
                "OPTIONS['CONNECTION_TIMEOUT'] bounds each request."
            )
        return reply.get(block=False)

    @contextmanager
    def _translate_errors(self, action):
        """Turn any kazoo error into ``BackendUnavailable``: a lock fails closed."""
        try:
            yield
        except (KazooException, KazooTimeoutError) as exc:
            raise BackendUnavailable(
                f"ZooKeeper alias '{self.alias}' ({self.settings['HOSTS']}) failed while {action}: {exc!r}"
            ) from exc

    def _parent_path(self, name):
        return f"{self._root}/{encode_name(name)}"

    def _crowded(self, parent, crowded=True):
        """Remember (or forget) that others queue under ``parent``: then a multi would only fail."""
        with self._registry_lock:
            if not crowded:
                self._crowded_parents.pop(parent, None)
                return
            self._crowded_parents[parent] = True
            if len(self._crowded_parents) > CROWDED_NAMES:
                del self._crowded_parents[next(iter(self._crowded_parents))]

    def _send_leave(self, path, *, awaited=False):
        """Delete ``path``, and its parent if that leaves it empty, without waiting; return the node's reply.

        Unless the caller ``awaited`` the reply itself, a delete cut off by a connection loss is kept
        as litter, to be deleted after reconnecting.
        """
        client, parent = self._client, path.rsplit("/", 1)[0]
        if client is None:
            return None
        reply = client.delete_async(path)
        if not awaited:
            reply.rawlink(partial(self._left, parent, path))
        client.get_children_async(parent).rawlink(partial(self._delete_if_empty, client, parent))
        return reply

    def _left(self, parent, path, reply):
        """kazoo callback: keep a node whose delete was cut off, to delete it once reconnected."""
        if isinstance(reply.exception, ConnectionLoss):
            with self._registry_lock:
                self._litter.add((parent, None, path))

    def _delete_if_empty(self, client, parent, listing):
        """kazoo callback: the last one out deletes the parent (NotEmpty if someone just queued: fine)."""
        if listing.successful() and not listing.value:
            self._crowded(parent, False)
            client.delete_async(parent)

    def _forget(self, path):
        with self._registry_lock:
            self._held.pop(path, None)
        if self._expiry is not None:
            self._expiry.cancel(path)

    def _expire(self, path):
        """Expiry timer callback: the lease's ttl ran out, its holder did not extend it."""
        with self._registry_lock:
            self._held.pop(path, None)
        self._send_leave(path)

    # -- acquiring -------------------------------------------------------------------------------

    def acquire(self, name, *, ttl, timeout, blocking):
        """Return an exclusive ``Lease`` on ``name`` (a write node: it excludes readers as well)."""
        return self._call(partial(self._acquire, name, WRITE, ttl=ttl, timeout=timeout, blocking=blocking),
                          abandon=self._give_back)

    def acquire_shared(self, name, mode, *, ttl, timeout, blocking):
        """Return a ``Lease`` on the read/write lock ``name``: ``mode`` "read" (shared) or "write" (exclusive)."""
        if mode not in (READ, WRITE):
            raise ValueError(f'mode must be "read" or "write", got {mode!r}.')
        return self._call(partial(self._acquire, name, mode, ttl=ttl, timeout=timeout, blocking=blocking),
                          abandon=self._give_back)

    def _acquire(self, name, kind, job, *, ttl, timeout, blocking):
        deadline = None if timeout is None else time.monotonic() + timeout
        contender = _Contender(self._parent_path(name), new_owner(), kind)
        attempt = Attempt(name=name, owner=contender.owner, ttl=ttl, blocking=blocking, deadline=deadline)
        with self._translate_errors(f"acquiring lock {name!r}"):
            try:
                while True:
                    started, looks = self._take_turn(contender, deadline, blocking, name, timeout, job)
                    attempt.tries += looks
                    lease = self.make_lease(name, contender.owner, ttl, started, Grant(
                        token=contender.token, handle=contender.path, session_timeout=self.session_timeout))
                    lease.attempts = attempt.tries
                    late = lease.remaining() <= 0
                    if not late and self._hold(lease, contender.epoch):
                        return lease
                    # The grant came back after the ttl had run out (this process paused, or the
                    # ensemble is slower than the ttl), or the session that made the node ended before
                    # the lease was registered (so LOST found no lease to mark): never hand out such a
                    # lease. Give the node back and queue again while the timeout allows.
                    self._send_leave(contender.path)
                    contender.forget_node()
                    if late:
                        attempt.late_grants += 1
                        refuse_after_late_grants(attempt.late_grants, self.alias, name, ttl)
                    if deadline is not None and time.monotonic() >= deadline:
                        raise LockNotAcquired(
                            f"Lock {name!r} on alias '{self.alias}' not acquired: its grant arrived after the "
                            f"ttl of {ttl:g}s had run out, or after its session ended; retry or use a longer ttl."
                        )
            except BaseException:
                self._abandon(contender)
                raise

    def _hold(self, lease, epoch):
        """Register a granted lease for state changes and expiry; False if its session ended since ``epoch``."""
        with self._registry_lock:
            if epoch != self._session_epoch:
                return False
            self._held[lease.handle] = lease
            self._lease_epochs[lease] = epoch
            if not self._connected.is_set():
                lease.mark_suspended(True)
        self._expiry.schedule(lease.handle, time.monotonic() + lease.ttl)
        return True

    def _take_turn(self, contender, deadline, blocking, name, timeout, job):
        """Queue ``contender`` and wait until its node holds the lock.

        Return when the request that showed the grant was sent (monotonic), and how many looks it took.
        Raise ``Abandoned`` once ``job`` is cancelled (its caller was interrupted).
        """
        looks = 0
        while True:
            if job.cancelled:
                raise Abandoned(name)
            looks += 1
            io_deadline = self._io_deadline(deadline)
            # Read before any request of this round: a LOST after it makes the node's epoch stale.
            epoch = self._session_epoch
            started = time.monotonic()
            contender.token_fresh = False
            try:
                client = self._session(io_deadline)
                if contender.path is None:
                    children = self._enter_queue(client, contender, io_deadline, trying=not blocking)
                    contender.epoch = epoch
                    if children is None:
                        return started, looks
                else:
                    children = self._children(client, contender.parent, io_deadline)
                blocker, children = self._live_blocker(client, contender, children, io_deadline)
                if len(children) > 1:
                    self._crowded(contender.parent)
                if blocker is None:
                    if not contender.token_fresh:
                        self._restamp(client, contender, io_deadline)
                    return started, looks
                remaining = None if deadline is None else deadline - time.monotonic()
                if not blocking or (remaining is not None and remaining <= 0):
                    raise LockNotAcquired(self._not_acquired_message(name, blocking, timeout))
                self._wait_for(client, f"{contender.parent}/{blocker}", remaining, io_deadline, job)
            except Taken:
                raise LockNotAcquired(self._not_acquired_message(name, blocking, timeout)) from None
            except ConnectionClosedError:
                raise  # the backend was closed under us: BackendUnavailable, no new session
            except ConnectionLoss:
                # Whether a create ran is unknown; the session, and any node of ours, live on.
                contender.uncertain = contender.path is None
            except (SessionExpiredError, NodeGone):
                contender.forget_node()

    def _enter_queue(self, client, contender, io_deadline, *, trying=False):
        """Create ``contender``'s node (or find the one a lost reply created); record its path and token.

        Return the children listed right behind the create, or None if the node is the first one in a
        parent it created itself: then it holds the lock. A try (``trying``) raises ``Taken`` instead of
        queuing behind a node it would wait for.
        """
        if contender.uncertain:
            contender.uncertain = False
            children = self._children(client, contender.parent, io_deadline)
            for child in children:
                if child.startswith(contender.prefix):
                    stat = self._result(client.exists_async(f"{contender.parent}/{child}"), io_deadline)
                    if stat is not None:
                        contender.path, contender.token = f"{contender.parent}/{child}", stat.czxid
                        return children
        while True:
            with self._registry_lock:
                crowded = contender.parent in self._crowded_parents
            try:
                if trying:
                    return self._try_create(client, contender, io_deadline)
                return self._create(client, contender, io_deadline, with_parent=not crowded)
            except NodeExistsError:
                self._crowded(contender.parent)  # the parent exists: others queue
            except NoNodeError:
                if crowded:
                    self._crowded(contender.parent, False)  # a leaver deleted the parent: start over
                else:  # no ROOT yet (first use of this alias)
                    with suppress(NodeExistsError):
                        self._result(client.create_async(self._root, makepath=True), io_deadline)

    def _create(self, client, contender, io_deadline, *, with_parent):
        """Create the node in one multi, with its parent if ``with_parent``; record its path and token.

        Return the children listed right behind the multi, or None when the multi made the parent too:
        the node is then its first child and holds the lock.
        """
        committed = self._send_create(client, contender, with_parent=with_parent)
        listing = None if with_parent else client.get_children_async(contender.parent)
        self._made(committed, contender, io_deadline)
        if listing is None:
            return None
        try:
            return self._result(listing, io_deadline)
        except NoNodeError:
            return []

    def _try_create(self, client, contender, io_deadline):
        """Create a try's node only where it would hold ("Tries" above); return as ``_create``.

        Raise ``Taken``, with no node made, when a listing shows a node the try would wait for.
        """
        version = None  # the parent's data version last listed; None: make the parent with the node
        for _ in range(TRY_ROUNDS):
            committed = self._send_create(client, contender, with_parent=version is None, parent_version=version)
            # Behind the multi, even a failed one, so it shows why it failed.
            listing = client.get_children_async(contender.parent, include_data=True)
            try:
                self._made(committed, contender, io_deadline)
            except (NodeExistsError, BadVersionError, NoNodeError) as exc:
                if version is None and isinstance(exc, NoNodeError):
                    raise  # no ROOT yet
            else:
                if version is None:
                    return None
                with suppress(NoNodeError):
                    return self._result(listing, io_deadline)[0]
                return []
            try:
                children, stat = self._result(listing, io_deadline)
            except NoNodeError:
                version = None  # the parent went since the multi: make it
                continue
            if self._live_ahead(client, contender, children, io_deadline) is not None:
                raise Taken(contender.parent)
            version = stat.version
        return self._create(client, contender, io_deadline, with_parent=version is None)

    def _send_create(self, client, contender, *, with_parent, parent_version=None):
        """Send the multi that creates ``contender``'s node; return its async reply for ``_made``.

        It makes the parent first if ``with_parent``, or first checks that the parent's data version is
        still ``parent_version`` if given; it ends by stamping the parent (set_data): all operations of
        a multi share one zxid, so the stamp's mzxid is our node's czxid and comes with the reply.
        """
        transaction = client.transaction()
        if parent_version is not None:
            transaction.check(contender.parent, parent_version)
        if with_parent:
            transaction.create(contender.parent)
        transaction.create(f"{contender.parent}/{contender.prefix}", contender.data, ephemeral=True, sequence=True)
        transaction.set_data(contender.parent, b"")
        return transaction.commit_async()

    def _made(self, committed, contender, io_deadline):
        """Wait for a create multi; record the node's path and token, or raise the failed operation's error."""
        try:
            results = self._result(committed, io_deadline)
        except BackendUnavailable:
            committed.rawlink(self._delete_late_node)
            raise
        made_node, stamped = results[-2:]
        if not isinstance(made_node, str):
            raise next(result for result in results if not isinstance(result, (RolledBackError, RuntimeInconsistency)))
        contender.path, contender.token = made_node, stamped.mzxid
        # The czxid is a safe token only if our node was alone at that zxid. The listing behind the
        # multi is read later: a node queued before ours may have been granted (re-stamped above our
        # czxid) and released in between, so "first in the listing" alone would hand us a lower token.
        contender.token_fresh = stamped.numChildren == 1

    def _restamp(self, client, contender, io_deadline):
        """Give a holder that queued a token of its grant: the mzxid of a write to its own node."""
        try:
            stat = self._result(client.set_async(contender.path, contender.data), io_deadline)
        except NoNodeError:
            raise NodeGone(contender.path) from None
        contender.token = stat.mzxid

    def _delete_late_node(self, reply):
        """kazoo callback for a create we gave up on: delete the node if it was made after all."""
        if not reply.successful():
            return
        made_node = reply.value[-2]  # the multi's results: [check or create parent,] create node, set_data parent
        if isinstance(made_node, str):
            self._send_leave(made_node)

    def _live_blocker(self, client, contender, children, io_deadline):
        """Return the child ``contender`` waits for (None: it holds) and the listing without foreign nodes.

        A persistent child is no contender ("Foreign children" above): it is dropped and the rules applied
        again. Raise ``NodeGone`` as ``blocker_of``.
        """
        while True:
            blocker = blocker_of(contender.node, children)
            if blocker is None or self._ephemeral(client, f"{contender.parent}/{blocker}", io_deadline):
                return blocker, children
            children = [child for child in children if child != blocker]

    def _live_ahead(self, client, contender, children, io_deadline):
        """Return the (ephemeral) child a try would wait for, as ``ahead_of``; None if none."""
        while True:
            ahead = ahead_of(contender.kind, children)
            if ahead is None or self._ephemeral(client, f"{contender.parent}/{ahead}", io_deadline):
                return ahead
            children = [child for child in children if child != ahead]

    def _ephemeral(self, client, path, io_deadline):
        """Return False if ``path`` is a persistent node (or gone), True if ephemeral; remembered once seen."""
        if path in self._checked_ephemeral:
            return True
        stat = self._result(client.exists_async(path), io_deadline)
        if stat is None:
            return False  # gone meanwhile: not in the way any more
        if stat.ephemeralOwner == 0:
            logger.warning("Ignoring %s: a persistent node among the lock's contenders (see distlock check).", path)
            return False
        self._checked_ephemeral[path] = True
        if len(self._checked_ephemeral) > CHECKED_NODES:
            with suppress(StopIteration, KeyError, RuntimeError):
                del self._checked_ephemeral[next(iter(self._checked_ephemeral))]
        return True

    def _wait_for(self, client, path, remaining, io_deadline, job):
        """Sleep until ``path`` is deleted, the connection changes state, ``job`` is cancelled, or ``remaining`` passes."""
        wake = threading.Event()

        def watch(event):
            # A holder that queued re-stamps its node (set_data) at its grant: that is no release.
            # Watches fire once, so re-arm; a node gone meanwhile (None, or an error) wakes us.
            if event.type == EventType.CHANGED:
                client.exists_async(path, watch=watch).rawlink(
                    lambda reply: None if reply.successful() and reply.value is not None else wake.set())
            else:
                wake.set()

        with self._registry_lock:
            self._waiters.add(wake)
        job.wake = wake
        try:
            try:
                self._result(client.get_async(path, watch=watch), io_deadline)
            except NoNodeError:
                return
            if not job.cancelled:
                wake.wait(remaining)
        finally:
            with self._registry_lock:
                self._waiters.discard(wake)

    def _abandon(self, contender):
        """Withdraw a contender that timed out, missed, or was interrupted; never blocks."""
        if contender.path is not None:
            self._send_leave(contender.path)
        elif contender.uncertain:
            with self._registry_lock:
                self._litter.add((contender.parent, contender.prefix, None))

    # -- holding -------------------------------------------------------------------------------

    def _do_release(self, lease):
        # Interrupted, the release runs to its end on the runner all the same.
        return self._call(lambda job: self._release(lease))

    def _release(self, lease):
        path, parent = lease.handle, lease.handle.rsplit("/", 1)[0]
        self._forget(path)
        client = self._client
        if client is None:
            return False
        io_deadline = self._io_deadline(None)
        with self._translate_errors(f"releasing lock {lease.name!r}"):
            try:
                with self._registry_lock:
                    crowded = parent in self._crowded_parents
                if not crowded:
                    transaction = client.transaction()
                    transaction.delete(path)
                    transaction.delete(parent)
                    deleted_node, deleted_parent = self._result(transaction.commit_async(), io_deadline)
                    if deleted_parent is True:
                        return True
                    if isinstance(deleted_node, NoNodeError):
                        return False  # gone already: expired, force-released, or its session ended
                    if not isinstance(deleted_parent, NotEmptyError):
                        raise deleted_parent if isinstance(deleted_node, RolledBackError) else deleted_node
                    self._crowded(parent)  # someone queued since we acquired
                try:
                    self._result(self._send_leave(path, awaited=True), io_deadline)
                except NoNodeError:
                    return False
                return True
            except SessionExpiredError:
                # The session, and with it our node, is gone; its parent may be left: sweep it later.
                with self._registry_lock:
                    self._litter.add((parent, None, path))
                return False
            except (KazooException, BackendUnavailable):
                with self._registry_lock:
                    self._litter.add((parent, None, path))
                raise

    def _do_extend(self, lease, ttl):
        """Check the znode is still ours, then push its expiry; False if it is gone."""
        return self._call(lambda job: self._extend(lease, ttl))

    def _extend(self, lease, ttl):
        if self._lease_epochs.get(lease) != self._session_epoch:
            return False  # its session ended, or it is the parent's (a forked child)
        with self._translate_errors(f"extending lock {lease.name!r}"):
            io_deadline = self._io_deadline(None)
            client = self._session(io_deadline)
            try:
                stat = self._result(client.exists_async(lease.handle), io_deadline)
            except SessionExpiredError:
                stat = None  # the session that owned the node has ended
        if stat is None or stat.ephemeralOwner != (client.client_id or (None,))[0]:
            self._forget(lease.handle)
            return False
        # The lease now runs out ``ttl`` after the request was sent, sooner or later than before; the
        # node goes a little after that. False if the expiry timer fired meanwhile: the node is going.
        return self._expiry.move(lease.handle, time.monotonic() + ttl)

    # -- operating -----------------------------------------------------------------------------

    def held_locks(self, prefix=""):
        """Return the holders of every lock under ``ROOT`` whose name starts with ``prefix``.

        ``acquired_at`` is when the holder's znode was created (server clock); ``expires_at`` is None:
        the ttl lives in the holder's process, the server frees the lock when its session ends.
        Persistent children are no holders ("Foreign children" above).
        """
        return self._call(lambda job: self._held_locks(prefix))

    def _held_locks(self, prefix):
        with self._translate_errors("listing held locks"):
            io_deadline = self._io_deadline(None)
            client = self._session(io_deadline)
            names = [(decode_name(node), node) for node in self._children(client, self._root, io_deadline)]
            names = [(name, f"{self._root}/{node}") for name, node in sorted(names) if name.startswith(prefix)]
            listings = [(name, parent, client.get_children_async(parent)) for name, parent in names]
            infos = []
            for name, parent, listing in listings:
                try:
                    children = self._result(listing, io_deadline)
                except NoNodeError:
                    continue
                while True:
                    reads = [(child, client.get_async(f"{parent}/{child}")) for child in holders_of(children)]
                    found, foreign = [], set()
                    for child, read in reads:
                        with suppress(NoNodeError):
                            data, stat = self._result(read, io_deadline)
                            if stat.ephemeralOwner == 0:
                                foreign.add(child)
                            else:
                                found.append(self._lock_info(name, data, stat))
                    if not foreign:
                        break
                    children = [child for child in children if child not in foreign]
                infos.extend(found)
            return infos

    def foreign_records(self):
        """Return a description of every child of a lock's parent that the protocol ignores.

        Those are children whose name is not a contender's (owner, kind and a non-negative sequence)
        and persistent children (contenders are always ephemeral). Planted by hand or by a client
        that can write under ``ROOT``; harmless to the locks, reported by ``distlock check``. Each
        description names the znode path and why it is ignored.
        """
        return self._call(lambda job: self._foreign_nodes())

    def _foreign_nodes(self):
        with self._translate_errors("looking for foreign znodes"):
            io_deadline = self._io_deadline(None)
            client = self._session(io_deadline)
            parents = [f"{self._root}/{node}" for node in sorted(self._children(client, self._root, io_deadline))]
            listings = [(parent, client.get_children_async(parent)) for parent in parents]
            stats = []
            for parent, listing in listings:
                try:
                    children = self._result(listing, io_deadline)
                except NoNodeError:
                    continue
                stats.extend((f"{parent}/{child}", _NODE_NAME.match(child) is not None,
                              client.exists_async(f"{parent}/{child}")) for child in sorted(children))
            found = []
            for path, named, reply in stats:
                stat = self._result(reply, io_deadline)
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

    def _lock_info(self, name, data, stat):
        try:
            record = json.loads(data)
        except ValueError:
            record = {}
        return LockInfo(
            alias=self.alias, name=name, owner=record.get("owner", ""), token=self.public_token(stat.mzxid),
            acquired_at=datetime.fromtimestamp(stat.ctime / 1000, tz=timezone.utc),
            host=record.get("host", ""), pid=record.get("pid"), task_id=record.get("task_id", ""),
        )

    def force_release(self, name, owner):
        """Delete ``name``'s znode of ``owner``, checked by its data and version; return True if deleted."""
        return self._call(lambda job: self._force_release(name, owner))

    def _force_release(self, name, owner):
        parent = self._parent_path(name)
        with self._translate_errors(f"force-releasing lock {name!r}"):
            io_deadline = self._io_deadline(None)
            client = self._session(io_deadline)
            for child in self._children(client, parent, io_deadline):
                match = _NODE_NAME.match(child)
                if match is None or match["owner"] != owner:
                    continue
                path = f"{parent}/{child}"
                try:
                    data, stat = self._result(client.get_async(path), io_deadline)
                    if self._lock_info(name, data, stat).owner != owner:
                        return False
                    reply = client.delete_async(path, version=stat.version)
                    client.delete_async(parent)
                    self._result(reply, io_deadline)
                except (NoNodeError, BadVersionError):
                    return False
                return True
        return False

    def ping(self):
        self._call(lambda job: self._ping())

    def _ping(self):
        with self._translate_errors("pinging"):
            io_deadline = self._io_deadline(None)
            self._result(self._session(io_deadline).exists_async("/"), io_deadline)

    def close(self):
        """End the session: held leases are marked lost, their znodes deleted before the session closes."""
        if self._client is None:
            return
        try:
            state_thread = self._call(lambda job: self._close())
        finally:
            self._offload.stop()
        if state_thread is not None and not state_thread.is_current():
            state_thread.join()

    def _close(self):
        with self._client_lock:
            client, self._client = self._client, None
        if client is None:
            return None
        with self._registry_lock:
            leases = list(self._held.values())
            self._held.clear()
            self._litter.clear()
            self._mark_dead(leases)
        for lease in leases:
            self._expiry.cancel(lease.handle)
            # Queued ahead of the close request, so they run before the session ends.
            client.delete_async(lease.handle)
            client.delete_async(lease.handle.rsplit("/", 1)[0])
        self._announce_lost(leases, "the backend was closed, ending its ZooKeeper session")
        client.stop()
        client.close()
        self._states.put(None)
        self._expiry.stop()
        return self._state_thread
