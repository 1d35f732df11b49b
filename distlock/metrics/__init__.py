"""Lock metrics of every process, recorded without I/O on the acquire path and summed in the database.

``record_*`` buffer one event in this process (see ``distlock.metrics.recorder``); a daemon thread adds
the counts to the shared ``MetricSample`` rows every ``DISTLOCK_METRICS['FLUSH_INTERVAL']`` seconds
(10 by default) and at exit; ``distlock.metrics.report`` sums them for the admin page and
``distlock stats``; ``distlock.metrics.prometheus`` exports this process's figures.
"""

from distlock.metrics.recorder import Recorder, prefix_of

#: The recorder of this process.
this_process = Recorder()

__all__ = ["Recorder", "flush", "prefix_of", "record_acquire", "record_lost", "record_rejection",
           "record_release", "record_task_conflict", "this_process"]

# This process's recorder's own methods, not wrappers: recording is on every acquire and release,
# where one call layer more is a measurable part of an in-process (locmem) lock's cost.
record_acquire = this_process.record_acquire
record_release = this_process.record_release
record_lost = this_process.record_lost
record_rejection = this_process.record_rejection
record_task_conflict = this_process.record_task_conflict
flush = this_process.flush
