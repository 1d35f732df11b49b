"""Figures for operators, summed over every process: what the admin page and ``distlock stats`` show.

The alert thresholds below are those of the "Held locks" page; the two "of TTL" ones compare each
acquisition or hold with that lease's own ttl (histograms of the fraction), not with an average.
"""

import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime

from django.conf import settings as django_settings
from django.db.models import Count, Sum
from django.utils import timezone

from distlock.metrics import conf, series
from distlock.metrics.recorder import OTHER_PREFIX, PERIOD, prefix_of
from distlock.models import FencingRejection, MetricSample

__all__ = [
    "ACQUIRE_P99_OF_TTL",
    "ALL_PREFIXES",
    "CONTENTION_RATE",
    "FENCING_REJECTIONS",
    "Figures",
    "HOLD_P99_OF_TTL",
    "TIMEOUT_RATE",
    "Window",
    "summarize",
    "timeline",
]

#: Alert when the p99 time to acquire exceeds this fraction of the acquisition's ttl.
ACQUIRE_P99_OF_TTL = 0.5
#: Alert when more than this fraction of attempts had to wait or did not get the lock.
CONTENTION_RATE = 0.3
#: Alert when the p99 hold time exceeds this fraction of the lease's ttl.
HOLD_P99_OF_TTL = 0.8
#: Alert when more than this fraction of attempts timed out.
TIMEOUT_RATE = 0.05
#: Alert on any fencing rejection: two holders acted at once.
FENCING_REJECTIONS = 0

#: The ``prefix`` of a row that sums every prefix of its alias.
ALL_PREFIXES = ""


@dataclass
class Figures:
    """The metrics of one alias (and one lock-name prefix, or all of them) over one window."""

    alias: str
    prefix: str = ALL_PREFIXES
    counts: Counter = field(default_factory=Counter)
    #: series -> bucket counts, as long as the series' bounds plus the +Inf bucket.
    histograms: dict = field(default_factory=dict)
    fencing_rejections: int = 0

    def add(self, other):
        self.counts.update(other.counts)
        for name, buckets in other.histograms.items():
            mine = self._histogram(name)
            for index, count in enumerate(buckets):
                mine[index] += count
        self.fencing_rejections += other.fencing_rejections

    def _histogram(self, name):
        if name not in self.histograms:
            self.histograms[name] = [0] * _bucket_count(name)
        return self.histograms[name]

    def _quantile(self, name, q):
        return series.quantile(series.HISTOGRAMS[name], self.histograms.get(name, ()), q)

    def _rate(self, numerator):
        attempts = self.counts[series.ATTEMPTS]
        return self.counts[numerator] / attempts if attempts else None

    @property
    def attempts(self):
        return self.counts[series.ATTEMPTS]

    @property
    def acquired(self):
        return self.counts[series.ACQUIRED]

    @property
    def acquire_p50(self):
        """Seconds acquire() took, median, over acquired locks."""
        return self._quantile(series.ACQUIRE_SECONDS, 0.5)

    @property
    def acquire_p99(self):
        return self._quantile(series.ACQUIRE_SECONDS, 0.99)

    @property
    def acquire_p99_of_ttl(self):
        """p99 of each acquisition's time as a fraction of its own ttl."""
        return self._quantile(series.ACQUIRE_OF_TTL, 0.99)

    @property
    def hold_p99(self):
        return self._quantile(series.HOLD_SECONDS, 0.99)

    @property
    def hold_p99_of_ttl(self):
        return self._quantile(series.HOLD_OF_TTL, 0.99)

    @property
    def contention_rate(self):
        """Attempts that waited for another holder or did not get the lock, per attempt."""
        return self._rate(series.CONTENDED)

    @property
    def timeout_rate(self):
        return self._rate(series.TIMEOUT)

    @property
    def fencing_rejection_rate(self):
        """Fencing rejections per acquired lock."""
        acquired = self.counts[series.ACQUIRED]
        return self.fencing_rejections / acquired if acquired else None

    @property
    def task_conflicts(self):
        """Celery runs that found their key held: {outcome: count}."""
        buckets = self.histograms.get(series.TASK_CONFLICT, ())
        return {outcome: count for outcome, count in zip(series.TASK_OUTCOMES, buckets, strict=False) if count}

    @property
    def alerts(self):
        """Return the set of figure names past their threshold."""
        checks = {
            "acquire_p99_of_ttl": (self.acquire_p99_of_ttl, ACQUIRE_P99_OF_TTL),
            "contention_rate": (self.contention_rate, CONTENTION_RATE),
            "hold_p99_of_ttl": (self.hold_p99_of_ttl, HOLD_P99_OF_TTL),
            "timeout_rate": (self.timeout_rate, TIMEOUT_RATE),
            "fencing_rejections": (self.fencing_rejections, FENCING_REJECTIONS),
        }
        return {name for name, (value, threshold) in checks.items() if value is not None and value > threshold}

    def as_dict(self):
        """Return the figures as plain data (``distlock stats --json``)."""
        return {
            "alias": self.alias, "prefix": self.prefix or None, "attempts": self.attempts,
            "acquired": self.acquired, "busy": self.counts[series.BUSY], "timeouts": self.counts[series.TIMEOUT],
            "unavailable": self.counts[series.UNAVAILABLE], "released": self.counts[series.RELEASED],
            "lost": self.counts[series.LOST], "acquire_p50_seconds": self.acquire_p50,
            "acquire_p99_seconds": self.acquire_p99, "acquire_p99_of_ttl": self.acquire_p99_of_ttl,
            "hold_p99_seconds": self.hold_p99, "hold_p99_of_ttl": self.hold_p99_of_ttl,
            "contention_rate": self.contention_rate, "timeout_rate": self.timeout_rate,
            "fencing_rejections": self.fencing_rejections, "fencing_rejection_rate": self.fencing_rejection_rate,
            "task_conflicts": self.task_conflicts, "alerts": sorted(self.alerts),
        }


