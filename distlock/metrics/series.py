"""What is counted: the series names of the metrics store and the bucket bounds of its histograms.

A histogram is stored as one count per bucket, so the histograms of many processes and minutes merge
by addition and quantiles stay exact to the bucket. Bucket ``i`` counts values ``<= bounds[i]`` and
``> bounds[i - 1]`` (Prometheus ``le`` semantics); the last bucket, ``len(bounds)``, is ``+Inf``. The bounds are part of the
stored format: changing them needs a migration that empties ``MetricSample``.
"""

import bisect

__all__ = [
    "ACQUIRE_OF_TTL",
    "ACQUIRE_SECONDS",
    "ATTEMPTS",
    "CONTENDED",
    "HISTOGRAMS",
    "HOLD_OF_TTL",
    "HOLD_SECONDS",
    "LOST",
    "RELEASED",
    "RESULTS",
    "SECONDS_BOUNDS",
    "TASK_CONFLICT",
    "TASK_OUTCOMES",
    "TTL_FRACTION_BOUNDS",
    "bucket_of",
    "quantile",
]

# Counters (stored with bucket 0).
ATTEMPTS = "attempts"                  # every acquire() call
ACQUIRED, BUSY, TIMEOUT, UNAVAILABLE = "acquired", "busy", "timeout", "unavailable"  # its result
RESULTS = (ACQUIRED, BUSY, TIMEOUT, UNAVAILABLE)
CONTENDED = "contended"                # had to wait for another holder, or did not get the lock (busy, timeout)
RELEASED = "released"
LOST = "lost"
TASK_CONFLICT = "task_conflict"        # a Celery run found its key held; bucket = index in TASK_OUTCOMES
TASK_OUTCOMES = ("skip", "retry", "fail", "refused")

# Histograms.
ACQUIRE_SECONDS = "acquire_seconds"    # time acquire() took, for acquired locks
ACQUIRE_OF_TTL = "acquire_of_ttl"      # the same, as a fraction of that acquisition's own ttl
HOLD_SECONDS = "hold_seconds"          # acquisition to release
HOLD_OF_TTL = "hold_of_ttl"            # the same, as a fraction of the lease's own ttl

#: Seconds: from a local round trip to an hour-long hold. Shared with the Prometheus histograms.
SECONDS_BOUNDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                  30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
#: Fractions of a ttl. 0.5 and 0.8 are bounds, so the alert thresholds on them are exact, not estimates.
TTL_FRACTION_BOUNDS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 5.0, 10.0)

HISTOGRAMS = {
    ACQUIRE_SECONDS: SECONDS_BOUNDS,
    ACQUIRE_OF_TTL: TTL_FRACTION_BOUNDS,
    HOLD_SECONDS: SECONDS_BOUNDS,
    HOLD_OF_TTL: TTL_FRACTION_BOUNDS,
}


def bucket_of(bounds, value):
    """Return the index of the bucket counting ``value`` (the recorder counts whole groups at once, alike)."""
    return bisect.bisect_left(bounds, value)


def quantile(bounds, counts, q):
    """Return the ``q`` quantile of a bucketed histogram, or None if it is empty.

    Interpolates linearly inside the bucket holding the rank, as Prometheus ``histogram_quantile()``
    does; the result always lies inside that bucket, so comparing it with a bucket bound is exact.
    The ``+Inf`` bucket answers with the highest finite bound.
    """
    total = sum(counts)
    if not total:
        return None
    rank = q * total
    below = 0
    for index, count in enumerate(counts):
        if count and below + count >= rank:
            if index >= len(bounds):
                return bounds[-1]
            lower = bounds[index - 1] if index else 0.0
            return lower + (bounds[index] - lower) * (rank - below) / count
        below += count
    return bounds[-1]
