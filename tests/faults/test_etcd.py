"""Scenario 6: etcd with the leader killed, the whole cluster paused past the session lease, a member restarted.

A private three-member cluster. While every member is frozen (SIGSTOP) no keepalive gets through:
the holder's library must declare the lease lost no later than the session lease ttl after its
last keepalive, and once the cluster is back another client gets the lock and the store refuses the
old holder's token.
"""

import time

import pytest

from distlock.conformance import scenarios
from distlock.conformance.run import RECOVERY_SLACK
from tests.faults.conftest import DATABASES
from tests.faults.server_scenarios import (LOST_LEASE_OVERLAP, enter_new_lock, restart_during_contention,
                                           wait_for_record, write_stale_and_leave)
from tests.faults.targets import SESSION_TIMEOUT, TARGETS

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]

TTL = 30.0
#: etcd keeps a session lease alive every ttl/3.
KEEPALIVE_INTERVAL = SESSION_TIMEOUT / 3


@pytest.fixture
def cluster(private_etcd):
    """The cluster, whole and healthy again after the test."""
    yield private_etcd
    private_etcd.restore()


def etcd_run(fault_run, cluster):
    return fault_run({"etcd": TARGETS["etcd"].entry(endpoints=cluster.endpoints)})


def test_leader_killed_during_contention(cluster, fault_run, safety, scale):
    run = etcd_run(fault_run, cluster)
    result = safety.record(restart_during_contention(run, "etcd", cluster, scale, member=lambda c: c.leader(),
                                                     scenario="etcd: leader killed during contention"))
    assert result.ok, result.violations


def test_member_restarted_during_contention(cluster, fault_run, safety, scale):
    run = etcd_run(fault_run, cluster)
    result = safety.record(restart_during_contention(run, "etcd", cluster, scale, member=lambda c: c.followers()[0],
                                                     scenario="etcd: member restarted during contention"))
    assert result.ok, result.violations


def test_cluster_paused_past_the_lease_ttl(cluster, fault_run, safety, scale):
    run = etcd_run(fault_run, cluster)
    holder, other = run.spawn("holder", "next-holder")
    for _ in range(scale.runs):
        name, row, held = enter_new_lock(run, holder, ttl=TTL, timeout=10)
        watching = holder.send("watch", name=name, seconds=SESSION_TIMEOUT + 6)
        wait_for_record(run, holder, "lease_state", name)
        paused = run.nemesis.record("fault", what="pause every member", owner=held["owner"], lock=name)
        for member in cluster.members:
            member.pause()
        time.sleep(SESSION_TIMEOUT + 3)
        for member in cluster.members:
            member.resume()
        run.nemesis.record("fault", what="resume every member")
        waiting = other.send("acquire", name=name, ttl=TTL, timeout=60)
        cluster.wait_healthy(60)
        changes = holder.result(watching, wait=60)["changes"]
        lost = [change["t"] for change in changes if change["state"] == "lost"]
        assert lost, f"the holder's library never declared the lease lost: {changes}"
        assert (lost[0] - paused["t"]) / 1e9 <= SESSION_TIMEOUT + KEEPALIVE_INTERVAL + RECOVERY_SLACK
        taken = other.result(waiting, wait=90)
        assert taken["token"] > held["token"]
        scenarios.take_turn(other, name, row)
        write_stale_and_leave(holder, name, row)
    run.close()
    result = safety.record(run.judge("etcd: cluster paused past the lease ttl", "etcd", scale.runs,
                                     expect_overlap=LOST_LEASE_OVERLAP))
    assert result.ok, result.violations
    assert result.rejections == scale.runs
