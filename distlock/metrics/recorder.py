"""The per-process recorder: an event queue on the hot path, folded and flushed by a daemon thread.

``record_*`` only append a tuple to a ``collections.deque`` (atomic in CPython, no lock, no I/O), so
recording adds no network round trip and almost no time to ``acquire()``. Every second the thread
folds the queue into per-minute counts keyed ``(period_start, alias, prefix, series, bucket)`` and
into the Prometheus instruments; every ``FLUSH_INTERVAL`` seconds, and at exit, it adds the counts to
the shared store. Counts that fail to reach the store stay pending for the next flush.
"""

import atexit
import logging
import multiprocessing.util
import os
import threading
import time
import weakref
from bisect import bisect_left
from collections import Counter, defaultdict, deque

from django.db import connections

from distlock.metrics import conf, prometheus, series

logger = logging.getLogger("distlock.metrics")

#: Names that share the part before the first ':' are counted together; names past the cap as this.
OTHER_PREFIX = "other"
#: Seconds between two folds of the queue (the Prometheus figures lag by at most this).
DRAIN_INTERVAL = 1.0
#: Seconds between two attempts of this process to fold old minutes into the since-start totals.
FOLD_INTERVAL = 3600
#: Seconds the exit flush waits for a flush already running in the thread.
EXIT_FLUSH_WAIT = 5.0
#: Minutes: counts are summed per period of this many seconds.
PERIOD = 60
#: Failed flushes in a row before a warning: one failure is a blip (or a test run blocking the database).
WARN_AFTER_FAILURES = 3
#: Seconds between two warnings while flushes keep failing (the failures in between are logged at DEBUG).
WARN_EVERY = 3600

# Event kinds (the first item of each queued tuple).
_ACQUIRE, _RELEASE, _LOST, _REJECTION, _TASK_CONFLICT = range(5)
#: Results that mean the caller met another holder (besides having to wait and retry).
_CONTENDED = frozenset({series.BUSY, series.TIMEOUT})


def prefix_of(name):
    """Return the part of a lock name before the first ':' (the whole name if none)."""
    return name.split(":", 1)[0]


