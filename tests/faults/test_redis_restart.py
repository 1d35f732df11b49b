"""Scenario 3: Redis (one instance) killed and restarted while a lock is held, without and with persistence.

Without persistence the restarted server has forgotten the lock, so a second client gets it at once:
the double grant the README warns about (a canary: it must show). The fencing token does not go
back with the lost counter (it is at least the server time in µs), so the new holder's writes are
accepted and the old holder's refused: no stale write accepted, no false rejection. With
``appendonly yes`` + ``appendfsync always`` the lock survives the restart and nobody overlaps.
"""

import pytest

from distlock.conformance.process import ClientError
from distlock.conformance.scenarios import take_turn
from tests.faults.conftest import DATABASES
from tests.faults.server_scenarios import enter_new_lock, write_stale_and_leave
from tests.faults.targets import TARGETS

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]

TTL = 10.0


def restart_during_hold(run, server, holder, other):
    """A holds, claims, enters; Redis is killed and restarted; return (name, row, A's grant, B's grant or error)."""
    name, row, held = enter_new_lock(run, holder, ttl=TTL, timeout=30)
    run.nemesis.record("fault", what="kill redis")
    server.kill()
    server.start()
    run.nemesis.record("fault", what="restarted redis")
    try:
        taken = other.call("acquire", name=name, ttl=TTL, timeout=1)
    except ClientError as exc:
        taken = exc
    return name, row, held, taken


def test_restart_without_persistence_double_grants_but_fencing_holds(private_redis, fault_run, safety, scale):
    run = fault_run({"volatile": TARGETS["redis"].entry(url=private_redis.url)})
    holder, other = run.spawn("holder", "next-holder")
    for _ in range(scale.canary_runs):
        name, row, held, taken = restart_during_hold(run, private_redis, holder, other)
        assert not isinstance(taken, ClientError), f"the emptied server must grant the lock again: {taken}"
        assert taken["token"] > held["token"], "the token must not go back with the lost counter"
        take_turn(other, name, row)
        write_stale_and_leave(holder, name, row)
    run.close()
    forgot = "the restarted server forgot the lock"
    result = safety.record(run.judge("redis restart without persistence", "Redis", scale.canary_runs,
                                     expect_overlap=forgot, forgets_grants=forgot))
    assert result.ok, result.violations
    assert result.overlaps >= scale.canary_runs, "canary: the forgotten lock is granted twice"
    assert result.stale_accepted == result.false_rejections == 0
    assert result.rejections == scale.canary_runs


def test_restart_with_appendfsync_always_keeps_the_lock(private_persistent_redis, fault_run, safety, scale):
    run = fault_run({"persistent": TARGETS["redis"].entry(url=private_persistent_redis.url)})
    holder, other = run.spawn("holder", "next-holder")
    for _ in range(scale.runs):
        name, row, _, taken = restart_during_hold(run, private_persistent_redis, holder, other)
        assert isinstance(taken, ClientError) and taken.error == "LockNotAcquired", \
            f"the lock must survive the restart, got {taken}"
        assert holder.call("write", name=name, row=row)["outcome"] == "accepted"
        holder.call("exit", name=name)
        assert holder.call("release", name=name)["released"], "the holder's lock was still there"
        other.call("acquire", name=name, ttl=TTL, timeout=30)
        take_turn(other, name, row)
    run.close()
    result = safety.record(run.judge("redis restart with appendfsync always", "Redis", scale.runs,
                                     expect_overlap=False))
    assert result.ok, result.violations