@dataclass
class Window:
    """The figures of every alias over one window: ``since`` is a Unix time, or None for since start."""

    since: float | None
    #: One total per alias (prefix ``ALL_PREFIXES``), each followed by its prefixes, busiest first.
    rows: list


def _bucket_count(name):
    """Return how many buckets series ``name`` has: its bounds plus +Inf, or one per task outcome."""
    if name == series.TASK_CONFLICT:
        return len(series.TASK_OUTCOMES)
    return len(series.HISTOGRAMS[name]) + 1


def _window_start(seconds, now):
    # Whole minutes: the partial current minute plus the full ones that fit in the window.
    return None if seconds is None else int((now - seconds) // PERIOD) * PERIOD


def summarize(window=None, *, alias=None, prefix=None, now=None):
    """Return the ``Window`` of the last ``window`` seconds (None: since start), every process included."""
    settings = conf.get()
    now = time.time() if now is None else now
    since = _window_start(window, now)
    samples = MetricSample.objects.using(settings.database)
    if since is not None:
        samples = samples.filter(period_start__gte=since)
    if alias is not None:
        samples = samples.filter(alias=alias)
    if prefix is not None:
        samples = samples.filter(prefix=prefix)
    per_prefix = defaultdict(dict)  # alias -> prefix -> Figures
    for row in samples.values("alias", "prefix", "series", "bucket").annotate(total=Sum("count")):
        figures = per_prefix[row["alias"]].setdefault(row["prefix"], Figures(row["alias"], row["prefix"]))
        if row["series"] in series.HISTOGRAMS or row["series"] == series.TASK_CONFLICT:
            figures._histogram(row["series"])[row["bucket"]] += row["total"]
        else:
            figures.counts[row["series"]] += row["total"]
    for (rejected_alias, lock_name), count in _rejections(since, alias):
        rejected_prefix = prefix_of(lock_name) if lock_name else OTHER_PREFIX
        if prefix is not None and rejected_prefix != prefix:
            continue
        per_prefix[rejected_alias].setdefault(rejected_prefix, Figures(rejected_alias, rejected_prefix)) \
            .fencing_rejections += count
    rows = []
    for name in sorted(per_prefix):
        total = Figures(name)
        kept = _cap(per_prefix[name], settings.max_prefixes)
        for figures in kept:
            total.add(figures)
        rows.append(total)
        rows.extend(kept)
    return Window(since=since, rows=rows)


def _rejections(since, alias):
    rejections = FencingRejection.objects.all()
    if since is not None:
        since_at = datetime.fromtimestamp(since, tz=UTC)
        # Without USE_TZ the column holds naive local times, and SQLite refuses an aware value.
        rejections = rejections.filter(created_at__gte=since_at if django_settings.USE_TZ
                                       else timezone.make_naive(since_at))
    if alias is not None:
        rejections = rejections.filter(alias=alias)
    return [((row["alias"], row["lock_name"]), row["n"])
            for row in rejections.values("alias", "lock_name").annotate(n=Count("id"))]


def _cap(by_prefix, limit):
    """Return the ``limit`` busiest prefixes, then the rest summed as ``other``.

    Each process caps the prefixes it tracks, but different processes may track different ones.
    """
    ordered = sorted(by_prefix.values(), key=lambda f: (-f.attempts, -f.fencing_rejections, f.prefix))
    named = [figures for figures in ordered if figures.prefix != OTHER_PREFIX]
    rest = [figures for figures in ordered if figures.prefix == OTHER_PREFIX] + named[limit:]
    if not rest:
        return named
    other = Figures(rest[0].alias, OTHER_PREFIX)
    for figures in rest:
        other.add(figures)
    return [*named[:limit], other]


def timeline(minutes=60, *, alias=None, now=None):
    """Return ``[(period_start, attempts, contended)]`` for each of the last ``minutes`` minutes."""
    now = time.time() if now is None else now
    last = int(now // PERIOD) * PERIOD
    first = last - (minutes - 1) * PERIOD
    samples = MetricSample.objects.using(conf.get().database).filter(
        period_start__gte=first, series__in=[series.ATTEMPTS, series.CONTENDED])
    if alias is not None:
        samples = samples.filter(alias=alias)
    totals = defaultdict(Counter)
    for row in samples.values("period_start", "series").annotate(total=Sum("count")):
        totals[row["period_start"]][row["series"]] += row["total"]
    return [(start, totals[start][series.ATTEMPTS], totals[start][series.CONTENDED])
            for start in range(first, last + 1, PERIOD)]