class Recorder:
    """Collect this process's lock events and add them to the shared store in batches.

    Fork-safe: a child process starts with an empty queue and its own thread, so nothing is counted
    twice. ``clock`` (wall time, for the per-minute periods) is injectable for tests.
    """

    def __init__(self, *, clock=time.time):
        self._clock = clock
        self._events = deque()
        self._pending = Counter()
        self._prefixes = set()
        self._lock = threading.Lock()        # guards _pending and _prefixes
        self._flush_lock = threading.Lock()  # one flush at a time: the thread's or an explicit one
        self._thread = None
        self._stopped = threading.Event()
        self._last_fold = None
        self._failures = 0
        self._last_warning = None
        self_ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (r := self_ref()) and r._forget_after_fork())

    # -- the hot path: one deque.append per event ----------------------------------------------

    def _queue(self, event):
        self._events.append(event)
        if self._thread is None:
            self._start()

    def record_acquire(self, alias, name, ttl, waited, result, lease=None):
        if conf.get().enabled:
            attempts = getattr(lease, "attempts", 1)
            self._queue((_ACQUIRE, self._clock(), alias, name, ttl, waited, result, attempts))

    def record_release(self, lease):
        if conf.get().enabled:
            self._queue((_RELEASE, self._clock(), lease.alias, lease.name, lease.ttl, lease.held_for))

    def record_lost(self, lease):
        if conf.get().enabled:
            self._queue((_LOST, self._clock(), lease.alias, lease.name))

    def record_rejection(self, alias, name=""):
        if conf.get().enabled:
            self._queue((_REJECTION, self._clock(), alias, name))

    def record_task_conflict(self, alias, name, outcome):
        if conf.get().enabled:
            self._queue((_TASK_CONFLICT, self._clock(), alias, name, outcome))

    # -- folding (in the thread, or before a read) -----------------------------------------------

    def drain(self):
        """Fold every queued event into the pending per-minute counts and the Prometheus instruments."""
        events = self._events
        with self._lock:
            if not events:
                return
            max_prefixes = conf.get().max_prefixes
            prefixes = self._prefixes
            # Events alike (same kind, minute, alias, prefix, outcome and buckets) are counted together
            # first, with one dict update each; the series and instruments are updated once per group.
            alike, seconds_sums = {}, {}
            while True:
                try:
                    event = events.popleft()
                except IndexError:
                    break
                kind, at, alias, name = event[:4]
                if kind == _REJECTION:
                    # Counted for Prometheus only: the store's figures count FencingRejection rows,
                    # the durable log that also names the rows and tokens involved.
                    prometheus.count_rejection(alias)
                    continue
                prefix = prefix_of(name)
                if prefix not in prefixes:
                    if len(prefixes) < max_prefixes:
                        prefixes.add(prefix)
                    else:
                        prefix = OTHER_PREFIX
                period = int(at // PERIOD) * PERIOD
                if kind == _ACQUIRE:
                    ttl, waited, result, attempts = event[4:]
                    key = (kind, period, alias, prefix, result, result in _CONTENDED or attempts > 1,
                           bisect_left(series.SECONDS_BOUNDS, waited),
                           bisect_left(series.TTL_FRACTION_BOUNDS, waited / ttl))
                    total = (kind, alias, result)
                    seconds_sums[total] = seconds_sums.get(total, 0.0) + waited
                elif kind == _RELEASE:
                    ttl, held = event[4:]
                    key = (kind, period, alias, prefix, bisect_left(series.SECONDS_BOUNDS, held),
                           bisect_left(series.TTL_FRACTION_BOUNDS, held / ttl))
                    total = (kind, alias)
                    seconds_sums[total] = seconds_sums.get(total, 0.0) + held
                else:
                    key = (kind, period, alias, prefix, *event[4:])
                alike[key] = alike.get(key, 0) + 1
            self._count(alike, seconds_sums)

    def _count(self, alike, seconds_sums):
        pending = self._pending
        acquire_buckets, hold_buckets = defaultdict(Counter), defaultdict(Counter)
        for (kind, period, alias, prefix, *details), count in alike.items():
            where = (period, alias, prefix)
            if kind == _ACQUIRE:
                result, contended, seconds_bucket, fraction_bucket = details
                pending[(*where, series.ATTEMPTS, 0)] += count
                pending[(*where, result, 0)] += count
                if contended:
                    pending[(*where, series.CONTENDED, 0)] += count
                if result == series.ACQUIRED:
                    pending[(*where, series.ACQUIRE_SECONDS, seconds_bucket)] += count
                    pending[(*where, series.ACQUIRE_OF_TTL, fraction_bucket)] += count
                acquire_buckets[(alias, result)][seconds_bucket] += count
            elif kind == _RELEASE:
                seconds_bucket, fraction_bucket = details
                pending[(*where, series.RELEASED, 0)] += count
                pending[(*where, series.HOLD_SECONDS, seconds_bucket)] += count
                pending[(*where, series.HOLD_OF_TTL, fraction_bucket)] += count
                hold_buckets[alias][seconds_bucket] += count
            elif kind == _LOST:
                pending[(*where, series.LOST, 0)] += count
                prometheus.count_lost(alias, count)
            else:
                outcome = details[0]
                bucket = series.TASK_OUTCOMES.index(outcome) if outcome in series.TASK_OUTCOMES else 0
                pending[(*where, series.TASK_CONFLICT, bucket)] += count
                prometheus.count_task_conflict(alias, outcome, count)
        for (alias, result), buckets in acquire_buckets.items():
            prometheus.observe_acquisitions(alias, result, buckets, seconds_sums[(_ACQUIRE, alias, result)])
        for alias, buckets in hold_buckets.items():
            prometheus.observe_holds(alias, buckets, seconds_sums[(_RELEASE, alias)])

    def pending(self):
        """Return a copy of the counts not yet in the store: ``{(period_start, alias, prefix, series, bucket): n}``."""
        self.drain()
        with self._lock:
            return dict(self._pending)

    # -- flushing ---------------------------------------------------------------------------------

    def flush(self):
        """Add this process's pending counts to the shared store now; return how many rows it wrote.

        On failure the counts stay pending for the next flush and the error propagates.
        """
        with self._flush_lock:
            return self._flush_locked()

    def _flush_locked(self):
        # Imported here: the store needs the models, and this module is imported before apps are ready.
        from distlock.metrics import store  # noqa: PLC0415

        self.drain()
        with self._lock:
            rows, self._pending = self._pending, Counter()
        if not rows:
            return 0  # a process that records nothing never touches the database
        settings = conf.get()
        try:
            store.add(rows, using=settings.database)
        except BaseException:
            with self._lock:
                self._pending.update(rows)
            raise
        if self._last_fold is None or time.monotonic() - self._last_fold >= FOLD_INTERVAL:
            store.fold(before=self._clock() - settings.history, using=settings.database)
            self._last_fold = time.monotonic()
        return len(rows)

    def _flush_logging_errors(self, *, wait=None, level=logging.WARNING):
        """Flush from the thread or at exit, where nobody could handle an error: log it instead.

        Warns once ``WARN_AFTER_FAILURES`` flushes in a row have failed, then at most every
        ``WARN_EVERY`` seconds: a database outage must show in the log, but not fill it.
        """
        if not self._flush_lock.acquire(timeout=-1 if wait is None else wait):
            logger.log(level, "Lock metrics not flushed: another flush was still running after %ss.", wait)
            return
        try:
            self._flush_locked()
            self._failures = 0
        except Exception:
            self._failures += 1
            if level == logging.WARNING:
                now = time.monotonic()
                if self._failures < WARN_AFTER_FAILURES or (
                        self._last_warning is not None and now - self._last_warning < WARN_EVERY):
                    level = logging.DEBUG
                else:
                    self._last_warning = now
            logger.log(level, "Could not add lock metrics to the store (database %r, %d failure(s) in a row); "
                       "keeping them and retrying every flush. Run `manage.py migrate distlock` if the table "
                       "is missing.", conf.get().database, self._failures, exc_info=True)
        finally:
            self._flush_lock.release()

    def _start(self):
        with self._lock:
            if self._thread is not None:
                return
            self._stopped = threading.Event()
            self._thread = threading.Thread(target=self._run, name="distlock-metrics", daemon=True)
        # Flush at exit: atexit for ordinary interpreters, multiprocessing's finalizers for its forked
        # children, which leave through os._exit() and skip atexit. The second call finds nothing left.
        atexit.register(self._flush_at_exit)
        multiprocessing.util.Finalize(None, self._flush_at_exit, exitpriority=0)
        self._thread.start()

    def _run(self):
        next_flush = time.monotonic() + conf.get().flush_interval
        while not self._stopped.wait(max(0.0, min(DRAIN_INTERVAL, next_flush - time.monotonic()))):
            if time.monotonic() < next_flush:
                self.drain()
                continue
            self._flush_logging_errors()
            # Do not keep a connection open between flushes (it would block dropping a test database).
            connections.close_all()
            next_flush = time.monotonic() + conf.get().flush_interval

    def _flush_at_exit(self):
        self._stopped.set()
        if self._thread is not None:
            # INFO, not WARNING: at exit the logging streams may be closed already, and a missing table
            # has been reported by the periodic flushes of any process that lived FLUSH_INTERVAL.
            self._flush_logging_errors(wait=EXIT_FLUSH_WAIT, level=logging.INFO)

    def _forget_after_fork(self):
        # The parent flushes its own counts; a lock held by one of its threads during fork() would
        # never be released here.
        self._events = deque()
        self._pending = Counter()
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._thread = None
        self._last_fold = None
