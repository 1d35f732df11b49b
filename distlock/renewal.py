"""The watchdog that keeps a lease alive while held, and stops at ``max_hold``."""

import logging
import threading
import time
import weakref

from distlock.backends.green import Daemon, ForkedChildHook
from distlock.exceptions import BackendUnavailable

__all__ = ["Renewer"]

logger = logging.getLogger(__name__)

#: Every renewer of this process that was started.
_STARTED = ForkedChildHook("_end_in_forked_child")


class Renewer:
    """Extend a lease every ``ttl / 3`` seconds from a daemon thread (a greenlet under gevent) until it is released.

    The thread holds only a weak reference to the lease, so a lease dropped without release stops its
    own renewal and then expires on the server. Renewal stops, and the lock is released and the lease
    marked lost, once ``max_hold`` seconds have passed: a hung worker whose renewal thread still runs
    must not hold the lock forever. A server that cannot be reached is retried until the lease's own
    validity runs out; then the lease is marked lost. Any other error of an extension (a bug, a reply
    the client could not read) is logged with its traceback and retried the same way: the thread never
    dies leaving a lease that looks held but is no longer renewed. If the thread ends for any reason
    other than the lease's end, it marks the lease lost first.
    """

    #: Fraction of the ttl between two extensions.
    interval_ratio = 1 / 3

    def __init__(self, lease, *, max_hold=None, clock=time.monotonic):
        self._lease_ref = weakref.ref(lease)
        self._ttl = lease.ttl
        self._interval = lease.ttl * self.interval_ratio
        self._hold_deadline = None if max_hold is None else lease.started + max_hold
        self._clock = clock
        # Counted from the acquire request, not from start(): ``acquire()`` starts the thread only
        # after the ``lock_acquired`` receivers ran, and a slow receiver must not delay the first
        # extension past the lease's validity.
        self._due = lease.started + self._interval
        self._stopped = threading.Event()
        self._thread = Daemon(self._run, name=f"distlock-renew:{lease.name[:40]}")

    def start(self):
        """Start the thread (once). A renewer cancelled before, or while, it starts never extends."""
        _STARTED.add(self)
        self._thread.start()

    def _end_in_forked_child(self):
        """Stop the parent's renewal in a forked child: the lease is the parent's (under gevent its greenlet runs on)."""
        self._stopped.set()  # first: an ended renewal must not mark its lease lost
        self._thread.end_in_child()

    def cancel(self):
        """Tell the thread to stop at its next wake-up, without waiting: one flag, nothing that blocks."""
        self._stopped.set()

    def stop(self):
        """Stop renewing; join the thread unless called from it."""
        self._stopped.set()
        if not self._thread.is_current() and self._thread.is_alive():
            self._thread.join()

    @property
    def running(self):
        """True while the thread is alive."""
        return self._thread.is_alive()

    def _run(self):
        try:
            while not self._stopped.wait(self._next_wait()):
                lease = self._lease_ref()
                if lease is None or lease.released or lease.lost_reason is not None:
                    return
                if self._hold_deadline is not None and self._clock() >= self._hold_deadline:
                    self._stop_at_max_hold(lease)
                    return
                self._renew(lease)
                self._due = self._clock() + self._interval
                del lease
        except BaseException as exc:
            # Not expected (``_renew`` handles extension errors): fail closed, so the holder's next
            # check() raises instead of trusting a lease nobody renews any more.
            lease = self._lease_ref()
            if lease is not None and not self._stopped.is_set():
                lease.mark_lost(f"its renewal thread stopped on an unexpected error ({exc!r})")
            raise

    def _next_wait(self):
        wait = max(0.0, self._due - self._clock())
        if self._hold_deadline is not None:
            wait = min(wait, max(0.0, self._hold_deadline - self._clock()))
        return wait

    def _renew(self, lease):
        ttl = self._ttl
        if self._hold_deadline is not None:
            # Never extend past max_hold: the server frees the lock then even if this thread dies.
            ttl = min(ttl, max(self._hold_deadline - self._clock(), 0.001))
        started = self._clock()
        try:
            lease.extend(ttl)
        except BackendUnavailable as exc:
            if lease.remaining() <= 0:
                lease.mark_lost(f"renewal could not reach the server before the lease ran out ({exc})")
            else:
                logger.warning("Renewing lock %r failed, retrying: %s", lease.name, exc)
            return
        except Exception as exc:
            # Unexpected, so with its traceback; retried like an unreachable server, because the
            # lock may well still be ours until the lease's validity runs out, and not after.
            if lease.remaining() <= 0:
                lease.mark_lost(f"renewal failed until the lease ran out ({exc!r})")
            else:
                logger.error("Renewing lock %r raised an unexpected error, retrying", lease.name, exc_info=True)
            return
        took = self._clock() - started
        if took > self._interval:
            logger.warning("Renewing lock %r took %.3fs, longer than the renewal interval %.3fs",
                           lease.name, took, self._interval)

    def _stop_at_max_hold(self, lease):
        try:
            lease.backend.release(lease)
        except BackendUnavailable as exc:
            logger.warning("Releasing lock %r at max_hold failed (%s); it expires on the server", lease.name, exc)
        except Exception:
            logger.error("Releasing lock %r at max_hold raised; it expires on the server", lease.name, exc_info=True)
        lease.mark_lost("max_hold reached: renewal stopped and the lock was released")
