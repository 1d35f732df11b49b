"""Tasks of the deployment tests (tests/test_deployment.py, ``make matrix``): green pools and time-limit storms.

One task of each kind per alias, as ``@single_instance_task`` fixes its alias at decoration. Results
go back through the result backend (the test Redis), so no run writes to a database of its own.
"""

import os
import random
import time

import distlock
from distlock.celery import single_instance_task

#: Every alias the matrix runs Celery on: the database backend on SQLite and PostgreSQL, Redis, ZooKeeper, etcd.
ALIASES = ("default", "postgres", "redis", "zookeeper", "etcd")
#: The ttl of the storm's locks: a key must be free by this + 1 s after the storm.
STORM_TTL = 4


def green_run(prefix, n, hot_names, lease=None):
    """Hold run lock ``green:<prefix>:<n>``, then hot lock ``<prefix>:hot:<n % hot_names>`` (yielding inside).

    Return the hot lock's critical section, for the overlap check.
    """
    name = f"{prefix}:hot:{n % hot_names}"
    with distlock.lock(name, ttl=10, timeout=60, using=lease.alias) as hot:
        enter = time.monotonic_ns()
        time.sleep(0.005)  # patched under gevent/eventlet: other runs contend meanwhile
        exit_ = time.monotonic_ns()
        hot.check()
    lease.check()
    return {"name": name, "token": hot.token, "enter": enter, "exit": exit_, "pid": os.getpid()}


def long_run(prefix, seconds, lease=None):
    """Hold the run lock for ``seconds`` (several ttls), sleeping in short steps; report whether it was kept."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.1)
    lost = lease.lost
    lease.check()
    return {"token": lease.token, "lost": lost, "seconds": seconds, "ttl": lease.ttl}


def storm_run(prefix, slot, seconds, lease=None):
    """Under run lock ``<prefix>:run:<slot>``: nothing but lock calls on ``<prefix>:inner:*`` for ``seconds``
    (the time limit ends the run first); with ``seconds`` 0, just return the token (the key's next run)."""
    rng = random.Random()
    deadline = time.monotonic() + seconds
    calls = 0
    while time.monotonic() < deadline:
        name = f"{prefix}:inner:{rng.randrange(4)}"
        try:
            inner = distlock.acquire(name, ttl=STORM_TTL, blocking=False, using=lease.alias)
        except distlock.LockNotAcquired:
            continue
        inner.release()
        calls += 1
    return lease.token if not seconds else calls


def per_alias(function, key, **options):
    return {alias: single_instance_task(name=f"tests.celery_app.deployment_tasks.{function.__name__}_{alias}", key=key,
                                        using=alias, **options)(function)
            for alias in ALIASES}


GREEN_RUN = per_alias(green_run, "{prefix}:run:{n}", ttl=10)
#: ttl 2 s, auto-renewed: a run of 8 s keeps its lease only through renewal.
LONG_RUN = per_alias(long_run, "{prefix}:long", ttl=2)
STORM_RUN = per_alias(storm_run, "{prefix}:run:{slot}", ttl=STORM_TTL)
