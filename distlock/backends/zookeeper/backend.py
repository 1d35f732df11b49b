"""ZooKeeperBackend: the base class's acquire loop on top of the znode queue (``protocol``) and the ``session``.

Interrupts. kazoo is not safe against exceptions raised asynchronously on the thread that calls it,
so every operation goes through ``distlock.backends.offload`` (a runner thread for main-thread callers
of a process with a raising signal handler, a green thread of its own under gevent or eventlet). A
cancelled blocking acquire stops waiting and withdraws its node; an interrupted caller's grant is
given back (the node deleted). Every grant is registered with the ttl timer on the runner before it
is handed over (``_hold``), so even an interrupt after the hand-over frees the lock at its ttl.
"""

import logging
import time
from datetime import datetime, timezone

from kazoo.exceptions import ConnectionClosedError, ConnectionLoss, NoAuthError, SessionExpiredError

from distlock.backends.base import (
    NOTIFICATIONS, READ_WRITE, SAFE_FENCING_TOKENS, BaseLockBackend, Grant, LockPage, check_page,
)
from distlock.backends.green import green_library
from distlock.backends.offload import Abandoned, Offloader
from distlock.backends.zookeeper.options import OPTIONS, RENAMED_OPTIONS, check_tls_combination, open_access_warnings
from distlock.backends.zookeeper.protocol import (
    WRITE,
    Contender,
    NodeGone,
    Taken,
    delete_owned,
    foreign_nodes,
    holders,
    parent_path,
    read_cursor,
    release,
)
from distlock.backends.zookeeper.session import FAILURES, NoAnswer, NotConnected, Session
from distlock.holder import read_holder_record

logger = logging.getLogger(__name__)

__all__ = ["ZooKeeperBackend"]


