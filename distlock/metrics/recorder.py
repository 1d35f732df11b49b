"""The per-process recorder: events buffered on the hot path, folded and flushed by a daemon thread.

Recording an acquisition or a release tests one flag (``ENABLED``, read again after
``setting_changed``) and adds the event's fields to a list with one ``list.extend``, atomic in
CPython: no lock, no I/O, no clock read, no bucketing. Every ``DRAIN_INTERVAL`` the thread takes the
buffered events and folds them: events alike (same alias, name, result, attempts and ttl) are
grouped, each group's durations are bucketed at once with a few C-level passes, and the counts go
to per-minute counts keyed ``(period_start, alias, prefix, series, bucket)``, in the minute of the
fold, and to the Prometheus instruments. Every ``FLUSH_INTERVAL`` seconds, and at exit, the thread
adds the counts to the shared store. Counts that fail to reach the store stay pending for the next
flush.
"""

import atexit
import logging
import multiprocessing.util
import threading
import time
from bisect import bisect_left, bisect_right
from collections import Counter, defaultdict
from itertools import repeat
from math import fsum
from operator import truediv

from django.core.signals import setting_changed
from django.db import connections

from distlock.backends.green import Daemon, ForkedChildHook
from distlock.conf import SHARED_MEMORY, sqlite_memory
from distlock.metrics import conf, prometheus, series

__all__ = [
    "DRAIN_INTERVAL",
    "EXIT_FLUSH_WAIT",
    "FOLD_INTERVAL",
    "OTHER_PREFIX",
    "PERIOD",
    "Recorder",
    "WARN_AFTER_FAILURES",
    "WARN_EVERY",
    "prefix_of",
]

logger = logging.getLogger(__name__)

#: Names that share the part before the first ':' are counted together; names past the cap as this.
OTHER_PREFIX = "other"
#: Seconds between two folds of the buffered events (the Prometheus figures lag by at most this).
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

#: Fields an acquisition adds to its buffer: alias, name, result, attempts, ttl, seconds it took.
_ACQUISITION_FIELDS = 6
#: Fields a release adds to its buffer: alias, name, ttl, seconds the lease was held.
_RELEASE_FIELDS = 4
# Kinds of the rarer events, buffered as one tuple each: (kind, alias, name, *details).
_LOST, _REJECTION, _TASK_CONFLICT = range(3)
#: Results that mean the caller met another holder (besides having to wait and retry).
_CONTENDED = frozenset({series.BUSY, series.TIMEOUT})


def prefix_of(name):
    """Return the part of a lock name before the first ':' (the whole name if none)."""
    return name.split(":", 1)[0]


def _take(buffer):
    """Remove and return the items in ``buffer`` now; items other threads add meanwhile stay for next time.

    A copy and a ``del`` of that many items from the front: appends only ever go to the end, so none
    is lost between the two, and each of them is atomic in CPython.
    """
    taken = buffer[:]
    del buffer[:len(taken)]
    return taken


def _take_grouped(buffer, fields):
    """Remove the events in ``buffer`` now, ``fields`` items each, and return them grouped by all but the last.

    Returns ``{first fields: [last field of each such event]}``. Taken as ``_take()`` does, by
    slicing each field's column straight out of the buffer. When the events are all alike (a busy
    process hammering one lock) a C-level ``list.count`` per field finds it and nothing is hashed
    per event; otherwise each event costs one dict update.
    """
    end = len(buffer)
    columns = [buffer[index:end:fields] for index in range(fields - 1)]
    durations = buffer[fields - 1:end:fields]
    del buffer[:end]
    if all(column.count(column[0]) == len(column) for column in columns):
        return {tuple(column[0] for column in columns): durations}
    groups = defaultdict(list)
    for key, duration in zip(zip(*columns), durations):
        groups[key].append(duration)
    return groups


def _histograms(durations, ttl):
    """Return ``{bucket: count}`` of ``durations`` in seconds, and as fractions of ``ttl``.

    The same counts as ``series.bucket_of`` for each duration, found with a few C-level passes.
    """
    low, high = min(durations), max(durations)
    return (_bucket_counts(series.SECONDS_BOUNDS, durations, low, high),
            _bucket_counts(series.TTL_FRACTION_BOUNDS, durations, low, high, per=ttl))


