"""Prometheus instruments, fed by the recorder's thread, and the text the ``metrics`` view serves.

Metrics are per process, as Prometheus expects. Under gunicorn or Celery prefork, set
``PROMETHEUS_MULTIPROC_DIR`` before ``prometheus_client`` is imported: every process then writes its
values to that directory and ``exposition()`` sums them (``prometheus_client`` multiprocess mode).
``prometheus_client`` is optional (``django-distlock[prometheus]``); without it nothing is observed.
"""

import os
import threading

from django.core.exceptions import ImproperlyConfigured

from distlock.metrics import series

__all__ = [
    "count_lost",
    "count_rejection",
    "count_task_conflict",
    "count_token_regression",
    "exposition",
    "instruments",
    "observe_acquisitions",
    "observe_holds",
]

try:
    import prometheus_client
    from prometheus_client import multiprocess
except ImportError:  # the optional extra is not installed
    prometheus_client = None

_instruments = None
_instruments_lock = threading.Lock()
_children = {}


class _Instruments:
    """The distlock metrics, registered once per process in the default registry."""

    def __init__(self):
        self.acquire_seconds = prometheus_client.Histogram(
            "distlock_acquire_seconds", "Time acquire() took, by alias and result.", ["alias", "result"],
            buckets=series.SECONDS_BOUNDS)
        self.acquisitions = prometheus_client.Counter(
            "distlock_acquisitions", "Calls of acquire(), by alias and result "
            "(acquired, busy, timeout, unavailable).", ["alias", "result"])
        self.hold_seconds = prometheus_client.Histogram(
            "distlock_hold_seconds", "Time from acquisition to release, by alias.", ["alias"],
            buckets=series.SECONDS_BOUNDS)
        self.fencing_rejections = prometheus_client.Counter(
            "distlock_fencing_rejections", "Fenced writes refused for a stale token: two holders acted "
            "at once. Alert on any increase.", ["alias"])
        self.lock_lost = prometheus_client.Counter(
            "distlock_lock_lost", "Leases found lost (failed renewal, expired session, max_hold).", ["alias"])
        self.token_regressions = prometheus_client.Counter(
            "distlock_token_regressions", "Aliases whose server went back (restored, wiped, clock stepped back) "
            "as a process saw it: from then on it refuses their grants and fenced writes. Alert on any increase.",
            ["alias"])
        self.task_conflicts = prometheus_client.Counter(
            "distlock_task_conflicts", "Celery runs that found their lock key held, by outcome.",
            ["alias", "outcome"])


def instruments():
    """Return the instruments, creating them on first use; None without ``prometheus_client``."""
    global _instruments  # noqa: PLW0603 - created once per process
    if prometheus_client is None:
        return None
    if _instruments is None:
        with _instruments_lock:
            if _instruments is None:
                _instruments = _Instruments()
    return _instruments


def _child(metric, *labels):
    # labels() takes a lock and builds a key each call; the children never change, so keep them.
    key = (metric, labels)
    child = _children.get(key)
    if child is None:
        child = _children[key] = getattr(_instruments, metric).labels(*labels)
    return child


def _observe_many(histogram, bucket_counts, total):
    """Add ``{bucket index: count}`` observations summing to ``total`` to a histogram child at once.

    What ``observe()`` does per value, for many values (same bucket bounds, ``le`` semantics); it
    uses the child's ``_sum`` and ``_buckets`` value objects, which ``prometheus_client`` has kept
    for years and which work in multiprocess mode too. tests/test_metrics.py pins the result.
    """
    histogram._raise_if_not_observable()
    histogram._sum.inc(total)
    for index, count in bucket_counts.items():
        histogram._buckets[index].inc(count)


def observe_acquisitions(alias, result, bucket_counts, total_seconds):
    """Count ``acquire()`` calls with one ``result``: their durations' buckets and sum."""
    if instruments() is not None:
        _child("acquisitions", alias, result).inc(sum(bucket_counts.values()))
        _observe_many(_child("acquire_seconds", alias, result), bucket_counts, total_seconds)


def observe_holds(alias, bucket_counts, total_seconds):
    if instruments() is not None:
        _observe_many(_child("hold_seconds", alias), bucket_counts, total_seconds)


def count_lost(alias, count=1):
    if instruments() is not None:
        _child("lock_lost", alias).inc(count)


def count_rejection(alias):
    if instruments() is not None:
        _child("fencing_rejections", alias).inc()


def count_token_regression(alias):
    if instruments() is not None:
        _child("token_regressions", alias).inc()


def count_task_conflict(alias, outcome, count=1):
    if instruments() is not None:
        _child("task_conflicts", alias, outcome).inc(count)


class _OnlyDistlock:
    """The distlock families of a registry, without the rest of it (other apps', process and platform metrics)."""

    def __init__(self, registry, names):
        self._registry, self._names = registry, names

    def collect(self):
        for family in self._registry.collect():
            if family.name in self._names:
                yield family


def exposition():
    """Return ``(body, content_type)``: the distlock metrics of this process, or of every process in multiprocess mode.

    Only distlock's own families are exported, never the rest of the registry: the view serves them to
    whoever the project lets scrape lock metrics, which is no reason to show them other apps' figures.
    """
    found = instruments()
    if found is None:
        raise ImproperlyConfigured(
            "distlock.views.metrics needs prometheus_client: pip install 'django-distlock[prometheus]'."
        )
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = prometheus_client.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    else:
        registry = prometheus_client.REGISTRY
    names = {family.name for instrument in vars(found).values() for family in instrument.describe()}
    return prometheus_client.generate_latest(_OnlyDistlock(registry, names)), prometheus_client.CONTENT_TYPE_LATEST
