"""The nemesis: faults of servers, of the links between them and of client processes, and the runs that suffer them.

A ``Fault`` starts on a healthy ``Deployment`` (the servers of one backend, its test network, the
clients of the run) and returns the members it hit and what undoes it. An ``episode`` records the
fault's start and end in the run's nemesis history (``phase`` "start"/"end", the members hit, the
links cut), so the checker can tell which critical sections a fault may explain, then restores the
deployment. The partition tests run the cluster faults in turn; the soak (``tests/faults/soak.py``)
draws them at random, with the client and single-server faults.
"""

import json
import random
import time
from dataclasses import dataclass, field
from typing import Callable

from django.conf import settings

from distlock.conformance import scenarios
from distlock.conformance.run import RECOVERY_SLACK, wait_until
from tests.faults.proxy import FaultProxy
from tests.faults.server_scenarios import LOST_LEASE_OVERLAP, enter_new_lock, write_stale_and_leave
from tests.faults.targets import SESSION_TIMEOUT
from tests.servers import wait_until as poll_until
from tests.servers.netns import CLIENTS

__all__ = [
    "CLIENT_FAULTS", "CLIENT_HOST_FAULTS", "CLUSTER_FAULTS", "CUT_OFF_OVERLAP", "Deployment", "FAULT_SECONDS", "Fault", "REDIS_FAULTS",
    "REDLOCK_FAULTS", "contend", "episode", "holder_cut_from_the_majority", "partitions_during_contention",
    "spawn_on_host",
]

#: Seconds a fault of the servers lasts: longer than the scenarios' session timeout (3 s), so sessions
#: and leases held through a member that lost its quorum do expire.
FAULT_SECONDS = 4.5

#: Why a run with faults may show overlapping critical sections.
CUT_OFF_OVERLAP = "a holder cut off by the fault stays in its critical section until it checks its lease"


@dataclass
class Deployment:
    """What a fault can hit: a cluster on a test network, or single servers, and the run's clients."""

    cluster: object = None
    network: object = None
    servers: list = field(default_factory=list)
    clients: list = field(default_factory=list)
    #: The test host of the client whose links a fault may cut ("client host cut from the majority").
    client_host: object = None
    #: The lock the clients contend for right now, and the folder of their histories (``contend()`` sets them).
    lock: str = None
    history_dir: object = None

    def holder(self, within=2.0):
        """Return ``(client, owner)`` of a client in its critical section on ``lock`` now, or ``(None, None)``.

        Polled for ``within`` seconds: a fault aimed at the holder hits it while it holds, not between turns.
        """
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            for client in self.clients:
                last = self.last_event(client)
                if client.alive and last is not None and last["op"] in ("cs_enter", "write"):
                    return client, last.get("owner")
            time.sleep(0.005)
        return None, None

    def lease_of(self, client):
        """The owner of the lease ``client`` holds on ``lock`` right now, or None: for the fault event to name.

        A lease whose release is in flight (called, no reply yet) may still be held.
        """
        last = self.last_event(client)
        if last is None:
            return None
        holding = (last["op"] in ("cs_enter", "write", "cs_exit")
                   or (last["op"], last.get("phase")) in (("acquire", "ok"), ("release", "invoke")))
        return last.get("owner") if holding else None

    def last_event(self, client):
        """The client's last event on ``lock``, read from its history (every event is flushed as it happens)."""
        return _last_event(self.history_dir / f"{client.proc}.jsonl", self.lock)

    def leader(self):
        poll_until(lambda: self.cluster.leader() is not None, 60, f"a {self.cluster.service} leader")
        return self.cluster.leader()

    def restore(self):
        """Resume and restart whatever a fault stopped, and wait until the servers serve again."""
        if self.network is not None:
            self.network.heal()
        if self.cluster is not None:
            self.cluster.restore()
        for server in self.servers:
            server.resume()
            if not server.running:
                server.start()