class ZooKeeperBackend(BaseLockBackend):
    """Locks as ephemeral sequential znodes on a ZooKeeper ensemble (``protocol``).

    One kazoo client per backend, hence per alias and process, shared by every lease and thread and
    connected on first use. Its connection states map onto leases (``session``): SUSPENDED suspends
    them (``check()`` raises ``LockSuspended``), CONNECTED within the session makes those whose znode
    is still there valid again, LOST (or a suspension longer than the session timeout) loses them and
    sends ``lock_lost``. Between state changes, ``check()`` fails once the negotiated session timeout
    has passed since the newest answered request was sent.

    ``ttl`` keeps its meaning: this process deletes the znode when it runs out unless extended. A
    holder that dies or hangs is freed by the server only when its session expires,
    ``lease.session_timeout`` seconds (as negotiated with the server) after its last heartbeat.
    """

    label = "ZooKeeper"

    #: safe_fencing_tokens: czxids never go backwards. read_write: ``acquire_shared()``.
    #: notifications: waiters watch their predecessor's znode.
    capabilities = frozenset({SAFE_FENCING_TOKENS, READ_WRITE, NOTIFICATIONS})

    client_errors = FAILURES
    options = OPTIONS
    renamed_options = RENAMED_OPTIONS

    @classmethod
    def check_combination(cls, alias, options):
        check_tls_combination(alias, options)

    @classmethod
    def security_warnings(cls, alias, options):
        """Warn when znodes are open to any client that reaches the ensemble, or TLS trusts anyone."""
        return open_access_warnings(options)

    def __init__(self, alias, options):
        super().__init__(alias, options)
        green = green_library()
        self._session = Session(alias, self.settings, green)
        self._offload = Offloader(alias, f"distlock-zk-runner:{alias}", green)

    def _cause(self, exc):
        """Word a failure for ``unavailable``: no answer, no connection (and why), or kazoo's error with a hint."""
        settings = self.settings
        if isinstance(exc, NoAnswer):
            return (f"the ensemble ({settings['HOSTS']}) did not answer in time; OPTIONS['REQUEST_TIMEOUT'] "
                    "bounds each request")
        if isinstance(exc, NotConnected):
            tls = " and that the TLS options (CA, CERTFILE, KEYFILE) fit it" if settings["USE_SSL"] else ""
            failure = f"; the last attempt failed with {exc.args[0]}" if exc.args[0] is not None else ""
            return (f"could not connect to {settings['HOSTS']} in time; check that the ensemble is up and "
                    f"reachable{tls} (OPTIONS['REQUEST_TIMEOUT'] bounds the wait){failure}")
        cause = super()._cause(exc)
        if cause != type(exc).__name__:
            cause = f"{type(exc).__name__}: {cause}"
        if isinstance(exc, NoAuthError):
            cause += (" (the ACL of a znode under KEY_PREFIX does not admit this session: check AUTH_DATA and "
                      "DEFAULT_ACL)")
        return cause

    def _parent_path(self, name):
        return parent_path(self._session.root, self.settings["LAYOUT"], name)

    def session_valid_until(self, lease):
        """Return when ``lease``'s session may have expired on the server (``Session.valid_until``)."""
        return self._session.valid_until(lease)

    # -- the acquire loop's hooks ----------------------------------------------------------------

    def _call(self, fn, *, give_back=None):
        """Return ``fn(job)``, run where no exception raised asynchronously in the caller can cut it short."""
        return self._offload.call(fn, give_back=give_back)

    def _try_acquire(self, attempt):
        """Take one turn in the queue: a ``Grant`` if our node holds, else None (``attempt.place`` knows the blocker).

        A connection loss, a session that ended or a node that went does not end the try: it takes its
        turn again (finding the node a lost reply may have made, or queuing anew).
        """
        contender = attempt.place
        if contender is None:
            contender = attempt.place = Contender(self._session, self._parent_path(attempt.name), attempt.owner,
                                                  attempt.mode or WRITE)
        with self.translate_errors(f"acquire lock {attempt.name!r}"):
            while True:
                if attempt.job.cancelled:
                    raise Abandoned(attempt.name)
                io_deadline = self._session.request_deadline(attempt.deadline)
                # Read before any request of this turn: a LOST after it makes the node's epoch stale.
                epoch = self._session.epoch
                try:
                    if not contender.take_turn(epoch, io_deadline, trying=not attempt.blocking):
                        return None
                except Taken:
                    return None
                except ConnectionClosedError:
                    raise  # the backend was closed under us: BackendUnavailable, no new session
                except ConnectionLoss:
                    # Whether a create ran is unknown; the session, and any node of ours, live on.
                    contender.uncertain = contender.path is None
                    continue
                except (SessionExpiredError, NodeGone):
                    contender.forget_node()
                    continue
                return Grant(token=contender.token, handle=contender.path, session_timeout=self._session.timeout)

    def _wait_for_release(self, attempt, remaining):
        """Watch the node ours waits for; wake when it goes, the connection changes, or the caller leaves."""
        contender = attempt.place
        with self.translate_errors(f"acquire lock {attempt.name!r}"):
            try:
                contender.wait(remaining, self._session.request_deadline(attempt.deadline), attempt.job)
            except ConnectionClosedError:
                raise
            except ConnectionLoss:
                pass  # the next try finds the connection back, or says it is not
            except SessionExpiredError:
                contender.forget_node()

    def _hold(self, lease, attempt):
        """Register the lease with the session and the ttl timer; False if its session ended since its node was made."""
        return self._session.hold(lease, attempt.place.epoch, attempt.place.successor)

    def _give_back_grant(self, lease, attempt):
        """Leave the node of a grant that is not handed out; the next try queues anew."""
        self._session.send_leave(lease.handle)
        attempt.place.forget_node()

    def _give_up(self, attempt, reason):
        """Withdraw the attempt's node, without waiting (or have it deleted once reconnected)."""
        if attempt.place is not None:
            attempt.place.give_up()

    def _give_back(self, lease):
        """Release a lease granted to a caller that was interrupted before it could take it (on the runner)."""
        logger.info("Releasing lock %r (alias %r, token %s): the call that acquired it was interrupted.",
                    lease.name, self.alias, lease.token)
        self._session.mark_dead([lease])
        self._release(lease)

    # -- holding ---------------------------------------------------------------------------------

    def _do_release(self, lease):
        # Interrupted, the release runs to its end on the runner all the same.
        return self._call(lambda job: self._release(lease))

    def _release(self, lease):
        path, parent = lease.handle, lease.handle.rsplit("/", 1)[0]
        session = self._session
        successor = session.forget(path)
        client = session.client
        if client is None:
            return False
        with self.translate_errors(f"release lock {lease.name!r}"):
            try:
                return release(session, client, path, session.request_deadline(), successor)
            except SessionExpiredError:
                # The session, and with it our node, is gone; its parent may be left: delete it later.
                session.add_leftover(parent, None, path)
                return False
            except FAILURES:
                session.add_leftover(parent, None, path)
                raise

    def _do_extend(self, lease, ttl):
        """Check the znode is still ours, then push its expiry; False if it is gone."""
        return self._call(lambda job: self._extend(lease, ttl))

    def _extend(self, lease, ttl):
        session = self._session
        if not session.is_current(lease):
            return False  # its session ended, or it is the parent's (a forked child)
        with self.translate_errors(f"extend lock {lease.name!r}"):
            io_deadline = session.request_deadline()
            client = session.connect(io_deadline)
            try:
                stat = session.result(client.exists_async(lease.handle), io_deadline)
            except SessionExpiredError:
                stat = None  # the session that owned the node has ended
        if stat is None or stat.ephemeralOwner != (client.client_id or (None,))[0]:
            session.forget(lease.handle)
            return False
        # The lease now runs out ``ttl`` after the request was sent, sooner or later than before; the
        # node goes a little after that. False if the expiry timer fired meanwhile: the node is going.
        return session.expiry.move(lease.handle, time.monotonic() + ttl)

    # -- operating -------------------------------------------------------------------------------

    def held_locks(self, prefix="", *, limit=None, cursor=None):
        """Return the holders of every lock under ``KEY_PREFIX`` whose name starts with ``prefix``.

        ``acquired_at`` is when the holder's znode was created (server clock); ``expires_at`` is None:
        the ttl lives in the holder's process, the server frees the lock when its session ends.
        Persistent children are no holders ("Foreign children" in ``protocol``). A page counts lock
        names: a read lock's page shows each of its readers. With LAYOUT "flat", pages follow name order;
        with "buckets", bucket order ("Listing" in ``protocol``), each page sorted by name.
        """
        check_page(limit, cursor)
        read_cursor(self.settings["LAYOUT"], cursor)  # a cursor from a URL is refused before any I/O
        return self._call(lambda job: self._held_locks(prefix, limit, cursor))

    def _held_locks(self, prefix, limit, cursor):
        with self.translate_errors("list held locks"):
            io_deadline = self._session.request_deadline()
            client = self._session.connect(io_deadline)
            found, next_cursor = holders(self._session, client, prefix, io_deadline, limit=limit, cursor=cursor)
            return LockPage([self.lock_info(name, read_holder_record(data), token=stat.mzxid,
                                            acquired_at=datetime.fromtimestamp(stat.ctime / 1000, tz=timezone.utc))
                             for name, data, stat in found], next_cursor)

    def foreign_records(self):
        """Return a description of every znode under ``KEY_PREFIX`` that the protocol ignores.

        Those are children of a lock's parent whose name is not a contender's (owner, kind and a
        non-negative sequence) and persistent children (contenders are always ephemeral): planted by
        hand or by a client that can write under ``KEY_PREFIX``, harmless to the locks. And the znodes
        of the other LAYOUT ("Layouts" in ``protocol``): locks of processes configured with another
        LAYOUT, which exclude nothing of this alias's. Reported by ``distlock check``; each
        description names the znode path and why it is ignored.
        """
        return self._call(lambda job: self._foreign_records())

    def _foreign_records(self):
        with self.translate_errors("look for foreign znodes"):
            io_deadline = self._session.request_deadline()
            return foreign_nodes(self._session, self._session.connect(io_deadline), io_deadline)

    def release_owned(self, name, owner):
        """Delete ``name``'s znode of ``owner``, checked by its data and version; return True if deleted."""
        return self._call(lambda job: self._release_owned(name, owner))

    def _release_owned(self, name, owner):
        with self.translate_errors(f"release lock {name!r}"):
            io_deadline = self._session.request_deadline()
            client = self._session.connect(io_deadline)
            return delete_owned(self._session, client, self._parent_path(name), owner, io_deadline)

    def ping(self):
        self._call(lambda job: self._ping())

    def _ping(self):
        with self.translate_errors("answer a ping"):
            io_deadline = self._session.request_deadline()
            self._session.result(self._session.connect(io_deadline).exists_async("/"), io_deadline)

    def close(self):
        """End the session: held leases are marked lost, their znodes deleted before the session closes."""
        if self._session.client is None:
            return
        try:
            state_thread = self._call(lambda job: self._session.close())
        finally:
            self._offload.stop()
        if state_thread is not None and not state_thread.is_current():
            state_thread.join()
