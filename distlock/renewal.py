"""Auto-renewal: one scheduler per backend alias keeps every auto-renewed lease of the process alive, and stops at
``max_hold``.

A thread per lease does not scale: a worker holding a lock per customer import would run a thousand
threads, each with its stack, all waking to take the GIL at once. A scheduler is a heap of deadlines
served by one daemon thread (a greenlet under gevent) per alias, which exists only while the alias
has leases to renew; a slow or unreachable server delays the renewals of its own alias only.
"""

import heapq
import itertools
import logging
import math
import os
import threading
import time
import weakref

from distlock.backends.green import Daemon, ForkedChildHook, killed
from distlock.exceptions import BackendUnavailable

__all__ = ["Renewer", "renewing"]

logger = logging.getLogger(__name__)


class Renewer:
    """Extend one lease every ``ttl / 3`` seconds, from its alias's scheduler, until it is released.

    The scheduler holds only a weak reference to the lease, so a lease dropped without release stops
    its own renewal and then expires on the server. Renewal stops, and the lock is released and the
    lease marked lost, once ``max_hold`` seconds have passed: a hung worker whose process still renews
    must not hold the lock forever. A server that cannot be reached is retried until the lease's own
    validity runs out; then the lease is marked lost. Any other error of an extension (a bug, a reply
    the client could not read) is logged with its traceback and retried the same way: the scheduler
    never drops a lease that looks held but is no longer renewed. If renewing a lease fails in a way
    nothing above handles, the lease is marked lost.
    """

    #: Fraction of the ttl between two extensions.
    interval_ratio = 1 / 3
    #: Fraction of the interval by which an extension may come early, to share a round trip with others due.
    early_ratio = 1 / 4

    def __init__(self, lease, *, max_hold=None, clock=time.monotonic):
        self._lease_ref = weakref.ref(lease)
        self._ttl = lease.ttl
        self._interval = lease.ttl * self.interval_ratio
        self._early = self._interval * self.early_ratio
        self._hold_deadline = None if max_hold is None else lease.started + max_hold
        self._clock = clock
        # Counted from the acquire request, not from start(): ``acquire()`` starts renewal only after
        # the ``lock_acquired`` receivers ran, and a slow receiver must not delay the first extension
        # past the lease's validity.
        self._due = lease.started + self._interval
        self._scheduler = None
        #: Told to stop (released, cancelled, or the parent's lease in a forked child).
        self._cancelled = False
        #: Dropped by its scheduler: the lease ended, or renewal stopped for good.
        self._ended = False
        #: The scheduler is extending (or releasing, at max_hold) this lease right now.
        self._busy = False
        #: Set during a turn once renewal is over for good (see ``_due_extension``).
        self._finished = False

    def start(self):
        """Hand the lease to its alias's scheduler (once). A renewer cancelled before never extends."""
        lease = self._lease_ref()
        if self._scheduler is None and lease is not None:
            self._scheduler = _scheduler_of(lease.backend)
            self._scheduler.add(self)

    def cancel(self):
        """Stop renewing at the scheduler's next look, without waiting: one flag, nothing that blocks."""
        self._cancelled = True

    def stop(self):
        """Stop renewing; wait for an extension of this lease in flight, unless called from the scheduler."""
        self._cancelled = True
        scheduler = self._scheduler
        if scheduler is not None:
            scheduler.wait_until_idle(self)

    @property
    def running(self):
        """True while the lease is still renewed: started, and neither cancelled nor dropped, or an extension runs."""
        return self._scheduler is not None and (self._busy or not (self._cancelled or self._ended))

    def _next_at(self):
        """The ``clock()`` time of the next extension, or of max_hold if sooner."""
        if self._hold_deadline is None:
            return self._due
        return min(self._due, self._hold_deadline)

    def _next_wait(self):
        return max(0.0, self._next_at() - self._clock())

    def _due_extension(self):
        """Return ``(lease, ttl)`` if an extension is due now, else None; set ``_finished`` once renewal is over.

        Over when the lease is gone (released, lost, dropped), or at ``max_hold``, where it releases the lock.
        """
        lease = self._lease_ref()
        if lease is None or lease.released or lease.lost_reason is not None:
            self._finished = True
            return None
        if self._hold_deadline is not None and self._clock() >= self._hold_deadline:
            self._stop_at_max_hold(lease)
            self._finished = True
            return None
        if self._clock() < self._due - self._early:
            return None  # woken for max_hold, which is not here yet either
        return lease, self._extension_ttl()

    def _extension_ttl(self):
        if self._hold_deadline is None:
            return self._ttl
        # Never extend past max_hold: the server frees the lock then even if renewal stops.
        return min(self._ttl, max(self._hold_deadline - self._clock(), 0.001))

    def _settle(self, lease, ttl, started, outcome):
        """Apply what the extension of ``lease`` sent at ``started`` came to: True, False (lost) or an exception."""
        if isinstance(outcome, BackendUnavailable):
            if lease.remaining() <= 0:
                lease.mark_lost(f"renewal could not reach the server before the lease ran out ({outcome})")
            else:
                logger.warning("Renewing lock %r failed, retrying: %s", lease.name, outcome)
        elif isinstance(outcome, BaseException):
            # Unexpected, so with its traceback; retried like an unreachable server, because the
            # lock may well still be ours until the lease's validity runs out, and not after.
            if lease.remaining() <= 0:
                lease.mark_lost(f"renewal failed until the lease ran out ({outcome!r})")
            else:
                logger.error("Renewing lock %r raised an unexpected error, retrying", lease.name, exc_info=outcome)
        else:
            lease._settle_extension(started, ttl, outcome)
            took = self._clock() - started
            if took > self._interval:
                logger.warning("Renewing lock %r took %.3fs, longer than the renewal interval %.3fs",
                               lease.name, took, self._interval)
        self._finished = lease.lost_reason is not None

    def _stop_at_max_hold(self, lease):
        try:
            lease.backend.release(lease)
        except BackendUnavailable as exc:
            logger.warning("Releasing lock %r at max_hold failed (%s); it expires on the server", lease.name, exc)
        except Exception:
            logger.error("Releasing lock %r at max_hold raised; it expires on the server", lease.name, exc_info=True)
        lease.mark_lost("max_hold reached: renewal stopped and the lock was released")

    def _fail_closed(self, exc):
        """Renewing raised past every handler: the holder's next check() must raise, not trust a lease nobody renews."""
        lease = self._lease_ref()
        if lease is not None and not self._cancelled:
            lease.mark_lost(f"its renewal stopped on an unexpected error ({exc!r})")