@dataclass(frozen=True)
class Fault:
    """One kind of fault: ``start(deployment, rng)`` returns ``(names of what it hit, undo)``.

    ``seconds``: how long it lasts before ``undo``; ``forgets_grants``: the servers lose granted locks
    (a restart without persistence), so a second holder is the fault's doing, not a bug;
    ``ends_leases``: it hits the servers or their links, so any lease held meanwhile may expire (a
    fault of a client process names the lease it ends itself).
    """

    name: str
    start: Callable
    seconds: float = FAULT_SECONDS
    forgets_grants: bool = False
    ends_leases: bool = True


def _isolate_leader(deployment, rng):
    leader = deployment.leader()
    deployment.network.isolate(leader.host.name)
    return [leader.name], deployment.network.heal


def _isolate_leader_and_clients(deployment, rng):
    leader = deployment.leader()
    deployment.network.isolate(leader.host.name, from_clients=True)
    return [leader.name], deployment.network.heal


def _isolate_follower(deployment, rng):
    deployment.leader()
    follower = rng.choice(deployment.cluster.followers())
    deployment.network.isolate(follower.host.name)
    return [follower.name], deployment.network.heal


def _bridge(deployment, rng):
    """The leader loses one follower; the other follower still hears both: a bridge between two sides."""
    leader = deployment.leader()
    follower = rng.choice(deployment.cluster.followers())
    deployment.network.cut(leader.host.name, follower.host.name)
    return [leader.name, follower.name], deployment.network.heal


def _clients_cut_from_leader(deployment, rng):
    leader = deployment.leader()
    deployment.network.cut(CLIENTS, leader.host.name)
    return [leader.name], deployment.network.heal


def _client_host_cut_from_majority(deployment, rng):
    """The client on its own host keeps one member, which is cut from the other two."""
    members = deployment.cluster.members
    minority = rng.choice(members)
    majority = [member.host.name for member in members if member is not minority]
    deployment.network.partition([deployment.client_host.name, minority.host.name], majority)
    return [deployment.client_host.name, minority.name], deployment.network.heal


def _kill_leader(deployment, rng):
    leader = deployment.leader()
    leader.kill()
    return [leader.name], leader.start


def _pause_leader(deployment, rng):
    leader = deployment.leader()
    leader.pause()
    return [leader.name], leader.resume


CLUSTER_FAULTS = [
    Fault("leader cut from the followers", _isolate_leader),
    Fault("leader cut from everyone", _isolate_leader_and_clients),
    Fault("follower cut from the others", _isolate_follower),
    Fault("bridge: leader cut from one follower", _bridge),
    Fault("clients cut from the leader", _clients_cut_from_leader),
    Fault("leader killed (SIGKILL)", _kill_leader),
    Fault("leader paused (SIGSTOP)", _pause_leader),
]

#: Needs a ``Deployment.client_host``: one of the run's clients on a test host of its own.
CLIENT_HOST_FAULTS = [Fault("a client's host cut from the majority", _client_host_cut_from_majority)]


def _last_event(path, lock, tail=4096):
    """The last complete event about ``lock`` in the JSON-lines file ``path``, or None."""
    try:
        with open(path, "rb") as file:
            file.seek(max(0, file.seek(0, 2) - tail))
            lines = file.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines[1:] if len(lines) > 1 else lines):
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("lock") == lock:
            return event
    return None


def _pause_holder(deployment, rng):
    client, owner = deployment.holder()
    if client is None:
        client, owner = _alive_client(deployment, rng), None
    client.pause(owner=owner, lock=deployment.lock if owner else None)
    return [client.proc], client.resume


def _alive_client(deployment, rng):
    return rng.choice([client for client in deployment.clients if client.alive])


def _pause_client(deployment, rng):
    client = _alive_client(deployment, rng)
    owner = deployment.lease_of(client)
    client.pause(owner=owner, lock=deployment.lock if owner else None)
    return [client.proc], client.resume


def _kill_client(deployment, rng):
    client = _alive_client(deployment, rng)
    owner = deployment.lease_of(client)
    client.kill(owner=owner, lock=deployment.lock if owner else None)
    return [client.proc], lambda: None


