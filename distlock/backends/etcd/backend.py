"""The etcd backend class: the acquire loop's hooks mapped onto the queue of keys of ``transactions``."""

import logging
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from urllib.parse import quote, unquote

from distlock.backends.base import NOTIFICATIONS, SAFE_FENCING_TOKENS, BaseLockBackend, Grant, LockPage, check_page
from distlock.backends.deadlines import request_deadline
from distlock.backends.etcd._transport import (
    MIN_REQUEST_SECONDS, Connection, RequestFailed, SessionGone, hint, prepare_for_green_threads,
)
from distlock.backends.etcd.options import (
    OPTIONS, RENAMED_OPTIONS, check_together, endpoints_of, left_open, security_of,
)
from distlock.backends.etcd.session import Held, Keeper, Session
from distlock.backends.etcd.transactions import (
    acquire_txn, count_request, extend_txn, holder_request, keys_of_lock, listing_request, lock_queues, range_end,
    release_txn, turn_txn,
)
from distlock.backends.green import ForkedChildHook, green_library
from distlock.backends.offload import Offloader
from distlock.exceptions import BackendUnavailable
from distlock.holder import holder_record, read_holder_record

logger = logging.getLogger(__name__)

__all__ = ["EtcdBackend"]


@dataclass
class _Contender:
    """``Attempt.place``: the attempt's key in the lock's queue and, once queued, what it waits for."""

    name: str
    owner: str
    lock_prefix: bytes
    #: Our key, and the session whose slot it is: set by ``Keeper.take_slot`` for each session we queue on.
    key: bytes = b""
    session: Session | None = None
    slot: int | None = None
    #: The key's create revision once queued (its identity for TURN, release and extend); None: not queued.
    revision: int | None = None
    #: The key's value (the holder record), written again by TURN.
    value: bytes = b""
    #: True once a request that may have created the key was sent: leaving without the lock deletes it.
    may_exist: bool = False
    #: The key just before ours (a KeyValue) as read at revision ``seen_at``: the wait watches it. None: the
    #: next try comes at once.
    predecessor: object = None
    seen_at: int = 0

    def requeue(self):
        """Forget the key (gone with its session, or given back): the next try queues again with ACQUIRE."""
        self.revision = self.predecessor = None
        self.may_exist = False

    def leftover(self):
        """Return the key as a leftover for the background loop, whatever incarnation it has."""
        return Held(self.key, None, self.session, self.name, self.slot, self.owner)


def _parse_time(value):
    return datetime.fromisoformat(value) if isinstance(value, str) else None


#: Keys read per range by a listing with no ``limit``: bounds each reply, not the listing.
LISTING_CHUNK = 1000

#: The keeper of every live backend of this process.
_KEEPERS = ForkedChildHook("after_fork_in_child")