class _Scheduler:
    """The renewers of one backend alias: a heap of their next deadlines, served by one daemon loop.

    The loop starts with the first renewer and ends when none is left. ``_lock`` guards the heap, the
    loop and every renewer's ``_busy``; ``_idle`` is notified whenever a renewer stops being busy.
    """

    def __init__(self, alias):
        self.alias = alias
        self._reset()

    def _reset(self):
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._wake = threading.Event()
        self._heap = []  # (clock time, sequence, renewer)
        #: Every renewer not ended: in the heap, or taken out of it for its turn.
        self._renewers = set()
        #: The renewal clock of each interval: {interval: the time of one of its rounds} (``_round_after``).
        self._anchors = {}
        self._sequence = itertools.count()
        self._daemon = None

    def _end_in_forked_child(self):
        """Forget the parent's renewals: its leases are not this process's to extend, nor to mark lost."""
        for renewer in self._renewers:
            renewer._cancelled = renewer._ended = True
            renewer._busy = False
        if self._daemon is not None:
            self._daemon.end_in_child()
        self._reset()

    def _round_after(self, interval, moment):
        """Return the first round of the renewal clock of ``interval`` after ``moment``: at most ``interval`` later.

        Leases of one ttl are extended on one clock, a round every interval from the first such
        lease's first extension: however spread their acquisitions were, a round extends all of
        them in one call. A lease joins at the round after its acquisition, so its first extension
        comes sooner than ``interval`` after it, never later.
        """
        anchor = self._anchors.setdefault(interval, moment + interval)
        return anchor + math.floor((moment + interval - anchor) / interval) * interval

    def add(self, renewer):
        with self._lock:
            renewer._due = self._round_after(renewer._interval, renewer._due - renewer._interval)
            heapq.heappush(self._heap, (renewer._next_at(), next(self._sequence), renewer))
            self._renewers.add(renewer)
            if self._daemon is None:
                self._daemon = Daemon(self._run, name=f"distlock-renew:{self.alias}")
                self._daemon.start()
        self._wake.set()

    def wait_until_idle(self, renewer):
        """Return once no extension of ``renewer`` is in flight (at once on the scheduler's own loop)."""
        daemon = self._daemon
        if daemon is not None and daemon.is_current():
            return
        with self._idle:
            while renewer._busy:
                self._idle.wait()

    def _run(self):
        while True:
            with self._lock:
                due = self._take_due()
                if not due and not self._heap:
                    self._daemon = None  # the next add() starts a new loop
                    return
                wait = None if due else self._heap[0][0] - time.monotonic()
            if due:
                try:
                    self._serve(due)
                except BaseException as exc:
                    if killed(exc):
                        raise  # the parent's loop, ended on purpose in a forked child
                    # Every renewer went back to the heap or ended (``_serve``'s finally): carry on.
                    logger.exception("The renewal scheduler of alias %r failed a round; it carries on", self.alias)
            else:
                self._wake.wait(max(wait, 0.0))
                self._wake.clear()

    def _take_due(self):
        """Pop the renewers whose deadline has come, and with them those due within their ``_early`` margin: the
        leases renewed together stay due together, so a round of many leases becomes one call. Drop the
        cancelled ones."""
        due, now = [], time.monotonic()
        if not self._heap or self._heap[0][0] > now:
            now = -math.inf  # nothing due yet: pop only the cancelled ones at the head
        while self._heap and (self._heap[0][0] <= now + self._heap[0][2]._early or self._heap[0][2]._cancelled):
            _, _, renewer = heapq.heappop(self._heap)
            if renewer._cancelled:
                self._end(renewer)
            else:
                due.append(renewer)
        return due

    def _serve(self, due):
        """Extend the leases of the due renewers in one ``extend_many`` call (one round trip where the backend
        batches). Each renewer is busy during the turn, so a release waits for its own lease's extension."""
        taking = []
        with self._lock:
            for renewer in due:
                if renewer._cancelled:
                    self._end(renewer)
                else:
                    renewer._busy = True
                    taking.append(renewer)
        extending = []
        round_time = time.monotonic()
        try:
            for renewer in taking:
                extension = self._guarded(renewer, renewer._due_extension)
                if extension is not None:
                    extending.append((renewer, *extension))
            if extending:
                started = time.monotonic()
                backend = extending[0][1].backend
                try:
                    outcomes = backend.extend_many([(lease, ttl) for _, lease, ttl in extending])
                    if len(outcomes) != len(extending):
                        raise RuntimeError(f"{type(backend).__name__}.extend_many() returned {len(outcomes)} "
                                           f"outcomes for {len(extending)} leases")
                except Exception as exc:  # noqa: BLE001 - the same for every lease of the call
                    outcomes = [exc] * len(extending)
                for (renewer, lease, ttl), outcome in zip(extending, outcomes, strict=True):
                    self._guarded(renewer, renewer._settle, lease, ttl, started, outcome)
        finally:
            with self._lock:
                for renewer, _, _ in extending:
                    renewer._due = self._round_after(renewer._interval, round_time)
                for renewer in taking:
                    renewer._busy = False
                    if renewer._finished or renewer._cancelled:
                        self._end(renewer)
                    else:
                        heapq.heappush(self._heap, (renewer._next_at(), next(self._sequence), renewer))
                self._idle.notify_all()

    @staticmethod
    def _guarded(renewer, step, *args):
        """Run one renewer's ``step``: what raises past its handlers marks that lease lost and ends its renewal
        only; the loop serves the others."""
        try:
            return step(*args)
        except BaseException as exc:
            if killed(exc):
                raise  # the parent's loop, ended on purpose in a forked child
            logger.exception("Renewing lock %r raised past its handlers; the lease is marked lost",
                             getattr(renewer._lease_ref(), "name", "?"))
            renewer._finished = True
            renewer._fail_closed(exc)
            return None

    def _end(self, renewer):
        """Drop ``renewer`` for good (with ``_lock`` held)."""
        renewer._ended = True
        self._renewers.discard(renewer)

    def leases(self):
        """Return the leases of the renewers not ended."""
        with self._lock:
            renewers = list(self._renewers)
        return [lease for lease in (renewer._lease_ref() for renewer in renewers if renewer.running)
                if lease is not None]


#: The scheduler of each backend that renews leases in this process.
_SCHEDULERS = weakref.WeakKeyDictionary()
_FORKED = ForkedChildHook("_end_in_forked_child")


def _new_schedulers_lock():
    """A new lock, also in a forked child: the parent's may have been held by a thread that is not there."""
    global _SCHEDULERS_LOCK  # noqa: PLW0603 - one lock per process
    _SCHEDULERS_LOCK = threading.Lock()


_new_schedulers_lock()
os.register_at_fork(after_in_child=_new_schedulers_lock)


def renewing(alias=None):
    """Return the leases this process renews right now (of ``alias``, or of every alias): for diagnostics."""
    with _SCHEDULERS_LOCK:
        schedulers = [scheduler for scheduler in _SCHEDULERS.values() if alias in (None, scheduler.alias)]
    return [lease for scheduler in schedulers for lease in scheduler.leases()]


def _scheduler_of(backend):
    with _SCHEDULERS_LOCK:
        scheduler = _SCHEDULERS.get(backend)
        if scheduler is None:
            scheduler = _SCHEDULERS[backend] = _Scheduler(backend.alias)
            _FORKED.add(scheduler)
        return scheduler
