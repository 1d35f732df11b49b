"""Scenario 4: Redlock with masters killed (2 of 5: still works; 3 of 5: refuses) and a master restarted empty.

Five private Redis masters without persistence. Redlock's tokens are not safe, so no fenced writes:
the scenarios judge critical sections, the errors and their timing. A master restarted empty at once
forgets the grant a bare majority held, and a second client gets a majority of its own (the canary
the Redis documentation warns about); kept down for longer than the ttl, it changes nothing.
"""

import time

import pytest
import redis

from distlock.conformance import scenarios
from distlock.conformance.process import ClientError
from distlock.conformance.run import RECOVERY_SLACK, wait_until
from tests.faults.conftest import DATABASES
from tests.faults.targets import TARGETS

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]

TTL = 2.0
#: How much longer than its 1 s timeout an acquisition with 3 of 5 masters down may take: the rounds
#: in flight at the deadline, each answered by the masters that are up.
DOWN_MASTERS_ALLOWANCE = 0.5


@pytest.fixture
def masters(private_redlock):
    """The five masters, all running again after the test."""
    yield private_redlock
    for server in private_redlock:
        if not server.running:
            server.start()


def redlock_run(fault_run, masters):
    entry = TARGETS["redlock"].entry(urls=[server.url for server in masters])
    return fault_run({"redlock": entry}), entry["OPTIONS"]["KEY_PREFIX"]


def kill(run, servers, *, ends_leases=False):
    """Kill ``servers``. ``ends_leases``: tell the checker that a lease granted on a bare majority including one
    of them may be held no more (the canaries below leave it out: the double grant is what they show)."""
    for server in servers:
        server.kill()
        run.nemesis.record("fault", what="kill master", target=server.name, ends_leases=ends_leases)


def start(run, servers):
    for server in servers:
        server.start()
        run.nemesis.record("fault", what="restart master (empty)", target=server.name)


def test_two_of_five_masters_killed_during_contention(masters, fault_run, safety, scale):
    run, _ = redlock_run(fault_run, masters)

    def kill_two():
        time.sleep(1.0)
        # A holder granted on the two and one more is left with one master: its release frees that one, another
        # client may be granted on the three up before the release returns, and the release, which deleted
        # on one master of five, reports the lock gone (the checker saw a double grant in a CI run).
        kill(run, masters[:2], ends_leases=True)

    clients = scale.clients // 2
    result = safety.record(scenarios.contention(run, "Redlock", clients=clients, iterations=scale.iterations,
                                                fault=kill_two, scenario="redlock: 2 of 5 masters killed"))
    assert result.ok, result.violations
    assert result.acquisitions == clients * scale.iterations, "a majority of three must keep granting every lock"


def test_three_of_five_masters_killed_refuses_then_resumes(masters, fault_run, safety):
    run, prefix = redlock_run(fault_run, masters)
    (client,) = run.spawn("client")
    problems = []
    kill(run, masters[:3])
    for blocking in (True, False):
        name = run.lock_name()
        started = time.monotonic()
        try:
            client.call("acquire", name=name, ttl=TTL, timeout=1.0, blocking=blocking)
            problems.append(f"acquired with 3 of 5 masters down (blocking={blocking})")
        except ClientError as exc:
            if exc.error != "BackendUnavailable":
                problems.append(f"with 3 of 5 masters down, acquire raised {exc}")
        took = time.monotonic() - started
        if took > 1.0 + DOWN_MASTERS_ALLOWANCE + RECOVERY_SLACK:
            problems.append(f"acquire with 3 of 5 masters down took {took:.2f}s (blocking={blocking})")
        for server in masters[3:]:
            left = redis.Redis.from_url(server.url).exists(f"{prefix}:lock:{name}")
            if left:
                problems.append(f"a refused acquisition left its lock on {server.name}")
    start(run, masters[:3])
    name = run.lock_name()
    try:
        client.call("acquire", name=name, ttl=TTL, timeout=10)
        client.call("release", name=name)
    except ClientError as exc:
        problems.append(f"after the masters came back, acquire failed: {exc}")
    run.close()
    result = safety.record(run.judge("redlock: 3 of 5 masters killed", "Redlock", 1, expect_overlap=False))
    result.violations += problems
    assert result.ok, result.violations


def hold_on_exactly_three(run, holder, masters):
    """Two masters down while A acquires (so A holds A, B, C only), then back, empty; A enters its section."""
    name = run.lock_name()
    kill(run, masters[3:])
    held = holder.call("acquire", name=name, ttl=TTL, timeout=10)
    start(run, masters[3:])
    holder.call("enter", name=name)
    return name, held


def test_master_restarted_empty_during_a_hold_double_grants(masters, fault_run, safety, scale):
    run, _ = redlock_run(fault_run, masters)
    holder, other = run.spawn("holder", "next-holder")
    for _ in range(scale.canary_runs):
        name, _ = hold_on_exactly_three(run, holder, masters)
        kill(run, masters[2:3])
        start(run, masters[2:3])
        try:
            other.call("acquire", name=name, ttl=TTL, timeout=1.0)
        except ClientError as exc:
            pytest.fail(f"canary: the restarted master and the two others must grant a majority again: {exc}")
        scenarios.take_turn(other, name, None)
        holder.call("exit", name=name)
        holder.call("release", name=name)
    run.close()
    forgot = "a master restarted without persistence forgot its grant"
    result = safety.record(run.judge("redlock: master restarted empty during a hold", "Redlock", scale.canary_runs,
                                     expect_overlap=forgot, forgets_grants=forgot))
    assert result.ok, result.violations
    assert result.overlaps >= scale.canary_runs, "canary: two holders at once"


def test_master_kept_down_longer_than_the_ttl_changes_nothing(masters, fault_run, safety, scale):
    run, _ = redlock_run(fault_run, masters)
    holder, other = run.spawn("holder", "next-holder")
    for _ in range(scale.runs):
        name, held = hold_on_exactly_three(run, holder, masters)
        killed_at = time.monotonic()
        kill(run, masters[2:3])
        holder.call("hold_valid", name=name)  # the holder's section lasts exactly as long as its validity
        holder.call("exit", name=name)
        wait_until(killed_at + TTL + 0.5)
        # The masters ended the lease by its ttl, not a release: the checker needs that evidence (P4).
        run.nemesis.record("expired", lock=name, owner=held["owner"], since=int((killed_at + TTL) * 1e9))
        start(run, masters[2:3])
        other.call("acquire", name=name, ttl=TTL, timeout=10)
        scenarios.take_turn(other, name, None)
        holder.call("release", name=name)
    run.close()
    result = safety.record(run.judge("redlock: master restarted after a ttl", "Redlock", scale.runs,
                                     expect_overlap=False))
    assert result.ok, result.violations
