"""The ZooKeeper session of one alias in one process: its kazoo client, connection states, held leases and leftovers.

kazoo's connection states (``kazoo/protocol/states.py``) map onto the leases granted on the session:

- SUSPENDED, "the connection has been lost but may be recovered ... A client should not assume
  that locks are valid during this time": held leases are suspended, ``check()`` raises
  ``LockSuspended``.
- CONNECTED again, same session: a suspended lease whose znode still exists is valid again; one
  whose znode is gone is marked lost.
- LOST, "the connection has been confirmed dead ... locks ... can be considered lost": held leases
  are marked lost and ``lock_lost`` is sent. So are leases whose connection stayed suspended longer
  than the session timeout: the server has expired the session by then, even if this client cannot
  reach a server to hear it. Every affected lease fails ``check()`` before the first ``lock_lost`` is
  sent, and the thread that sends them logs a receiver's exception and goes on.
- Between state changes, ``check()`` is bounded by the session: a lease is lost once the negotiated
  timeout has passed since the newest answered request or ping was *sent*, whether or not kazoo's
  thread has run since (a holder frozen past its session finds out when it wakes).

Every LOST starts a new session epoch: a grant made on an older one is never handed out, and a lease
of an older one is dead. ZooKeeper knows only sessions, so a lease's ttl is kept here: the expiry
timer deletes the holder's znode when it runs out.
"""

import logging
import math
import queue
import threading
import time
import weakref
from contextlib import contextmanager, suppress
from functools import partial

from kazoo.client import KazooState
from kazoo.exceptions import ConnectionLoss, KazooException, NoNodeError
from kazoo.handlers.threading import KazooTimeoutError

from distlock.backends.deadlines import DeadlineTimer, request_deadline
from distlock.backends.green import Daemon, ForkedChildHook, killed
from distlock.backends.zookeeper.connection import detach, new_client

logger = logging.getLogger(__name__)

__all__ = ["FAILURES", "REQUEST_MINIMUM", "NoAnswer", "NotConnected", "Session"]

#: Seconds below which a request's bound is never cut, whatever is left of the caller's timeout: a
#: non-blocking attempt (timeout 0) still needs one round trip. So a caller's timeout is honoured to
#: within this when the ensemble does not answer.
REQUEST_MINIMUM = 1.0

#: How many recently crowded lock names a session remembers (to skip a multi bound to fail).
CROWDED_NAMES = 1024

#: How many znodes a session remembers as checked ephemeral (the protocol ignores persistent ones).
CHECKED_NODES = 4096

_UNKNOWN = object()


class NoAnswer(Exception):
    """The ensemble did not answer a request within its bound (``Session.request_deadline``)."""


class NotConnected(Exception):
    """No connection to the ensemble within a request's bound; the argument is why the last try failed, or None."""


#: What a request can fail with: the backend's ``client_errors``.
FAILURES = (KazooException, KazooTimeoutError, NoAnswer, NotConnected)

#: Every session of this process.
_SESSIONS = ForkedChildHook("after_fork_in_child")


