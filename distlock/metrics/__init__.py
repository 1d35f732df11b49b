"""Lock metrics of every process, recorded without I/O on the acquire path and summed in the database.

``record_*`` queue one event in this process (see ``distlock.metrics.recorder``); a daemon thread adds
the counts to the shared ``MetricSample`` rows every ``DISTLOCK_METRICS['FLUSH_INTERVAL']`` seconds
(10 by default) and at exit; ``distlock.metrics.report`` sums them for the admin page and
``distlock stats``; ``distlock.metrics.prometheus`` exports this process's figures.
"""

from distlock.metrics.recorder import Recorder, prefix_of

#: The recorder of this process.
this_process = Recorder()

__all__ = ["Recorder", "flush", "prefix_of", "record_acquire", "record_lost", "record_rejection",
           "record_release", "record_task_conflict", "this_process"]


def record_acquire(alias, name, ttl, waited, result, lease=None):
    """Count one ``acquire()`` call; ``result`` is acquired, busy, timeout or unavailable."""
    this_process.record_acquire(alias, name, ttl, waited, result, lease)


def record_release(lease):
    """Count a release and how long ``lease`` was held."""
    this_process.record_release(lease)


def record_lost(lease):
    """Count a lease found lost."""
    this_process.record_lost(lease)


def record_rejection(alias, name=""):
    """Count a fenced write refused for a stale token of lock ``name`` on ``alias``."""
    this_process.record_rejection(alias, name)


def record_task_conflict(alias, name, outcome):
    """Count a Celery run whose key ``name`` was held; ``outcome`` is skip, retry, fail or refused."""
    this_process.record_task_conflict(alias, name, outcome)


def flush():
    """Add this process's pending counts to the shared store now (it happens on its own every few seconds)."""
    return this_process.flush()
