"""Scenario 12 on every backend: interrupts that land anywhere in acquire, extend and release (issues 13 and 25).

A signal handler that raises (what Celery's soft time limit does, or ``gevent.Timeout``) cuts a
client's lock calls short at random points, aimed at each backend's own call durations. It disturbs
only the client process, so it runs on the shared servers, and on SQLite too. Each backend's run
is its own client process with a deadline; 200 calls per backend, 1,000 with ``--long``. A canary
runs the scenario on a backend broken on purpose and expects every check to catch it.
"""

import dataclasses

import pytest

from distlock.backends.database import DatabaseBackend
from distlock.conformance import scenarios
from distlock.models import LockWaiter
from tests.faults.conftest import DATABASES
from tests.faults.test_client_threads import KEYS, target

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]


def operations(scale):
    return 1000 if scale.long else 200


@pytest.mark.parametrize("key", KEYS)
def test_interrupted_calls_grant_nothing_wrong_and_leave_nothing_held(key, fault_run, safety, scale):
    label, entry = target(key)
    run = fault_run({"under_test": entry}, fenced=False)
    result = safety.record(scenarios.interrupts(run, label, operations=operations(scale)))
    counts = result.interrupts

    assert result.ok, "\n".join(result.violations + counts.tracebacks)
    assert counts.operations == operations(scale)
    assert counts.interrupted > 0, "the timer must cut some calls short, or nothing was tested"
    assert counts.wrong_grants == counts.misread_replies == counts.hangs == counts.locks_left == 0


class CarelessBackend(DatabaseBackend):
    """The database backend broken the three ways the scenario looks for, to show it finds them (a canary).

    A try that finds the lock held takes it over, ahead of any waiter (wrong grants); an interrupt that lands in a try
    comes out as a ``TypeError`` (a misread reply); every lock is stored for a hundred times its ttl,
    longer than a storm may last (``STORM_DEADLINE_*``), and a release deletes nothing (locks left).
    Ten times (20 s) let the locks of a slow storm expire before the check, and the canary pass.
    """

    def _try_acquire(self, attempt):
        stretched = dataclasses.replace(attempt, ttl=attempt.ttl * 100)
        try:
            grant = super()._try_acquire(stretched)
            if grant is None:
                for info in self.held_locks(attempt.name):
                    if info.name == attempt.name:
                        self.release_owned(info.name, info.owner)
                # ...jumping the queue too: a takeover refused for a waiter ahead would leave the lock
                # free, and the locks-left check with nothing to find.
                LockWaiter.objects.using(self.database).filter(name=attempt.name).exclude(owner=attempt.owner).delete()
                grant = super()._try_acquire(stretched)
        except BaseException as exc:
            if type(exc).__name__ == "Interrupted":
                raise TypeError("a reply read by the wrong request") from exc
            raise
        return grant

    def _do_release(self, lease):
        return True


def test_canary_a_careless_backend_is_caught_on_every_count(fault_run):
    entry = {"BACKEND": f"{__name__}.CarelessBackend", "OPTIONS": {"DATABASE": "default"}}
    run = fault_run({"under_test": entry}, fenced=False)
    result = scenarios.interrupts(run, "careless (SQLite)", operations=200)
    counts = result.interrupts

    assert not result.ok
    assert counts.operations == 200, result.violations
    assert counts.wrong_grants > 0
    assert counts.misread_replies > 0
    assert counts.locks_left > 0
    assert counts.hangs == 0