#: Past the expiry of every backend here (ttl 2 s, sessions 3 s): the paused client's lease ends.
CLIENT_PAUSE_SECONDS = 2 * SESSION_TIMEOUT + 1

CLIENT_FAULTS = [
    Fault("the holder paused past its lease (SIGSTOP)", _pause_holder, seconds=CLIENT_PAUSE_SECONDS,
          ends_leases=False),
    Fault("a client paused past its lease (SIGSTOP)", _pause_client, seconds=CLIENT_PAUSE_SECONDS, ends_leases=False),
    Fault("a client killed (SIGKILL)", _kill_client, seconds=1.0, ends_leases=False),
]


def _pause_server(deployment, rng):
    server = rng.choice(deployment.servers)
    server.pause()
    return [server.name], server.resume


def _restart_server_empty(deployment, rng):
    server = rng.choice(deployment.servers)
    server.kill()
    return [server.name], server.start


def _kill_servers(count):
    def kill(deployment, rng):
        victims = rng.sample(deployment.servers, count)
        for server in victims:
            server.kill()

        def restart():
            for server in victims:
                server.start()
        return [server.name for server in victims], restart
    return kill


REDIS_FAULTS = [
    Fault("server paused (SIGSTOP)", _pause_server, seconds=2.5),
    Fault("server restarted without persistence", _restart_server_empty, seconds=0.5, forgets_grants=True),
]

#: Masters come back after the ttl (2 s), empty: the delayed restart the Redis docs ask for.
REDLOCK_FAULTS = [
    Fault("a master paused (SIGSTOP)", _pause_server, seconds=2.5),
    Fault("2 of 5 masters killed", _kill_servers(2), seconds=3.0),
    Fault("3 of 5 masters killed", _kill_servers(3), seconds=3.0),
]


def episode(run, deployment, fault, *, rng):
    """Start ``fault``, keep it for about its ``seconds``, undo it and restore the deployment."""
    targets, undo = fault.start(deployment, rng)
    links = deployment.network.links_cut() if deployment.network is not None else {}
    # One client hit is the fault's ``target``: only that client's sections can it explain.
    target = targets[0] if not fault.ends_leases and len(targets) == 1 else None
    run.nemesis.record("fault", what=fault.name, phase="start", target=target, targets=targets, links_cut=links,
                       ends_leases=fault.ends_leases)
    try:
        time.sleep(fault.seconds * rng.uniform(0.8, 1.2))
    finally:
        undo()
        # The fault lasts until the servers are healthy again: a paused etcd leader that resumes still
        # believes it leads for a moment, and a lease granted meanwhile can be gone right after.
        try:
            deployment.restore()
        finally:
            run.nemesis.record("fault", what=fault.name, phase="end", target=target, targets=targets,
                               ends_leases=fault.ends_leases)


def contend(run, deployment, faults, *, name, row, rng, ttl=2.0, via="lease", hold=(0.01, 0.05), settle=1.0):
    """The clients loop on ``name`` (claim + increment of ``row``) while each of ``faults`` happens in turn.

    Return the clients' counts; a client killed by a fault has none (``{"killed": True}``).
    """
    stop = run.directory / f"stop-{name.rsplit(':', 1)[-1]}"
    deployment.lock, deployment.history_dir = name, run.directory
    loops = [(client, client.send("loop", name=name, count=10**9, ttl=ttl, timeout=10, row=row, via=via, hold=hold,
                                  seed=rng.randrange(2**32), stop=str(stop)))
             for client in deployment.clients if client.alive]
    try:
        wait_until(time.monotonic() + settle * rng.uniform(0.5, 1.0))
        for fault in faults:
            episode(run, deployment, fault, rng=rng)
            wait_until(time.monotonic() + settle * rng.uniform(0.5, 1.0))
    finally:
        deployment.restore()
        stop.touch()
    counts = []
    for client, loop in loops:
        if not client.alive:
            counts.append({"killed": True})
            continue
        counts.append(client.result(loop, wait=120))
    return counts


