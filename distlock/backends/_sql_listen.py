"""Release notifications of the database backend on PostgreSQL: one ``LISTEN`` connection per alias and process.

A release with waiters sends ``NOTIFY`` with the owner id of the waiter first in line
(``distlock.backends._sql``). One background loop per backend (a daemon thread, or a greenlet under
gevent: ``Daemon``) holds a connection of its own, outside the pool of ``MAX_CONNECTIONS``, listening
on ``NOTIFY_CHANNEL``, and wakes the waiter of this process with that owner id, if it is here. It
starts at the first wait, so processes that never wait open no such connection. Notifications only
hurry waiters on: a waiter whose notification is lost (the connection dropped, the loop not listening
yet) tries again after its back-off, as without them.
"""

import logging
import select
import threading
from collections import OrderedDict

from distlock.backends.green import Daemon, ForkedChildHook
from distlock.redaction import redact
from distlock.waiting import Wakeups

__all__ = ["ReleaseListener"]

logger = logging.getLogger(__name__)

#: Every listener: a forked child has none of the parent's connection or loop.
_LISTENERS = ForkedChildHook("_forget_after_fork")

#: Seconds the loop waits for notifications before it looks whether it must stop.
RECEIVE_SECONDS = 0.25
#: Seconds before connecting again after the connection failed: the first pause, doubled up to the last.
RECONNECT_PAUSES = (0.1, 2.0)


class ReleaseListener:
    """Wake a waiter of this process when the database announces that its turn came (a release).

    A waiter notes ``since()`` before its try and, after a refused try, ``wait``s for an announcement
    for its owner id numbered above it: a release landing between the try and the wait is not missed.
    Each time the loop starts listening (again), every waiter is woken, since releases may have gone
    unheard before.
    """

    #: Owners whose latest announcement is remembered; older ones fall back to polling.
    remembered = 1024

    def __init__(self, connect, disconnect, alias):
        #: ``connect()`` returns a wrapper of the backend's own that listens on ``NOTIFY_CHANNEL`` already (its
        #: ``LISTEN`` bounded by ``REQUEST_TIMEOUT``); ``disconnect(wrapper)`` closes it.
        self._connect, self._disconnect = connect, disconnect
        self._alias = alias
        self._wakeups = Wakeups()
        self._forget_after_fork()
        _LISTENERS.add(self)

    def _forget_after_fork(self):
        # The parent's loop does not run here (a greenlet is ended), its connection is the parent's.
        daemon = getattr(self, "_daemon", None)
        if daemon is not None:
            daemon.end_in_child()
        self._counting = threading.Lock()  # the loop's only: waiters never take it (see distlock.waiting)
        self._start_lock = threading.Lock()
        self._turns = OrderedDict()  # owner id -> number of its latest announcement
        #: Announcements so far (releases heard, and the starts of listening).
        self.sequence = 0
        self._listening_since = None  # the number of the latest start of listening; None while not listening
        self._daemon = None
        self._stopping = None  # a list: [True] tells the current loop to end
        self.wrapper = None  # the listening connection, while there is one

    @property
    def listening(self):
        """True while the loop listens (``LISTEN`` done on an open connection)."""
        return self._listening_since is not None

    def since(self):
        """Start the loop unless it runs; return the number a waiter waits above: the announcements so far."""
        if self._daemon is None:
            with self._start_lock:
                if self._daemon is None:
                    stopping = [False]
                    daemon = Daemon(self._listen, stopping, name=f"distlock-db-listen:{self._alias}")
                    daemon.start()
                    self._daemon, self._stopping = daemon, stopping
        return self.sequence

    def wait(self, owner, since, timeout):
        """Block until a turn of ``owner`` (or a start of listening) numbered above ``since``, at most ``timeout``.

        Return "release" or "listening", whichever woke the waiter, or None after ``timeout``.
        """
        def woken():
            if self._turns.get(owner, 0) > since:
                return "release"
            if (self._listening_since or 0) > since:
                return "listening"
            return None

        return self._wakeups.wait_for(woken, timeout)

    def _announce(self, stopping, owner=None):
        """Number the turn of ``owner`` (None: a start of listening) and wake the waiters; not once stopped."""
        with self._counting:
            if stopping[0]:
                return
            self.sequence += 1
            if owner is None:
                self._listening_since = self.sequence
            else:
                self._turns[owner] = self.sequence
                self._turns.move_to_end(owner)
                if len(self._turns) > self.remembered:
                    self._turns.popitem(last=False)
        self._wakeups.notify_all()

    def _listen(self, stopping):
        pause = RECONNECT_PAUSES[0]
        while not stopping[0]:
            wrapper = None
            try:
                wrapper = self._connect()
                if stopping[0]:
                    break  # stopped while connecting: a newer loop may be the current one
                self.wrapper = wrapper
                self._announce(stopping)
                pause = RECONNECT_PAUSES[0]
                # libpq's own calls, not psycopg's ``notifies()``: its wait is a C poll() that eventlet
                # cannot switch out of, so it would stall every green thread of the process. ``select``
                # is what gevent and eventlet patch.
                pgconn = wrapper.connection.pgconn
                while not stopping[0]:
                    if not select.select([pgconn.socket], [], [], RECEIVE_SECONDS)[0]:
                        continue
                    pgconn.consume_input()  # raises once the server closed the connection
                    while (notification := pgconn.notifies()) is not None:
                        self._announce(stopping, notification.extra.decode())
            except Exception as exc:  # noqa: BLE001 - any failure: waiters poll meanwhile, the loop reconnects
                if not stopping[0]:
                    logger.info("Alias %r: release notifications interrupted (%s); waiters poll until they resume.",
                                self._alias, redact(str(exc).strip().split("\n", 1)[0]))
            finally:
                # A stopped loop leaves the state alone: a loop started after the stop owns it.
                if not stopping[0]:
                    self._listening_since = None
                if self.wrapper is wrapper:
                    self.wrapper = None
                if wrapper is not None:
                    self._disconnect(wrapper)
            if stopping[0]:
                return
            self._wakeups.wait_for(lambda: stopping[0], pause)
            pause = min(pause * 2, RECONNECT_PAUSES[1])

    def stop(self):
        """End the loop (within ``RECEIVE_SECONDS``) and close its connection; a later wait starts a new one."""
        with self._start_lock:
            daemon, stopping = self._daemon, self._stopping
            self._daemon = self._stopping = None
            if daemon is None:
                return
            stopping[0] = True
            self._listening_since = None
        self._wakeups.notify_all()
        if not daemon.is_current():
            daemon.join(2 * RECEIVE_SECONDS)