def _bucket_counts(bounds, durations, low, high, per=1):
    # ``low`` and ``high``: the least and the greatest of ``durations``; counted are ``duration / per``.
    first, last = bisect_left(bounds, low / per), bisect_left(bounds, high / per)
    if first == last:
        return {first: len(durations)}
    # One group's durations mostly share its lowest bucket (a few outliers: a GC pause, a thread
    # switch): count that bucket with one pass, and sort only the rest. Those up to bucket ``index``
    # are the ones <= bounds[index] (``le`` semantics).
    values = durations if per == 1 else list(map(truediv, durations, repeat(per)))
    above = sorted(filter(bounds[first].__lt__, values))
    counts, below = {first: len(values) - len(above)}, 0
    for index in range(first + 1, last):
        upto = bisect_right(above, bounds[index])
        if upto > below:
            counts[index], below = upto - below, upto
    counts[last] = len(above) - below
    return counts


def _folded(rows, *, before):
    """Return ``rows`` with the minutes starting before ``before`` moved into period 0, as the store folds.

    While the store is down the pending counts keep at most ``HISTORY`` worth of minutes, plus the
    since-start totals, instead of growing with every minute of the outage.
    """
    folded = Counter()
    for (period, *rest), count in rows.items():
        folded[(0 if 0 < period < before else period, *rest)] += count
    return folded


#: Every recorder: a forked child forgets its parent's pending events and thread.
_RECORDERS = ForkedChildHook("_forget_after_fork")


