"""Scenarios 1, 2 and 9 on every backend: a paused holder, a killed holder, contention with short pauses.

They disturb only client processes, so they run on the shared servers (``python -m tests.servers``). And what a
client records of a release, on SQLite.
"""

import pytest

from distlock.conformance import scenarios
from distlock.conformance.run import RECOVERY_SLACK
from tests.faults.conftest import DATABASES
from tests.faults.targets import SESSION_TIMEOUT, TARGETS
from tests.faults.test_client_threads import SQLITE

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]

TTL = 2.0
#: Clients x acquisitions of the contention scenario in ``make test`` (its time budget): 4 processes x 12 contended
#: grants, each claimed and written, under the same short pauses; ``--long`` runs the suite's ``scale.clients`` x
#: ``scale.iterations`` (8 x 100).
CONTENTION_CLIENTS, CONTENTION_ITERATIONS = 4, 12


def expiry(key):
    """Seconds after which the server frees the lock of a holder that stopped: the session, or the ttl."""
    return SESSION_TIMEOUT if key in ("zookeeper", "etcd") else TTL


@pytest.mark.parametrize("key", list(TARGETS))
def test_paused_holder_overlaps_unfenced_and_is_refused_by_the_store(key, fault_run, safety, scale):
    target = TARGETS[key]
    run = fault_run({"under_test": target.shared_entry()})
    result = safety.record(scenarios.client_pause(run, target.label, ttl=TTL, runs=scale.canary_runs))

    assert result.ok, result.violations
    assert result.overlaps >= result.runs, "canary: every run's paused holder must overlap the next holder"
    if key != "redlock":
        assert result.rejections >= result.runs, "every run's stale write must have been refused by the store"
        assert result.stale_accepted == result.false_rejections == 0
    assert max(result.recovery_ms) <= (expiry(key) + RECOVERY_SLACK) * 1000


@pytest.mark.parametrize("key", list(TARGETS))
def test_killed_holder_is_replaced_within_its_expiry(key, fault_run, safety, scale):
    target = TARGETS[key]
    run = fault_run({"under_test": target.shared_entry()})
    result = safety.record(scenarios.client_crash(run, target.label, ttl=TTL, runs=scale.runs))

    assert result.ok, result.violations
    assert len(result.recovery_ms) == scale.runs
    assert max(result.recovery_ms) <= (expiry(key) + RECOVERY_SLACK) * 1000


@pytest.mark.parametrize("key", list(TARGETS))
def test_contention_with_short_pauses(key, fault_run, safety, scale):
    target = TARGETS[key]
    clients, iterations = ((scale.clients, scale.iterations) if scale.long
                           else (CONTENTION_CLIENTS, CONTENTION_ITERATIONS))
    run = fault_run({"under_test": target.shared_entry()})
    result = safety.record(scenarios.contention(run, target.label, clients=clients, iterations=iterations))

    assert result.ok, result.violations
    assert result.acquisitions == clients * iterations
    assert result.overlaps == 0


def test_a_release_is_recorded_when_called_and_when_it_returns(fault_run):
    """The checker needs the release's call too: a holder killed between the two may have released its lock
    (soak run 1043). The database backend on SQLite: no server needed."""
    run = fault_run({"under_test": SQLITE[1]}, fenced=False)
    (client,) = run.spawn("client")
    name = run.lock_name()
    owner = client.call("acquire", name=name, ttl=TTL)["owner"]
    client.call("release", name=name)
    steps = [(event["op"], event["phase"], event.get("owner")) for event in run.history(lock=name)]
    assert steps == [("acquire", "invoke", None), ("acquire", "ok", owner), ("release", "invoke", owner),
                     ("release", "ok", owner)]
