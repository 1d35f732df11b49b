"""Scenario 14: partitions between the members of a ZooKeeper ensemble and of an etcd cluster.

Each member runs in a network namespace of its own (``tests/servers/netns.py``); the nemesis cuts
links between members, and between members and the clients, for real: packets are dropped, as in a
partition, not refused by a proxy in front of the client. While the clients contend for one lock
through ``FencedModel`` (claim, then increment), every fault of ``CLUSTER_FAULTS`` happens in turn:
no stale write may be accepted, no acknowledged increment lost, no token issued twice or out of order.
"""

from contextlib import ExitStack

import pytest

from tests.faults.conftest import DATABASES
from tests.faults.nemesis import (CLUSTER_FAULTS, Deployment, holder_cut_from_the_majority,
                                  partitions_during_contention)
from tests.faults.targets import TARGETS
from tests.servers.etcd import EtcdCluster
from tests.servers.netns import TestNetwork, namespaces_refused
from tests.servers.zookeeper import ZooKeeperEnsemble

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]


@pytest.fixture(scope="module")
def network():
    reason = namespaces_refused()
    if reason:
        pytest.skip(reason)
    with TestNetwork() as network:
        yield network


@pytest.fixture(scope="module")
def zookeeper_on_hosts(network, tmp_path_factory):
    ensemble = ZooKeeperEnsemble(tmp_path_factory.mktemp("zookeeper-hosts"), network=network).start()
    yield ensemble
    ensemble.cleanup()


@pytest.fixture(scope="module")
def etcd_on_hosts(network, tmp_path_factory):
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd-hosts"), network=network).start()
    yield cluster
    cluster.cleanup()


@pytest.fixture
def clusters(zookeeper_on_hosts, etcd_on_hosts):
    return {"zookeeper": (zookeeper_on_hosts, {"hosts": zookeeper_on_hosts.hosts}),
            "etcd": (etcd_on_hosts, {"endpoints": etcd_on_hosts.endpoints})}


@pytest.mark.parametrize("key", ["zookeeper", "etcd"])
def test_partitions_between_members_accept_no_stale_write_and_lose_no_update(key, clusters, network, fault_run,
                                                                               safety, scale):
    cluster, address = clusters[key]
    target = TARGETS[key]
    rounds = scale.runs
    faults = [fault for _ in range(rounds) for fault in CLUSTER_FAULTS]
    run = fault_run({key: target.entry(**address)})
    try:
        result = safety.record(partitions_during_contention(
            run, target.label, Deployment(cluster=cluster, network=network), faults, seed=rounds,
            scenario=f"{target.label}: partitions between members"))
    finally:
        network.heal()
        cluster.restore()
    assert result.ok, result.violations
    assert result.stale_accepted == 0


@pytest.mark.parametrize("key", ["zookeeper", "etcd"])
def test_a_holder_cut_from_the_majority_loses_the_lock_and_its_write_is_refused(key, clusters, network, fault_run,
                                                                               safety, scale):
    cluster, address = clusters[key]
    target = TARGETS[key]
    run = fault_run({key: target.entry(**address)})
    with ExitStack() as stack:
        try:
            result = safety.record(holder_cut_from_the_majority(run, target.label, cluster, network, stack,
                                                                runs=scale.runs))
        finally:
            network.heal()
            cluster.restore()
    assert result.ok, result.violations
    assert result.rejections == scale.runs
