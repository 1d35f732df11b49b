"""Scenario S28: Redis Sentinel fails over to a replica that had not received the grant.

The lock is granted on the master while its replication link is stalled (the proxy in front of the
master drops the stream), so the replica has neither the lock nor the token counter's last value.
The master is killed (SIGKILL), the Sentinels promote the replica, and a second client acquires the
same lock at once: the double grant the README warns about (a canary: it must show). The token does
not go back with the lost counter (it is at least the promoted replica's time in µs), so the store
accepts the new holder's writes and refuses the old holder's: no stale write accepted, no false
rejection.
"""

import pytest

from distlock.conformance.scenarios import take_turn
from tests.faults.conftest import DATABASES
from tests.faults.server_scenarios import enter_new_lock, write_stale_and_leave
from tests.faults.targets import TARGETS
from tests.servers import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]

TTL = 30.0


def fail_over_before_the_grant_replicates(run, deployment, prefix, holder, other):
    """A holds, claims, enters; its grant never replicates; the master dies; return (name, row, A's, B's grants)."""
    wait_until(lambda: deployment.replica_behind() == 0, 10, "the replica catching up")
    master, replica = deployment.master(), deployment.replica()
    proxy = deployment.proxies[master]
    proxy.stall_replication()
    run.nemesis.record("fault", what="stall replication", target=master.name, phase="start")
    try:
        name, row, held = enter_new_lock(run, holder, ttl=TTL, timeout=30)
        assert deployment.replica_behind() > 0, "the replica must not have the grant"
        with replica.client() as client:
            assert not client.exists(f"{prefix}:lock:{name}")
        run.nemesis.record("fault", what="kill master", target=master.name, ends_leases=True)
        deployment.fail_over()
    finally:
        proxy.heal()
    run.nemesis.record("fault", what="stall replication", target=master.name, phase="end")
    run.nemesis.record("fault", what="replica promoted", target=replica.name)
    return name, row, held, other.call("acquire", name=name, ttl=TTL, timeout=10)


def test_failover_before_the_grant_replicates_double_grants_but_fencing_holds(private_sentinel, fault_run, safety,
                                                                             scale):
    deployment = private_sentinel
    options = {**TARGETS["redis"].options(url=deployment.url), "SENTINELS": deployment.sentinel_addresses,
               "SENTINEL_KWARGS": deployment.sentinel_kwargs}
    run = fault_run({"sentinel": {"BACKEND": TARGETS["redis"].backend, "OPTIONS": options}})
    holder, other = run.spawn("holder", "next-holder")
    for _ in range(scale.failover_runs):
        name, row, held, taken = fail_over_before_the_grant_replicates(run, deployment, options["KEY_PREFIX"],
                                                                       holder, other)
        assert taken["token"] > held["token"], "the token must not go back with the unreplicated counter"
        take_turn(other, name, row)
        write_stale_and_leave(holder, name, row)
        deployment.restore()
        run.nemesis.record("fault", what="old master back as a replica")
    run.close()
    lost = "the promoted replica never had the grant"
    result = safety.record(run.judge("Sentinel failover before the grant replicated", "Redis Sentinel",
                                     scale.failover_runs, expect_overlap=lost, forgets_grants=lost))
    assert result.ok, result.violations
    assert result.overlaps >= scale.failover_runs, "canary: the lost grant is granted twice"
    assert result.stale_accepted == result.false_rejections == 0
    assert result.rejections == scale.failover_runs
