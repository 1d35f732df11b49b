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
from tests.faults.targets import SESSION_TIMEOUT, TARGETS

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]

TTL = 30.0
#: etcd keeps a session lease alive every ttl/3.
KEEPALIVE_INTERVAL = SESSION_TIMEOUT / 3


@pytest.fixture
def cluster(private_etcd):
    """The cluster, whole and healthy again after the test."""
    yield private_etcd
    for member in private_etcd.members:
        member.resume()
        if not member.running:
            member.start()
    private_etcd.wait_healthy(60)


def etcd_run(fault_run, cluster):
    return fault_run({"etcd": TARGETS["etcd"].entry(endpoints=cluster.endpoints)})


def restart_during_contention(run, cluster, scale, *, member, scenario):
    """Contend while ``member(cluster)`` is killed (SIGKILL) and restarted 3 s later."""
    def kill_and_restart():
        time.sleep(1.5)
        victim = member(cluster)
        victim.kill()
        run.nemesis.record("fault", what="kill member", target=victim.name)
        time.sleep(3)
        victim.start()
        run.nemesis.record("fault", what="restart member", target=victim.name)

    return scenarios.contention(run, "etcd", clients=scale.clients // 2, iterations=scale.iterations,
                                fault=kill_and_restart, scenario=scenario)


def test_leader_killed_during_contention(cluster, fault_run, safety, scale):
    run = etcd_run(fault_run, cluster)
    result = safety.record(restart_during_contention(run, cluster, scale, member=lambda c: c.leader(),
                                                     scenario="etcd: leader killed during contention"))
    assert result.ok, result.violations


def test_member_restarted_during_contention(cluster, fault_run, safety, scale):
    run = etcd_run(fault_run, cluster)
    result = safety.record(restart_during_contention(run, cluster, scale, member=lambda c: c.followers()[0],
                                                     scenario="etcd: member restarted during contention"))
    assert result.ok, result.violations


def test_cluster_paused_past_the_lease_ttl(cluster, fault_run, safety, scale):
    run = etcd_run(fault_run, cluster)
    holder, other = run.spawn("holder", "next-holder")
    for _ in range(scale.runs):
        name, row = run.lock_name(), run.row()
        held = holder.call("acquire", name=name, ttl=TTL, timeout=10)
        holder.call("claim", name=name, row=row)
        holder.call("enter", name=name)
        watching = holder.send("watch", name=name, seconds=SESSION_TIMEOUT + 6)
        time.sleep(0.2)
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
        assert holder.call("write", name=name, row=row, via="token")["outcome"] == "stale"
        holder.call("exit", name=name)
        holder.call("release", name=name)
    run.close()
    result = safety.record(run.judge(
        "etcd: cluster paused past the lease ttl", "etcd", scale.runs,
        expect_overlap="the old holder stays in its critical section until it checks its lease"))
    assert result.ok, result.violations
    assert result.rejections == scale.runs
