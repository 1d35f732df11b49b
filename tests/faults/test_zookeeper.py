"""Scenario 5: ZooKeeper with the holder's session expired, the leader killed, and a connection suspended.

A private three-member ensemble (tickTime 250 ms). Expiring a session is done the way kazoo's own
tests do it: a second client connects with the same session id and password and closes, and the
server expires the session for both. The suspended connection goes through a ``FaultProxy`` per
member: cut and black-holed for 1 s, well within the 5 s session, so the lease must come back
valid with the same token while a waiting client never gets in.
"""

import time
from contextlib import ExitStack

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from distlock.backends.zookeeper.protocol import encode_name
from distlock.conformance import scenarios
from distlock.conformance.run import RECOVERY_SLACK
from tests.faults.conftest import DATABASES
from tests.faults.proxy import FaultProxy
from tests.faults.server_scenarios import (LOST_LEASE_OVERLAP, enter_new_lock, restart_during_contention,
                                           wait_for_record, write_stale_and_leave)
from tests.faults.targets import SESSION_TIMEOUT, TARGETS
from tests.servers import wait_until as poll_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]

TTL = 30.0


@pytest.fixture
def ensemble(private_zookeeper):
    """The ensemble, whole and healthy again after the test."""
    yield private_zookeeper
    private_zookeeper.restore()


def expire_session(hosts, session_id, password):
    """Make the server expire a session: connect a second client with its id and password, then close it."""
    intruder = KazooClient(hosts=hosts, client_id=(session_id, password))
    intruder.start(timeout=15)
    intruder.stop()
    intruder.close()


def wait_for_queue(hosts, key_prefix, name, length):
    """Return once lock ``name`` has ``length`` nodes queued on the ensemble: a waiter sent off has queued."""
    parent = f"{key_prefix}/{encode_name(name)}"
    zk = KazooClient(hosts=hosts)
    zk.start(timeout=15)

    def queued():
        try:
            zk.sync(parent)
            return len(zk.get_children(parent))
        except NoNodeError:
            return 0

    try:
        poll_until(lambda: queued() >= length, 30, f"{length} nodes queued for {name}")
    finally:
        zk.stop()
        zk.close()


def wait_for_state(client, name, state, within):
    """Return True once the client's lease on ``name`` is in ``state``, polling for ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if client.call("check", name=name)["state"] == state:
            return True
        time.sleep(0.1)
    return False


def test_expired_session_hands_the_lock_over_and_the_store_refuses_the_old_holder(ensemble, fault_run, safety,
                                                                                  scale):
    entry = TARGETS["zookeeper"].entry(hosts=ensemble.hosts)
    run = fault_run({"zookeeper": entry})
    holder, waiter = run.spawn("holder", "waiter")
    for _ in range(scale.runs):
        name, row, held = enter_new_lock(run, holder, ttl=TTL, timeout=10)
        waiting = waiter.send("acquire", name=name, ttl=TTL, timeout=60)
        wait_for_queue(ensemble.hosts, entry["OPTIONS"]["KEY_PREFIX"], name, 2)
        session = holder.call("probe", function="tests.faults.probes.zookeeper_session")
        run.nemesis.record("fault", what="expire session", target=holder.proc, owner=held["owner"], lock=name)
        expire_session(ensemble.hosts, session["session_id"], bytes.fromhex(session["password"]))
        taken = waiter.result(waiting, wait=60)
        assert taken["token"] > held["token"]
        scenarios.take_turn(waiter, name, row)
        # Until its client hears of the expiry, the old holder's lease is at least suspended: no write starts.
        assert holder.call("check", name=name)["state"] != "valid", "the old holder must not trust its lease"
        assert wait_for_state(holder, name, "lost", within=SESSION_TIMEOUT + RECOVERY_SLACK)
        # check() may say lost (its session ran out) before the state thread sends lock_lost, counted below.
        wait_for_record(run, holder, "lost", name)
        write_stale_and_leave(holder, name, row)
    run.close()
    result = safety.record(run.judge("zookeeper: session expired", "ZooKeeper", scale.runs,
                                     expect_overlap=LOST_LEASE_OVERLAP))
    assert result.ok, result.violations
    lost = [e for e in run.history() if e["op"] == "lost" and e["proc"] == "holder"]
    assert len(lost) == scale.runs, "lock_lost must be sent once per expired session"
    assert result.rejections == scale.runs
    assert max(result.recovery_ms) <= (SESSION_TIMEOUT + RECOVERY_SLACK) * 1000


def test_leader_killed_during_contention(ensemble, fault_run, safety, scale):
    run = fault_run({"zookeeper": TARGETS["zookeeper"].entry(hosts=ensemble.hosts)})
    result = safety.record(restart_during_contention(run, "ZooKeeper", ensemble, scale, member=lambda e: e.leader(),
                                                     scenario="zookeeper: leader killed during contention"))
    assert result.ok, result.violations


def test_suspended_connection_comes_back_with_the_same_lease(ensemble, fault_run, safety):
    options = TARGETS["zookeeper"].options(hosts=ensemble.hosts)
    options["SESSION_TIMEOUT"] = 5  # the longest the ensemble grants: the outage is a fifth of it
    with ExitStack() as stack:
        proxies = [stack.enter_context(FaultProxy(member.client_port)) for member in ensemble.members]
        behind = ",".join(f"127.0.0.1:{proxy.port}" for proxy in proxies)
        backend = TARGETS["zookeeper"].backend
        run = fault_run({"direct": {"BACKEND": backend, "OPTIONS": options},
                         "behind_proxy": {"BACKEND": backend, "OPTIONS": {**options, "HOSTS": behind}}})
        (holder,) = run.spawn("holder", alias="behind_proxy")
        (waiter,) = run.spawn("waiter")
        name, row, held = enter_new_lock(run, holder, ttl=TTL, timeout=10)
        watching = holder.send("watch", name=name, seconds=6)
        waiting = waiter.send("acquire", name=name, ttl=TTL, timeout=60)
        wait_for_record(run, holder, "lease_state", name)
        wait_for_queue(ensemble.hosts, options["KEY_PREFIX"], name, 2)
        run.nemesis.record("fault", what="cut and black-hole the holder's connections")
        for proxy in proxies:
            proxy.blackhole()
            proxy.cut()
        time.sleep(1.0)
        for proxy in proxies:
            proxy.heal()
            proxy.cut()  # the handshakes sent meanwhile were dropped: reconnect now
        run.nemesis.record("fault", what="healed")
        states = [change["state"] for change in holder.result(watching, wait=60)["changes"]]
        assert "suspended" in states and states[-1] == "valid" and "lost" not in states, states
        assert holder.call("write", name=name, row=row)["outcome"] == "accepted"
        holder.call("exit", name=name)
        assert holder.call("release", name=name)["released"]
        assert waiter.result(waiting, wait=60)["token"] > held["token"]
        scenarios.take_turn(waiter, name, row)
        run.close()
    result = safety.record(run.judge("zookeeper: connection suspended and restored", "ZooKeeper", 1,
                                     expect_overlap=False))
    assert result.ok, result.violations