class EtcdBackend(BaseLockBackend):
    """Locks on an etcd v3 cluster: linearizable, granted in FIFO order, fenced by create revisions.

    Each lock is a queue of keys, one per contender, attached to the process's session lease (see
    ``distlock.backends.etcd.transactions``). Acquiring a free lock costs one transaction; a waiter
    watches only the key just before its own. One session lease per backend per process, granted
    at the first acquisition and kept alive every TTL/3 by a background loop, is what etcd frees a
    dead process's locks by: ``lease.session_timeout`` is its TTL as etcd granted it, which etcd
    silently raises to its minimum (1.5 x election timeout: 2 s with default flags). If the
    keepalive cannot get through for that long, every lease held on the session is marked lost and
    ``lock_lost`` is sent; the next acquisition grants a new session lease.

    The per-call ``ttl`` keeps its meaning: this process deletes the key when it runs out unless the
    lease was extended. Every call runs out of reach of the caller's interrupts
    (``distlock.backends.offload``): an interrupt inside gRPC left its channel's locks held and every
    later call of the process hung.
    """

    label = "etcd"
    capabilities = frozenset({SAFE_FENCING_TOKENS, NOTIFICATIONS})
    client_errors = (RequestFailed,)
    options = OPTIONS
    renamed_options = RENAMED_OPTIONS

    @classmethod
    def check_combination(cls, alias, options):
        check_together(alias, options)

    @classmethod
    def security_warnings(cls, alias, options):
        """Warn when the alias speaks to etcd in clear text without auth, or sends its password in clear text."""
        return left_open(options)

    def __init__(self, alias, options):
        super().__init__(alias, options)
        settings = self.settings
        prepare_for_green_threads(alias)
        self._prefix = settings["KEY_PREFIX"].encode()
        self._request_timeout = settings["REQUEST_TIMEOUT"]
        self._connection = Connection(alias, endpoints_of(settings), self._request_timeout, security_of(settings),
                                      self.token_order)
        self._keeper = Keeper(alias, self._connection, settings["LEASE_TTL"])
        self._offload = Offloader(alias, f"distlock-etcd-runner:{alias}", green_library())
        _KEEPERS.add(self._keeper)

    def _cause(self, exc):
        cause = str(exc).rstrip(".")
        advice = hint(exc, self._connection.security.tls)
        return f"{cause}; {advice}" if advice else cause

    def _deadline(self, caller_deadline=None):
        """Return the ``time.monotonic()`` by which one request must have answered (``request_deadline``)."""
        return request_deadline(self._request_timeout, caller_deadline, minimum=MIN_REQUEST_SECONDS)

    def _lock_prefix(self, name):
        return keys_of_lock(self._prefix, name)

    @staticmethod
    def _record(owner):
        """Return the value stored in a contender's key, and its wall-clock creation time."""
        now = datetime.now(timezone.utc)
        return holder_record(owner=owner, created_at=now.isoformat()).encode(), now

    def _call(self, fn, *, give_back=None):
        return self._offload.call(fn, give_back=give_back)

    # -- the acquire loop's hooks ----------------------------------------------------------------

    def _try_acquire(self, attempt):
        """Send ACQUIRE (not queued yet) or TURN (queued) once; return a ``Grant``, or None with the key to wait for."""
        contender = attempt.place
        if contender is None:
            contender = attempt.place = _Contender(attempt.name, attempt.owner, self._lock_prefix(attempt.name))
        with self.translate_errors(f"acquire lock {attempt.name!r}"):
            while True:  # again only if our session lease expired before the lock came to us
                session = self._keeper.live_session(attempt.deadline)
                if contender.session is not session:
                    self._keeper.take_slot(contender, session)
                    contender.requeue()
                try:
                    if contender.revision is None:
                        return self._join(attempt, contender)
                    return self._take_turn(attempt, contender)
                except SessionGone as exc:
                    self._keeper.session_lost(session, str(exc))
                    contender.requeue()  # a key on an expired lease is deleted by etcd

    def _join(self, attempt, contender):
        """ACQUIRE: take the free lock or, if blocking, join the end of its queue and note the key before ours."""
        contender.value, acquired_at = self._record(attempt.owner)
        contender.may_exist = True
        response = self._connection.txn(
            acquire_txn(contender.lock_prefix, contender.key, contender.value, contender.session.id, attempt.blocking),
            self._deadline(attempt.deadline))
        if response.succeeded:
            contender.revision = response.header.revision
            return self._grant(contender, response.header.revision, acquired_at)
        own, holder = response.responses[0].response_range.kvs, response.responses[1].response_range.kvs
        if own and holder[0].key == contender.key:
            # Our key heads the queue: a retry whose first try took the free lock, or a late copy of an
            # earlier ACQUIRE (held up in a cut link) that put the key back after its release. The key's
            # revisions may then be older than grants made since: TURN writes the token anew.
            contender.revision, contender.predecessor = own[0].create_revision, None
            return self._take_turn(attempt, contender)
        if not attempt.blocking:
            contender.may_exist = bool(own)
            return None
        if own:  # a retry whose first try joined the queue: TURN finds the key before ours
            contender.revision, contender.predecessor = own[0].create_revision, None
        else:
            newest = response.responses[3].response_range.kvs
            contender.revision = newest[0].create_revision
            contender.predecessor = newest[1] if len(newest) > 1 else None
        contender.seen_at = response.header.revision
        return None

    def _take_turn(self, attempt, contender):
        """TURN: take the lock if no key is left before ours; else note the one to wait for, or queue again."""
        acquired_at = datetime.now(timezone.utc)
        response = self._connection.txn(
            turn_txn(contender.lock_prefix, contender.key, contender.revision, contender.value, contender.session.id),
            self._deadline(attempt.deadline))
        if response.succeeded:
            return self._grant(contender, response.header.revision, acquired_at)
        own, before = response.responses[0].response_range.kvs, response.responses[1].response_range.kvs
        if not own or own[0].create_revision != contender.revision:
            logger.info("Lost our place in the queue of lock %r (session lease expired?); queueing again",
                        attempt.name)
            contender.requeue()
            return None
        contender.predecessor, contender.seen_at = (before[0] if before else None), response.header.revision
        return None

    @staticmethod
    def _grant(contender, token, acquired_at):
        handle = Held(contender.key, contender.revision, contender.session, contender.name, contender.slot,
                      contender.owner)
        return Grant(token=token, acquired_at=acquired_at, handle=handle, session_timeout=contender.session.ttl)

    def _wait_for_release(self, attempt, remaining):
        """Watch for the deletion of the key just before ours, for REQUEST_TIMEOUT at most: TURN then re-reads."""
        contender = attempt.place
        predecessor = contender.predecessor if contender is not None else None
        if predecessor is None or attempt.job.cancelled:
            return
        wait = self._request_timeout if remaining is None else min(self._request_timeout, remaining)
        self._connection.wait_for_deletion(predecessor.key, predecessor.create_revision, contender.seen_at,
                                           time.monotonic() + wait, attempt.job)

    def _hold(self, lease, attempt):
        """Register the lease and its ttl; refuse it if its session ended before the answer came."""
        return self._keeper.hold(lease)

    def _give_back_grant(self, lease, attempt):
        """Delete the key of a grant nobody may hold through it (it may also outlive our belief in the session)."""
        with self.translate_errors(f"give back lock {lease.name!r}"):
            self._connection.delete(lease.handle.key, self._deadline())
        attempt.place.requeue()

    def _give_up(self, attempt, reason):
        """Delete the key of an attempt that leaves without the lock: now, or from the background loop.

        Straight to the background when ``reason`` is the cluster not answering, so the caller's
        timeout is not spent twice.
        """
        contender = attempt.place
        if contender is None:
            return
        if contender.may_exist and not isinstance(reason, BackendUnavailable):
            try:
                self._connection.delete(contender.key, request_deadline(
                    min(self._request_timeout, MIN_REQUEST_SECONDS), minimum=MIN_REQUEST_SECONDS))
                contender.may_exist = False
            except RequestFailed as exc:
                reason = exc
        if not contender.may_exist:
            self._keeper.free_slot(contender)
            return
        # The slot stays taken: the key may still exist, and nobody else may use it.
        logger.warning("Could not leave the queue of lock %r (%s); retrying in the background", contender.name, reason)
        self._keeper.leave_behind(contender.leftover())

    # -- holding ---------------------------------------------------------------------------------

    def _do_release(self, lease):
        return self._call(lambda job: self._release(lease))

    def _release(self, lease):
        handle = lease.handle
        if not handle.session.ours:
            return False  # the parent's lock, inherited by a forked child: not this process's to release
        self._keeper.forget(lease)
        try:
            with self.translate_errors(f"release lock {lease.name!r}"):
                response = self._connection.txn(release_txn(handle.key, handle.create_revision), self._deadline())
        except BackendUnavailable:
            self._keeper.leave_behind(handle)  # ours alone (its slot stays taken): deleted once the cluster answers
            raise
        self._keeper.free_slot(handle)  # deleted now, or gone before (expired, released by an operator)
        return response.succeeded

    def session_valid_until(self, lease):
        """The session lease's validity: the last keepalive that got through was sent ``ttl`` before it.

        -inf once the session is known lost, so all its leases fail ``check()`` together, and in a
        forked child, which does not hold the parent's session.
        """
        return lease.handle.session.valid_until_here()

    def _do_extend(self, lease, ttl):
        return self._call(lambda job: self._extend(lease, ttl))

    def _extend(self, lease, ttl):
        handle = lease.handle
        if not handle.session.ours:
            return False  # the parent's lock, inherited by a forked child
        started = time.monotonic()
        expiry = self._keeper.begin_extension(handle, started)
        if expiry is None:
            return False
        until = None
        try:
            with self.translate_errors(f"extend lock {lease.name!r}"):
                if self._connection.txn(extend_txn(handle.key, handle.create_revision), self._deadline()).succeeded:
                    until = started + ttl
        finally:
            self._keeper.end_extension(handle, expiry, until)
        return until is not None

    # -- operating -------------------------------------------------------------------------------

    def held_locks(self, prefix="", *, limit=None, cursor=None):
        """Return a ``LockPage`` of the holders of the locks whose name starts with ``prefix``, sorted by name.

        Reads about one page of keys, not every key under the prefix: ranges in key order with a limit
        (see Listing in ``transactions``), so the first page costs the same with 10 or 100,000 locks
        held. Pages follow the key order, the order of the quoted names, each page sorted by name; the
        cursor is the name of the page's last lock in key order. Each lock's holder is read from one
        range holding all its keys, so a page is never wrong about a lock whose queue a limit cut.
        """
        check_page(limit, cursor)
        return self._call(lambda job: self._held_locks(prefix, limit, cursor))

    def _held_locks(self, prefix, limit, cursor):
        start = self._prefix + quote(prefix, safe="").encode()
        end = range_end(start)
        if cursor is not None:
            start = max(start, range_end(self._lock_prefix(cursor)))
        infos, cut = [], False
        with self.translate_errors("list held locks"):
            while start < end and (limit is None or len(infos) < limit):
                # One key more than the locks still wanted: then the last wanted lock is whole unless a
                # queue of waiters fills the range.
                wanted = LISTING_CHUNK if limit is None else limit - len(infos) + 1
                response = self._connection.range(listing_request(start, end, wanted), self._deadline())
                queues = lock_queues(self._prefix, response.kvs)
                cut = response.more and len(queues) > 1
                if not response.more:
                    start = end
                elif cut:
                    start = queues.pop().start  # maybe cut by the limit: the next range (or page) reads it whole
                else:  # one lock's queue filled the range: read its holder alone, go on after it
                    (queue,) = queues
                    holder = self._connection.range(holder_request(queue.start), self._deadline()).kvs
                    queues, start = [queue._replace(kvs=holder)], queue.end
                infos += [self._lock_info(unquote(queue.start[len(self._prefix):-1].decode()),
                                          min(queue.kvs, key=lambda kv: kv.create_revision))
                          for queue in queues if queue.kvs]
            if limit is None:
                return LockPage(sorted(infos, key=lambda info: info.name))
            # A full page has a next one if a key lies past it: known after a cut, not after a lone queue.
            more = len(infos) > limit or (start < end and (cut or self._any_key(start, end)))
        page = infos[:limit]
        return LockPage(sorted(page, key=lambda info: info.name), page[-1].name if more else None)

    def _any_key(self, start, end):
        """Return True if a key lies in ``[start, end)``: one key read, so a full page knows whether another follows."""
        return bool(self._connection.range(listing_request(start, end, 1), self._deadline()).kvs)

    def _lock_info(self, name, kv):
        record = read_holder_record(kv.value)
        return self.lock_info(name, record, token=kv.mod_revision, acquired_at=_parse_time(record.get("created_at")))

    def release_owned(self, name, owner):
        return self._call(lambda job: self._release_owned(name, owner))

    def _release_owned(self, name, owner):
        deadline = self._deadline()
        with self.translate_errors(f"release lock {name!r}"):
            holder = self._connection.range(holder_request(self._lock_prefix(name)), deadline).kvs
            if not holder or read_holder_record(holder[0].value)["owner"] != owner:
                return False
            key, create_revision = holder[0].key, holder[0].create_revision
            released = self._connection.txn(release_txn(key, create_revision), deadline).succeeded
        if released:
            self._keeper.released_by_operator(key, create_revision)
        return released

    def ping(self):
        return self._call(lambda job: self._ping())

    def _ping(self):
        with self.translate_errors("answer a ping"):
            self._connection.range(count_request(self._prefix), self._deadline())

    def close(self):
        """Stop the background work and revoke the session lease: every lock held through it is freed and lost."""
        try:
            self._call(lambda job: self._close())
        finally:
            self._offload.stop()

    def _close(self):
        self._keeper.close()
        self._connection.close()
