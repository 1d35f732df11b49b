"""Time limits every backend shares: how long one request may take, and a timer that acts at deadlines.

``request_deadline`` is the one rule for bounding a request: ``REQUEST_TIMEOUT`` from now, cut to
what is left of the caller's timeout, but never below the backend's own minimum (a request cut too
short fails on a healthy server and tells the caller nothing).

``DeadlineTimer`` runs a callback for each key whose deadline passes: ZooKeeper and etcd delete the
record of a holder whose ttl ran out (their servers know only sessions), the database backend cuts
off a statement that outlives its bound. One daemon thread per timer (a greenlet under gevent),
started on first use and asleep until the earliest deadline. Deadlines live in a heap with lazy
deletion: moving or cancelling one only updates a dict, and stale heap entries are skipped when
they surface and compacted once they outnumber the live ones.

Callers schedule from threads that an exception can interrupt between any two lines (a time limit, a
``gevent.Timeout``), so the timer waits on a queue (``distlock.backends.green.mailbox``), never on a
``Condition``, and restarts its thread if an interrupt left it for dead. After a fork the child
forgets the parent's timers (their thread is not there) and ends their greenlets.
"""

import heapq
import logging
import queue
import threading
import time

from distlock.backends.green import Daemon, ForkedChildHook, killed, mailbox

logger = logging.getLogger(__name__)

__all__ = ["DeadlineTimer", "request_deadline", "request_seconds"]


def request_deadline(limit, caller_deadline=None, *, minimum):
    """Return the ``time.monotonic()`` by which one request must have answered.

    ``limit`` is the alias's ``REQUEST_TIMEOUT`` (None: no limit of its own); ``caller_deadline`` the
    monotonic end of the caller's timeout, or None; ``minimum`` the backend's floor in seconds.
    """
    now = time.monotonic()
    bound = request_seconds(limit, caller_deadline, minimum=minimum, now=now)
    return None if bound is None else now + bound


def request_seconds(limit, caller_deadline=None, *, minimum, now=None):
    """Return ``request_deadline`` as seconds from now (None: no bound at all)."""
    if caller_deadline is None:
        return limit
    now = time.monotonic() if now is None else now
    left = max(caller_deadline - now, minimum)
    return left if limit is None else min(limit, left)


#: Every timer of this process.
_TIMERS = ForkedChildHook("_forget_after_fork")


class DeadlineTimer:
    """Call ``callback(key)`` once ``key``'s deadline (``time.monotonic()``) has passed, unless cancelled first.

    ``callback`` runs on the timer's thread and must not block. With ``under_lock`` it runs while the
    timer's lock is held, so that once ``cancel(key)`` returns the callback for that key cannot run
    any more (the database backend must never cut off a connection that a later call uses); such a
    callback must not call back into the timer. Otherwise it runs after the lock is released, and may
    take other locks.
    """

    #: Stale heap entries allowed beyond twice the live ones before the heap is rebuilt.
    COMPACT_SLACK = 1024

    def __init__(self, callback, *, name, under_lock=False):
        self._callback = callback
        self._name = name
        self._under_lock = under_lock
        self._forget_after_fork()
        _TIMERS.add(self)

    def _forget_after_fork(self):
        # Also the initial state. In a forked child the parent's thread is gone (its greenlet is told
        # to end) and may have held the lock at fork(): start over with nothing scheduled.
        thread = getattr(self, "_thread", None)
        if thread is not None:
            thread.end_in_child()
        self._lock = threading.Lock()  # a plain lock and a queue, never a Condition: see distlock.waiting
        self._wake = mailbox()
        self._deadlines = {}
        self._heap = []  # (deadline, sequence, key); entries whose deadline moved are skipped
        self._sequence = 0  # ties in the heap never compare keys
        self._wake_at = float("inf")
        self._thread = None
        self._stopped = False

    def schedule(self, key, deadline):
        """Set ``key``'s deadline, earlier or later than before; start the thread on first use."""
        with self._lock:
            self._ensure_thread()
            self._set(key, deadline)

    def move(self, key, deadline):
        """Set the deadline of a scheduled ``key``; return False if it already fired or was cancelled."""
        with self._lock:
            if key not in self._deadlines:
                return False
            self._set(key, deadline)
            return True

    def cancel(self, key):
        """Forget ``key``; return False if it was not scheduled (its callback ran, or it was never set).

        With ``under_lock``, its callback cannot run once this returns, so False means it has run.
        """
        with self._lock:
            scheduled = self._deadlines.pop(key, None) is not None
            self._compact()
            return scheduled

    def stop(self):
        """End the thread (joined unless called from it); a later ``schedule`` starts a new one."""
        with self._lock:
            self._stopped = True
            self._wake.put(None)
            thread, self._thread = self._thread, None
        if thread is not None and not thread.is_current():
            thread.join(5.0)

    def end_in_child(self):
        """In a forked child: end the parent's greenlet, which would act on the parent's records."""
        if self._thread is not None:
            self._thread.end_in_child()

    def __len__(self):
        return len(self._deadlines)

    def _set(self, key, deadline):
        self._deadlines[key] = deadline
        self._sequence += 1
        heapq.heappush(self._heap, (deadline, self._sequence, key))
        if deadline < self._wake_at:
            self._wake.put(None)  # wake the thread only if it now has to wake sooner
        self._compact()

    def _compact(self):
        """Rebuild the heap once stale entries outnumber live ones, so long deadlines cannot pile them up."""
        if len(self._heap) > 2 * len(self._deadlines) + self.COMPACT_SLACK:
            self._heap = [(deadline, sequence, key)
                          for sequence, (key, deadline) in enumerate(self._deadlines.items(), self._sequence + 1)]
            self._sequence += len(self._heap)
            heapq.heapify(self._heap)

    def _ensure_thread(self):
        if self._thread is not None and self._thread.is_alive():
            return
        # An interrupt inside threading's is_alive() or join() can mark a running thread stopped: wake
        # the old one, which leaves once its queue is no longer the current one.
        self._wake.put(None)
        self._wake = mailbox()
        self._stopped = False
        self._thread = Daemon(self._run, self._wake, name=self._name)
        self._thread.start()

    def _due(self, now):
        """Pop and return the keys whose deadline passed; the caller holds the lock."""
        due = []
        while self._heap and self._heap[0][0] <= now:
            deadline, _, key = heapq.heappop(self._heap)
            if self._deadlines.get(key) == deadline:
                del self._deadlines[key]
                due.append(key)
        return due

    def _run(self, wake):
        while True:
            with self._lock:
                if self._stopped or wake is not self._wake:
                    return
                now = time.monotonic()
                due = self._due(now)
                if self._under_lock:
                    self._fire(due)
                    due = ()
                self._wake_at = self._heap[0][0] if self._heap else float("inf")
            self._fire(due)
            if due:
                continue  # a callback may have taken time: look again before sleeping
            try:
                wake.get(timeout=None if self._wake_at == float("inf") else max(self._wake_at - now, 0))
            except queue.Empty:
                pass

    def _fire(self, keys):
        for key in keys:
            try:
                self._callback(key)
            except BaseException as exc:  # noqa: BLE001 - the timer must outlive any one failure
                if killed(exc):
                    raise  # ended on purpose (a forked child)
                logger.exception("The %s timer's action for %r failed; the timer carries on.", self._name, key)