def partitions_during_contention(run, backend, deployment, faults, *, clients=4, seed=0, scenario):
    """Clients contend for one lock (claim + increment through ``FencedModel``) while ``faults`` happen in turn.

    Every fault is one run of the ``Result``. Acquisitions that fail are reported, not violations:
    a fault may make the cluster unavailable; what must never happen is a stale write accepted, an
    acknowledged increment lost, or a token issued twice or out of order.
    """
    deployment.clients = run.spawn(*[f"contender-{i}" for i in range(clients)])
    name = run.lock_name()
    row = run.row() if run.fenced else None
    counts = contend(run, deployment, faults, name=name, row=row, rng=random.Random(seed), ttl=10.0)
    run.close()
    result = run.judge(scenario, backend, len(faults), expect_overlap=CUT_OFF_OVERLAP)
    failed = sum(count.get("failed", 0) for count in counts)
    acquired = sum(count.get("acquired", 0) for count in counts)
    result.notes.append(f"{acquired} acquisitions, {failed} failed during faults: "
                        + ", ".join(fault.name for fault in faults))
    if not acquired:
        result.violations.append("no acquisition succeeded")
    return result


def spawn_on_host(run, network, proc, host_name, stack):
    """Start client ``proc`` on a test host of its own, so that its links to the lock service can be cut.

    The fenced store stays reachable (a database the partition does not touch): a PostgreSQL store is
    reached through a ``FaultProxy`` on the bridge, closed by ``stack`` (an ``ExitStack``).
    """
    host = network.hosts.get(host_name) or network.add_host(host_name)
    databases = json.loads((run.env or {}).get("DISTLOCK_FAULTS_DATABASES", "{}"))
    if run.store is not None:
        alias = run.store.config["database"]
        entry = dict(settings.DATABASES[alias])
        if entry.get("HOST"):
            proxy = stack.enter_context(FaultProxy(int(entry["PORT"]), entry["HOST"],
                                                   listen_host=network.client_address))
            databases[alias] = {**entry, "HOST": network.client_address, "PORT": proxy.port}
    (client,) = run.spawn(proc, env={"DISTLOCK_FAULTS_DATABASES": json.dumps(databases)},
                          exec_prefix=host.exec_prefix())
    return client, host


def holder_cut_from_the_majority(run, backend, cluster, network, stack, *, runs, ttl=30.0):
    """The holder's client keeps only one member, which is cut from the other two: the majority moves on.

    The holder's session (ZooKeeper) or lease (etcd) can no longer be renewed; once the majority has
    expired it, a waiting client gets the lock with a greater token. The old holder, still in its
    critical section, must not trust its lease, and the store must refuse its write.
    """
    holder, host = spawn_on_host(run, network, "cut-holder", "cl1", stack)
    (waiter,) = run.spawn("waiter")
    rng = random.Random(runs)
    for _ in range(runs):
        name, row, held = enter_new_lock(run, holder, ttl=ttl, timeout=30)
        waiting = waiter.send("acquire", name=name, ttl=ttl, timeout=60)
        minority = rng.choice(cluster.members)
        majority = [member.host.name for member in cluster.members if member is not minority]
        network.partition([host.name, minority.host.name], majority)
        run.nemesis.record("fault", what="holder's client cut from the majority", phase="start", target=holder.proc,
                           owner=held["owner"], lock=name, links_cut=network.links_cut())
        try:
            taken = waiter.result(waiting, wait=SESSION_TIMEOUT + RECOVERY_SLACK + 30)
            assert taken["token"] > held["token"], (taken, held)
            scenarios.take_turn(waiter, name, row)
        finally:
            network.heal()
            run.nemesis.record("fault", what="holder's client cut from the majority", phase="end",
                               target=holder.proc)
        cluster.wait_healthy(60)
        assert holder.call("check", name=name)["state"] != "valid", "the cut-off holder must not trust its lease"
        write_stale_and_leave(holder, name, row)
    run.close()
    return run.judge(f"{backend}: holder's client cut from the majority", backend, runs,
                     expect_overlap=LOST_LEASE_OVERLAP)
