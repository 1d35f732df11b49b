"""Tasks the worker processes of tests/test_celery.py run (found by ``app.autodiscover_tasks()``).

Every task is the same function, ``hold``: record the start, hold the lock ``hold_seconds``, record
the end. The tasks differ only in their ``@single_instance_task`` options.
"""

import os
import time

from distlock.celery import single_instance_task
from tests.celery_app.models import TaskRun


def hold(self, run_key, hold_seconds=0.0, lease=None):
    """Hold the lock ``celery-test:<run_key>`` for ``hold_seconds``; return the fencing token."""
    started = time.monotonic_ns()
    run = TaskRun.objects.create(key=run_key, alias=lease.alias, task_id=self.request.id or "", token=lease.token,
                                 pid=os.getpid(), retries=self.request.retries, started_ns=started)
    time.sleep(hold_seconds)
    run.finished_ns = time.monotonic_ns()
    run.save(update_fields=["finished_ns"])
    return lease.token


def hold_task(name, **options):
    return single_instance_task(name=f"tests.celery_app.tasks.{name}", key="celery-test:{run_key}", bind=True,
                                **options)(hold)


#: Wait for the key: retry every 0.2 s until the run gets the lock, so every call runs once, in turn.
HOLD = {alias: hold_task(f"hold_{alias}", using=alias, ttl=10, on_conflict="retry", retry_countdown=0.2,
                         max_retries=None)
        for alias in ("redis", "postgres")}
hold_or_skip = hold_task("hold_or_skip", using="redis", ttl=10)
hold_or_raise = hold_task("hold_or_raise", using="redis", ttl=10, on_conflict="raise")
#: A ttl of 3 s, renewed every second: a killed run frees its key within 3 s.
hold_short_ttl = hold_task("hold_short_ttl", using="redis", ttl=3)
#: A ttl of 30 s: a terminated run whose key is free sooner was released, not expired.
hold_long_ttl = hold_task("hold_long_ttl", using="redis", ttl=30)
#: Time limits: the soft one raises in the run, which releases; the hard one kills it, so the key expires.
hold_soft_limit = hold_task("hold_soft_limit", using="redis", ttl=30, soft_time_limit=1)
hold_hard_limit = hold_task("hold_hard_limit", using="redis", ttl=3, time_limit=1)
hold_dedupe = hold_task("hold_dedupe", using="redis", ttl=10, dedupe=True, dedupe_ttl=30)
hold_dedupe_short = hold_task("hold_dedupe_short", using="redis", ttl=10, dedupe=True, dedupe_ttl=1.5)


def hold_until_killed(self, run_key, lease=None):
    """Record the run; the first delivery of a message then holds its lock for 60 s (time enough to
    kill its pool child), a later delivery of the same message (same task id) finishes at once."""
    first_delivery = not TaskRun.objects.filter(key=run_key, task_id=self.request.id).exists()
    return hold(self, run_key, 60 if first_delivery else 0, lease=lease)


#: ``acks_late`` + ``reject_on_worker_lost``, default ``on_conflict="skip"``: a killed run's message is
#: requeued. ttl 30 s: the redelivery comes within ``worker_lost_wait`` (10 s) of the kill, within the ttl.
HOLD_ACKS_LATE = {
    alias: single_instance_task(name=f"tests.celery_app.tasks.hold_acks_late_{alias}", key="celery-test:{run_key}",
                                bind=True, using=alias, ttl=30, acks_late=True, reject_on_worker_lost=True)(
        hold_until_killed)
    for alias in ("redis", "postgres")
}

# The deployment tests' tasks (green pools, time-limit storms): registered wherever these are.
from tests.celery_app import deployment_tasks  # noqa: E402, F401