class Recorder:
    """Collect this process's lock events and add them to the shared store in batches.

    Thread-safe without a lock on the hot path, and fork-safe: a child process starts with empty
    buffers and its own thread, so nothing is counted twice. ``clock`` (wall time, for the per-minute
    periods) is injectable for tests.
    """

    def __init__(self, *, clock=time.time):
        self._clock = clock
        self._acquisitions = []
        self._releases = []
        self._events = []
        # True or False once DISTLOCK_METRICS['ENABLED'] is read; None: read it at the next event.
        self._recording = None
        self._pending = Counter()
        self._prefixes = set()
        self._lock = threading.Lock()        # guards the folds, _pending and _prefixes
        self._flush_lock = threading.Lock()  # one flush at a time: the thread's or an explicit one
        self._thread = None
        self._stopped = threading.Event()
        self._last_fold = None
        self._failures = 0
        self._last_warning = None
        _RECORDERS.add(self)
        setting_changed.connect(self._setting_changed)  # weakly: a recorder of a test may go away

    # -- the hot path: a flag test and one list.extend or append per event ------------------------

    def record_acquire(self, alias, name, ttl, waited, result, lease=None):
        """Count one ``acquire()`` call; ``result`` is acquired, busy, timeout or unavailable."""
        if self._recording or self._recording is None and self._start_recording():
            self._acquisitions.extend((alias, name, result, 1 if lease is None else lease.attempts, ttl, waited))

    def record_release(self, lease):
        """Count a release and how long ``lease`` was held."""
        if self._recording or self._recording is None and self._start_recording():
            self._releases.extend((lease.alias, lease.name, lease.ttl, lease.held_for))

    def record_lost(self, lease):
        """Count a lease found lost."""
        if self._recording or self._recording is None and self._start_recording():
            self._events.append((_LOST, lease.alias, lease.name))

    def record_rejection(self, alias, name=""):
        """Count a fenced write refused for a stale token of lock ``name`` on ``alias``."""
        if self._recording or self._recording is None and self._start_recording():
            self._events.append((_REJECTION, alias, name))

    def record_task_conflict(self, alias, name, outcome):
        """Count a Celery run whose key ``name`` was held; ``outcome`` is skip, retry, fail or refused."""
        if self._recording or self._recording is None and self._start_recording():
            self._events.append((_TASK_CONFLICT, alias, name, outcome))

    def _start_recording(self):
        """Read ``ENABLED`` (first event, or first after a settings change or a fork); start the thread if on.

        Never raises into the caller, who may hold a lock just granted: if the settings are invalid or
        the thread cannot start, log it once and record nothing until the settings change.
        """
        try:
            recording = conf.get().enabled
            if recording and self._thread is None:
                self._start()
        except Exception:
            logger.error("Lock metrics are off in this process until settings.DISTLOCK_METRICS changes: "
                         "recording could not start (`manage.py check` reports a bad setting).", exc_info=True)
            recording = False
        self._recording = recording
        return recording

    def _setting_changed(self, *, setting, **kwargs):
        if setting == "DISTLOCK_METRICS":
            self._recording = None

    # -- folding (in the thread, or before a read) -----------------------------------------------

    def drain(self):
        """Fold every buffered event into the pending per-minute counts and the Prometheus instruments."""
        with self._lock:
            if not (self._acquisitions or self._releases or self._events):
                return
            # The minute is the fold's, not the event's: reading the clock per event would cost more
            # than the rest of recording. An event is at most DRAIN_INTERVAL old when folded (more only
            # while a slow flush holds the thread up), so it may count in the next minute, never twice.
            period = int(self._clock() // PERIOD) * PERIOD
            prefix = self._capped_prefix_of(conf.get().max_prefixes)
            if self._acquisitions:
                self._count_acquisitions(period, prefix, _take_grouped(self._acquisitions, _ACQUISITION_FIELDS))
            if self._releases:
                self._count_releases(period, prefix, _take_grouped(self._releases, _RELEASE_FIELDS))
            if self._events:
                self._count_events(period, prefix, _take(self._events))

    def _capped_prefix_of(self, max_prefixes):
        """Return ``name -> prefix``, keeping this process's first ``max_prefixes`` prefixes; the rest are other."""
        prefixes = self._prefixes

        def prefix(name):
            found = prefix_of(name)
            if found not in prefixes:
                if len(prefixes) >= max_prefixes:
                    return OTHER_PREFIX
                prefixes.add(found)
            return found

        return prefix

    def _count_acquisitions(self, period, prefix, groups):
        pending = self._pending
        buckets, seconds = defaultdict(Counter), defaultdict(float)  # per (alias, result), for Prometheus
        for (alias, name, result, attempts, ttl), durations in groups.items():
            where = (period, alias, prefix(name))
            count = len(durations)
            pending[(*where, series.ATTEMPTS, 0)] += count
            pending[(*where, result, 0)] += count
            if result in _CONTENDED or attempts > 1:
                pending[(*where, series.CONTENDED, 0)] += count
            in_seconds, of_ttl = _histograms(durations, ttl)
            if result == series.ACQUIRED:
                for bucket, in_bucket in in_seconds.items():
                    pending[(*where, series.ACQUIRE_SECONDS, bucket)] += in_bucket
                for bucket, in_bucket in of_ttl.items():
                    pending[(*where, series.ACQUIRE_OF_TTL, bucket)] += in_bucket
            buckets[alias, result].update(in_seconds)
            seconds[alias, result] += fsum(durations)
        for (alias, result), bucket_counts in buckets.items():
            prometheus.observe_acquisitions(alias, result, bucket_counts, seconds[alias, result])

    def _count_releases(self, period, prefix, groups):
        pending = self._pending
        buckets, seconds = defaultdict(Counter), defaultdict(float)  # per alias, for Prometheus
        for (alias, name, ttl), durations in groups.items():
            where = (period, alias, prefix(name))
            pending[(*where, series.RELEASED, 0)] += len(durations)
            in_seconds, of_ttl = _histograms(durations, ttl)
            for bucket, in_bucket in in_seconds.items():
                pending[(*where, series.HOLD_SECONDS, bucket)] += in_bucket
            for bucket, in_bucket in of_ttl.items():
                pending[(*where, series.HOLD_OF_TTL, bucket)] += in_bucket
            buckets[alias].update(in_seconds)
            seconds[alias] += fsum(durations)
        for alias, bucket_counts in buckets.items():
            prometheus.observe_holds(alias, bucket_counts, seconds[alias])

    def _count_events(self, period, prefix, events):
        pending = self._pending
        for kind, alias, name, *details in events:
            if kind == _REJECTION:
                # Counted for Prometheus only: the store's figures count FencingRejection rows,
                # the durable log that also names the rows and tokens involved.
                prometheus.count_rejection(alias)
            elif kind == _LOST:
                pending[(period, alias, prefix(name), series.LOST, 0)] += 1
                prometheus.count_lost(alias)
            else:
                outcome = details[0]
                bucket = series.TASK_OUTCOMES.index(outcome) if outcome in series.TASK_OUTCOMES else 0
                pending[(period, alias, prefix(name), series.TASK_CONFLICT, bucket)] += 1
                prometheus.count_task_conflict(alias, outcome)

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
        # Imported here: the store needs MetricSample, and this module is imported with the package, before
        # Django has loaded the apps (tests/test_architecture.py checks that no model comes in that way).
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
                self._pending.update(_folded(rows, before=self._clock() - settings.history))
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
        flush_lock = self._flush_lock  # the one released below, even if a fork replaced it meanwhile
        if not flush_lock.acquire(timeout=-1 if wait is None else wait):
            logger.log(level, "Lock metrics not flushed: another flush was still running after %ss.", wait)
            return
        try:
            self._flush_locked()
            self._failures = 0
        except Exception:
            self._failures += 1
            if level == logging.WARNING:
                level = logging.DEBUG if self._failures < WARN_AFTER_FAILURES else self._warning_level()
            logger.log(level, "Could not add lock metrics to the store (database %r, %d failure(s) in a row); "
                       "keeping them and retrying every flush. Run `manage.py migrate distlock` if the table "
                       "is missing.", conf.get().database, self._failures, exc_info=True)
        finally:
            flush_lock.release()

    def _start(self):
        with self._lock:
            if self._thread is not None:
                return
            self._stopped = threading.Event()
            self._thread = Daemon(self._run, name="distlock-metrics")
        # Flush at exit: atexit for ordinary interpreters, multiprocessing's finalizers for its forked
        # children, which leave through os._exit() and skip atexit. The second call finds nothing left.
        atexit.register(self._flush_at_exit)
        multiprocessing.util.Finalize(None, self._flush_at_exit, exitpriority=0)
        self._thread.start()

    def _run(self):
        next_flush = None  # set by the first tick that can read the settings
        while not self._stopped.wait(DRAIN_INTERVAL if next_flush is None
                                     else max(0.0, min(DRAIN_INTERVAL, next_flush - time.monotonic()))):
            try:
                next_flush = self._tick(next_flush)
            except Exception:  # noqa: BLE001 - the thread must outlive it, see below
                # Settings that cannot be read (a router naming no database, which `manage.py check`
                # reports as distlock.E006) must not end the thread: the events stay buffered, and are
                # folded and flushed once the settings are readable again.
                logger.log(self._warning_level(), "Lock metrics could not be folded or flushed; keeping them and "
                           "retrying every second (`manage.py check` reports a bad setting).", exc_info=True)

    def _tick(self, next_flush):
        """Fold, and flush once ``next_flush`` (monotonic; None: not known yet) has come; return the next one."""
        settings = conf.get()
        if next_flush is None:
            next_flush = time.monotonic() + settings.flush_interval
        if time.monotonic() < next_flush or sqlite_memory(settings.database) == SHARED_MEMORY:
            # On Django's in-memory SQLite test database a flush from this thread would make the
            # tests' own writes fail ("database table is locked"): only an explicit flush() writes.
            self.drain()
            return next_flush
        self._flush_logging_errors()
        # Do not keep a connection open between flushes (it would block dropping a test database).
        connections.close_all()
        return time.monotonic() + conf.get().flush_interval

    def _warning_level(self):
        """Return WARNING at most every ``WARN_EVERY`` seconds (a failure must show, but not fill the log), else DEBUG."""
        now = time.monotonic()
        if self._last_warning is not None and now - self._last_warning < WARN_EVERY:
            return logging.DEBUG
        self._last_warning = now
        return logging.WARNING

    def _flush_at_exit(self):
        self._stopped.set()
        if self._thread is not None:
            # INFO, not WARNING: at exit the logging streams may be closed already, and a missing table
            # has been reported by the periodic flushes of any process that lived FLUSH_INTERVAL.
            self._flush_logging_errors(wait=EXIT_FLUSH_WAIT, level=logging.INFO)

    def _forget_after_fork(self):
        # The parent flushes its own counts; a lock held by one of its threads during fork() would
        # never be released here. The next event reads ENABLED again and starts this process's thread.
        # Under gevent the parent's greenlet runs on here: it is ended.
        if self._thread is not None:
            self._stopped.set()
            self._thread.end_in_child()
        self._acquisitions, self._releases, self._events = [], [], []
        self._recording = None
        self._pending = Counter()
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._thread = None
        self._last_fold = None
