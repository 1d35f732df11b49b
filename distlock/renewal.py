"""The watchdog that keeps a lease alive while held, and stops at ``max_hold``."""

import logging
import threading
import time
import weakref

from distlock.exceptions import BackendUnavailable

logger = logging.getLogger("distlock.renewal")


class Renewer:
    """Extend a lease every ``ttl / 3`` seconds from a daemon thread until it is released.

    The thread holds only a weak reference to the lease, so a lease dropped without release stops its
    own renewal and then expires on the server. Renewal stops, and the lock is released and the lease
    marked lost, once ``max_hold`` seconds have passed: a hung worker whose renewal thread still runs
    must not hold the lock forever. A server that cannot be reached is retried until the lease's own
    validity runs out; then the lease is marked lost.
    """

    #: Fraction of the ttl between two extensions.
    interval_ratio = 1 / 3

    def __init__(self, lease, *, max_hold=None, clock=time.monotonic, thread_class=threading.Thread):
        self._lease_ref = weakref.ref(lease)
        self._ttl = lease.ttl
        self._interval = lease.ttl * self.interval_ratio
        self._hold_deadline = None if max_hold is None else lease._started + max_hold
        self._clock = clock
        self._stopped = threading.Event()
        self._thread = thread_class(target=self._run, name=f"distlock-renew:{lease.name[:40]}", daemon=True)

    def start(self):
        self._thread.start()

    def stop(self):
        """Stop renewing; join the thread unless called from it."""
        self._stopped.set()
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self._thread.join()

    def _run(self):
        while not self._stopped.wait(self._next_wait()):
            lease = self._lease_ref()
            if lease is None or lease.released or lease._lost_reason is not None:
                return
            if self._hold_deadline is not None and self._clock() >= self._hold_deadline:
                self._stop_at_max_hold(lease)
                return
            self._renew(lease)
            del lease

    def _next_wait(self):
        wait = self._interval
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
        took = self._clock() - started
        if took > self._interval:
            logger.warning("Renewing lock %r took %.3fs, longer than the renewal interval %.3fs",
                           lease.name, took, self._interval)

    def _stop_at_max_hold(self, lease):
        try:
            lease.backend.release(lease)
        except BackendUnavailable as exc:
            logger.warning("Releasing lock %r at max_hold failed (%s); it expires on the server", lease.name, exc)
        lease.mark_lost("max_hold reached: renewal stopped and the lock was released")