class Session:
    """One kazoo client per alias and process, connected on first use and shared by every lease and thread."""

    def __init__(self, alias, settings, green):
        self.alias = alias
        self.settings = settings
        self.root = settings["KEY_PREFIX"]
        #: "gevent" or "eventlet" if this process is monkey-patched by it: kazoo gets that library's handler.
        self._green = green
        #: The kazoo client once started; None before the first call and after ``close()``.
        self.client = None
        self._client_lock = threading.Lock()
        #: Set while kazoo reports CONNECTED; cleared by SUSPENDED and LOST.
        self._connected = threading.Event()
        #: Guards the state below, and orders lease suspension and registration against state changes.
        self._lock = threading.Lock()
        self._held = weakref.WeakValueDictionary()  # node path -> Lease
        self._successors = {}  # node path of a held lease -> a contender queued behind it when granted
        self._waiters = set()  # Events of threads waiting for a predecessor, woken on state changes
        self._leftovers = set()  # (parent, prefix, path or None): nodes to delete once connected again
        self._crowded_parents = {}  # parents recently seen with other contenders, oldest first
        #: Incremented (under the lock) on every LOST: leases of an older epoch died with it.
        self.epoch = 0
        #: Lease -> the epoch it was granted in; None once marked lost (``valid_until``).
        self._lease_epochs = weakref.WeakKeyDictionary()
        #: Whether the ensemble answers multiRead requests (ZooKeeper 3.6 and later): None until ``reads`` asked.
        self.multi_read = None
        #: Znode paths seen to be ephemeral: the protocol ignores persistent (planted) children.
        self._checked_ephemeral = {}
        #: Znode paths seen to be persistent: planted among the contenders, ignored by the protocol.
        self._persistent = {}
        #: Deletes a holder's znode when its ttl runs out; an extension moves it, a release cancels it.
        self.expiry = DeadlineTimer(self._expire, name=f"distlock-zk-expiry:{alias}")
        self._states = None
        self._queue_empty = queue.Empty
        self._state_thread = None
        _SESSIONS.add(self)

    # -- the client ------------------------------------------------------------------------------

    def connect(self, io_deadline):
        """Return the kazoo client once connected, waiting until ``io_deadline``; raise ``NotConnected``."""
        client = self.client or self._start()
        if not self._connected.wait(max(io_deadline - time.monotonic(), 0)):
            raise NotConnected(client._connection.last_failure)
        return client

    def _start(self):
        with self._client_lock:
            if self.client is None:
                client = new_client(self.settings, self._green)
                # A C SimpleQueue would block the whole hub of a green process in the state thread's get().
                self._states = client.handler.queue_impl() if self._green else queue.SimpleQueue()
                self._queue_empty = client.handler.queue_empty if self._green else queue.Empty
                self._state_thread = Daemon(self._follow_states, client, self._states,
                                            name=f"distlock-zk-states:{self.alias}")
                self._state_thread.start()
                client.add_listener(self._on_state)
                client.start_async()
                self.client = client
            return self.client

    def spare_client(self):
        """Return a kazoo client (not started) for this alias, apart from the session's: for a request whose
        failure must not touch the session's connection, and with it the leases."""
        return new_client(self.settings, self._green)

    @property
    def timeout(self):
        """Seconds after which the server expires this client's session if it stops heartbeating."""
        connection = self.client and self.client._connection
        return (connection and connection.negotiated_timeout) or self.settings["SESSION_TIMEOUT"]

    def after_fork_in_child(self):
        """Leave the parent's session to the parent: a forked child opens its own at its first call.

        The parent's threads do not exist here; under gevent its greenlets do, kazoo's among them, which
        would read the parent's replies and ping on its socket: they are ended, and the parent's sockets
        are detached first, against a greenlet woken before the fork that runs before its end. Never
        takes the old locks (a thread of the parent may have held one). The parent's leases fail
        ``check()`` here, and releasing or extending one does nothing. The expiry timer forgets the
        parent's deadlines by itself (``DeadlineTimer``).
        """
        client, self.client = self.client, None
        self._client_lock = threading.Lock()
        self._lock = threading.Lock()
        self._connected = threading.Event()
        self.epoch += 1
        self._held = weakref.WeakValueDictionary()
        self._successors = {}
        self._waiters, self._leftovers, self._crowded_parents = set(), set(), {}
        if client is None:
            return
        client.remove_listener(self._on_state)
        if self._green == "gevent":
            connection = client._connection
            for sock in (connection._socket, connection._read_sock, connection._write_sock):
                detach(sock)
            for greenlet in (connection._connection_routine, *client.handler._workers):
                if greenlet is not None:
                    greenlet.kill(block=False)
        self._state_thread.end_in_child()
        self._states = self._state_thread = None

    def close(self):
        """End the session: held leases are marked lost, their znodes deleted before it closes.

        Return the state thread, for the caller to join (off the runner), or None if not started.
        """
        with self._client_lock:
            client, self.client = self.client, None
        if client is None:
            return None
        with self._lock:
            leases = list(self._held.values())
            self._held.clear()
            self._successors.clear()
            self._leftovers.clear()
            self.mark_dead(leases)
        for lease in leases:
            self.expiry.cancel(lease.handle)
            # Queued ahead of the close request, so they run before the session ends.
            client.delete_async(lease.handle)
            client.delete_async(lease.handle.rsplit("/", 1)[0])
        self._announce_lost(leases, "the backend was closed, ending its ZooKeeper session")
        client.stop()
        client.close()
        self._states.put(None)
        self.expiry.stop()
        return self._state_thread

    # -- leases ----------------------------------------------------------------------------------

    def hold(self, lease, epoch, successor=None):
        """Register a granted lease for state changes and ttl expiry; False if its session ended since ``epoch``.

        ``successor``: the contender queued behind it in the grant's listing, for ``forget()`` to return.
        """
        with self._lock:
            if epoch != self.epoch:
                return False
            self._held[lease.handle] = lease
            if successor is not None:
                self._successors[lease.handle] = successor
            self._lease_epochs[lease] = epoch
            if not self._connected.is_set():
                lease.mark_suspended(True)
        self.expiry.schedule(lease.handle, time.monotonic() + lease.ttl)
        return True

    def is_current(self, lease):
        """True if ``lease`` was granted on the session this process still has: not lost, not the parent's."""
        return self._lease_epochs.get(lease) == self.epoch

    def valid_until(self, lease):
        """Return when ``lease``'s session may have expired on the server: fail closed (``check()`` calls it).

        -inf once the lease is marked lost or its session ended (LOST); else the negotiated timeout
        after the newest answered request or ping was sent; None for a lease not granted here.
        Lock-free and local.
        """
        epoch = self._lease_epochs.get(lease, _UNKNOWN)
        if epoch is _UNKNOWN:
            return None
        client = self.client
        connection = client and client._connection
        answered = connection and connection.last_answered_sent
        if epoch is None or epoch != self.epoch or answered is None:
            return -math.inf
        return answered + (connection.negotiated_timeout or self.settings["SESSION_TIMEOUT"])

    def forget(self, path):
        """Stop following the lease of ``path`` (released, or gone); return the successor ``hold()`` noted, or None."""
        with self._lock:
            self._held.pop(path, None)
            successor = self._successors.pop(path, None)
        self.expiry.cancel(path)
        return successor

    def mark_dead(self, leases):
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

    def _expire(self, path):
        """Expiry timer callback: the lease's ttl ran out, its holder did not extend it."""
        with self._lock:
            self._held.pop(path, None)
            self._successors.pop(path, None)
        self.send_leave(path)

    # -- requests --------------------------------------------------------------------------------

    def request_deadline(self, caller_deadline=None):
        """Return when a request must have answered (``distlock.backends.deadlines.request_deadline``)."""
        return request_deadline(self.settings["REQUEST_TIMEOUT"], caller_deadline, minimum=REQUEST_MINIMUM)

    def result(self, reply, io_deadline):
        """Return a request's result, raising its kazoo error; ``NoAnswer`` if it is late."""
        # wait() then ready(): each handler's get() raises its own kind of timeout (gevent's is a
        # gevent.Timeout, which must never be confused with a caller's own time limit).
        reply.wait(max(io_deadline - time.monotonic(), 0))
        if not reply.ready():
            raise NoAnswer
        return reply.get(block=False)

    def children(self, client, parent, io_deadline):
        """Return the children of ``parent``; none if it does not exist."""
        try:
            return self.result(client.get_children_async(parent), io_deadline)
        except NoNodeError:
            return []

    def is_crowded(self, parent):
        with self._lock:
            return parent in self._crowded_parents

    def crowd(self, parent, crowded=True):
        """Remember (or forget) that others queue under ``parent``: then a multi would only fail."""
        with self._lock:
            if not crowded:
                self._crowded_parents.pop(parent, None)
                return
            self._crowded_parents[parent] = True
            if len(self._crowded_parents) > CROWDED_NAMES:
                del self._crowded_parents[next(iter(self._crowded_parents))]

    def is_ephemeral(self, client, path, io_deadline):
        """Return False if ``path`` is a persistent node (or gone), True if ephemeral; remembered once seen."""
        if path in self._checked_ephemeral:
            return True
        if path in self._persistent:
            return False
        stat = self.result(client.exists_async(path), io_deadline)
        if stat is None:
            return False  # gone meanwhile: not in the way any more
        if stat.ephemeralOwner == 0:
            self.note_persistent(path)
            return False
        self._checked_ephemeral[path] = True
        if len(self._checked_ephemeral) > CHECKED_NODES:
            with suppress(StopIteration, KeyError, RuntimeError):
                del self._checked_ephemeral[next(iter(self._checked_ephemeral))]
        return True

    def is_persistent(self, path):
        """True if ``path`` was seen to be a persistent node (``note_persistent``); no I/O."""
        return path in self._persistent

    def note_persistent(self, path):
        """Remember that ``path`` is a persistent node among a lock's contenders: the protocol ignores it."""
        if path not in self._persistent:
            logger.warning("Ignoring %s: a persistent node among the lock's contenders (see distlock check).", path)
        self._persistent[path] = True
        if len(self._persistent) > CHECKED_NODES:
            with suppress(StopIteration, KeyError, RuntimeError):
                del self._persistent[next(iter(self._persistent))]

    @contextmanager
    def waiting(self, wake):
        """Within the block, set the Event ``wake`` on every change of the connection state."""
        with self._lock:
            self._waiters.add(wake)
        try:
            yield
        finally:
            with self._lock:
                self._waiters.discard(wake)

    def add_leftover(self, parent, prefix, path):
        """Delete ``path`` once connected again (None: ``parent``'s children named ``prefix``...), then ``parent``."""
        with self._lock:
            self._leftovers.add((parent, prefix, path))

    def send_leave(self, path, *, awaited=False):
        """Delete ``path``, and its parent if that leaves it empty, without waiting; return the node's reply.

        Unless the caller ``awaited`` the reply itself, a delete cut off by a connection loss is kept
        as a leftover, to be deleted after reconnecting.
        """
        client, parent = self.client, path.rsplit("/", 1)[0]
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
            self.add_leftover(parent, None, path)

    def _delete_if_empty(self, client, parent, listing):
        """kazoo callback: the last one out deletes the parent (NotEmpty if someone just queued: fine)."""
        if listing.successful() and not listing.value:
            self.crowd(parent, False)
            client.delete_async(parent)

    # -- connection states -----------------------------------------------------------------------

    def _on_state(self, state):
        """Run in kazoo's connection thread: flag leases and wake waiters, hand everything else off."""
        if state == KazooState.CONNECTED:
            self._connected.set()
        else:
            self._connected.clear()
            with self._lock:
                if state == KazooState.LOST:
                    self.epoch += 1
                for lease in self._held.values():
                    lease.mark_suspended(True)
        with self._lock:
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
                    wait = max(suspended_since + self.timeout - time.monotonic(), 0)
                try:
                    state = states.get(timeout=wait)
                except self._queue_empty:
                    suspended_since = None
                    self._lose_all(f"the connection stayed suspended longer than the session timeout "
                                   f"({self.timeout:g}s), so the server has expired the session")
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
                    self._delete_leftovers(client)
            except BaseException as exc:  # noqa: BLE001 - loss detection must outlive any one failure
                if killed(exc):
                    raise  # ended on purpose (a forked child)
                logger.exception("Following the ZooKeeper connection state of alias %r raised; carrying on.",
                                 self.alias)

    def _lose_all(self, reason):
        with self._lock:
            leases = list(self._held.values())
            self._held.clear()
            self._successors.clear()
            self.mark_dead(leases)
            # If the session survives after all, its nodes must not block others: delete them on reconnect.
            self._leftovers.update((lease.handle.rsplit("/", 1)[0], None, lease.handle) for lease in leases)
        for lease in leases:
            self.expiry.cancel(lease.handle)
        self._announce_lost(leases, reason)

    def _revalidate(self, client):
        """After a reconnection within the session: unsuspend leases whose znode is still ours."""
        with self._lock:
            suspended = [lease for lease in self._held.values() if lease.suspended]
        if not suspended:
            return
        replies = [(lease, client.exists_async(lease.handle)) for lease in suspended]
        session_id = (client.client_id or (None,))[0]
        io_deadline = self.request_deadline()
        gone = []
        for lease, reply in replies:
            try:
                stat = self.result(reply, io_deadline)
            except FAILURES:
                continue  # still uncertain: the next reconnection, or the session timeout, decides
            if stat is not None and stat.ephemeralOwner == session_id:
                with self._lock:
                    # The listener clears _connected before suspending under this lock: no lost update.
                    if self._connected.is_set():
                        lease.mark_suspended(False)
            else:
                self.mark_dead([lease])
                gone.append(lease)
        for lease in gone:
            self.forget(lease.handle)
        self._announce_lost(gone, "its znode was gone when the connection came back")

    def _delete_leftovers(self, client):
        with self._lock:
            leftovers, self._leftovers = self._leftovers, set()
        io_deadline = self.request_deadline()
        for parent, prefix, path in leftovers:
            try:
                paths = [path] if path else [f"{parent}/{child}" for child in self.children(client, parent, io_deadline)
                                             if child.startswith(prefix)]
                for node in paths:
                    with suppress(NoNodeError):
                        self.result(client.delete_async(node), io_deadline)
                client.delete_async(parent)
            except FAILURES:
                self.add_leftover(parent, prefix, path)
