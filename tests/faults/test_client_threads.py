"""Scenarios 10, 11 and 13 on every backend: threads that come and go, contended tries (issue 21), and a fork
with locks held (issue 25).

They disturb only client processes, so they run on the shared servers (``python -m tests.servers``);
the database backend runs on SQLite too (the suite's own test database), where thread churn crashed
the process. Each run is bounded: a few seconds per backend, longer with ``--long``.
"""

import pytest

from distlock.conformance import scenarios
from tests.faults.conftest import DATABASES
from tests.faults.targets import TARGETS

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]

#: The database backend on the suite's SQLite test database, next to the shared-server targets.
SQLITE = ("database (SQLite)", {"BACKEND": "distlock.backends.database.DatabaseBackend",
                                "OPTIONS": {"DATABASE": "default"}})
KEYS = ["sqlite", *TARGETS]


def target(key):
    """Return (label in the report, DISTLOCK entry) of ``key``; skip when its server was not started."""
    if key == "sqlite":
        return SQLITE
    return TARGETS[key].label, TARGETS[key].shared_entry()


def patient(entry):
    """``entry``, with Redlock's masters given 2 s to answer instead of 0.25 s.

    Hundreds of threads in a few processes starve a 2-core machine: a release whose round closes
    before a majority's replies are read reports the lease gone although every master deleted it.
    """
    if entry["BACKEND"].endswith(".RedlockBackend"):
        return {**entry, "OPTIONS": {**entry["OPTIONS"], "REQUEST_TIMEOUT": 2}}
    return entry


def churn_seconds(scale):
    return 20.0 if scale.long else 3.0


def tries_seconds(scale):
    """Seconds of back-to-back tries: 2 in ``make test`` (its time budget; 40 threads try thousands of times,
    and every grant is checked for overlap), 8 with ``--long``."""
    return 8.0 if scale.long else 2.0


@pytest.mark.parametrize("key", KEYS)
def test_threads_that_come_and_go_neither_crash_nor_fail_nor_overlap(key, fault_run, safety, scale):
    label, entry = target(key)
    run = fault_run({"under_test": patient(entry)}, fenced=False)
    result = safety.record(scenarios.thread_churn(run, label, seconds=churn_seconds(scale)))

    assert result.ok, result.violations
    assert result.acquisitions > 0
    assert result.overlaps == 0


@pytest.mark.parametrize("key", KEYS)
def test_contended_tries_never_overlap(key, fault_run, safety, scale):
    label, entry = target(key)
    run = fault_run({"under_test": entry}, fenced=False)
    result = safety.record(scenarios.contended_tries(run, label, processes=2, threads=20,
                                                     seconds=tries_seconds(scale)))

    assert result.ok, result.violations
    assert result.overlaps == 0
    assert result.tries_per_second > 0
    if key != "zookeeper":  # ZooKeeper's grant rate is asserted by its own regression test (issue 21)
        assert result.acquisitions > 0, "a lock that is tried back to back must be granted now and then"


@pytest.mark.parametrize("key", KEYS)
def test_children_forked_while_a_lock_is_held_work_and_leave_the_parent_working(key, fault_run, safety, scale):
    """A pre-fork server: children take turns beside the parent, which keeps its auto-renewed lease."""
    label, entry = target(key)
    run = fault_run({"under_test": patient(entry)}, fenced=False)
    result = safety.record(scenarios.forks(run, label, forks=5 if scale.long else 3, rounds=40 if scale.long else 20))

    assert result.ok, result.violations
    assert result.overlaps == 0
