"""A private etcd cluster on loopback: members that start, stop, crash, pause and report who leads.

Each member runs ``/usr/bin/etcd`` (Debian package ``etcd-server``, 3.4) with its own data dir and
log, on free loopback client and peer ports. Timing is etcd's default (heartbeat 100 ms, election
timeout 1 s), so the shortest lease etcd grants is 2 s (1.5 x election timeout, rounded up): a
shared 2-core machine makes shorter election timeouts flap. Health and leadership are read through
etcd's JSON gateway (``/health``, ``/v3/maintenance/status``), so the harness needs no gRPC client;
``leases()``, ``keys()`` and ``revoke_lease()`` inspect and disturb the cluster the same way, from
outside the client under test.
"""

import base64
import json
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from tests.servers import Cluster, ClusterMember, free_port, port_open

ETCD_BINARY = "/usr/bin/etcd"

#: Milliseconds; etcd's defaults. The minimum lease TTL etcd grants is ceil(1.5 x ELECTION_TIMEOUT_MS) s.
HEARTBEAT_INTERVAL_MS = 100
ELECTION_TIMEOUT_MS = 1000


def gateway_call(port, path, body=None, timeout=1.0):
    """POST ``body`` (GET if None) to etcd's JSON gateway on 127.0.0.1:port; return the JSON reply or None."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:  # noqa: S310 - loopback http only
            return json.loads(reply.read())
    except (OSError, urllib.error.URLError, ValueError):
        return None


class EtcdMember(ClusterMember):
    """One member of a cluster. ``ready()`` means the process listens for peers; ``healthy`` means it serves.

    A member cannot serve clients before a quorum exists, so ``start()`` returns as soon as the
    process is up and ``EtcdCluster.wait_healthy()`` waits for the quorum: members can be restarted
    one at a time by the fault suite.
    """

    def __init__(self, name, client_port, peer_port, initial_cluster, cluster_token, workdir):
        self.member_name = name
        self.peer_port = peer_port
        #: "name=http://127.0.0.1:peer,..." for the whole cluster, shared by every member.
        self.initial_cluster = initial_cluster
        self.cluster_token = cluster_token
        super().__init__(f"etcd-{name}", client_port, workdir)
        self.data_dir = self.workdir / "data"

    def command(self):
        client_url = f"http://127.0.0.1:{self.client_port}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        return [
            ETCD_BINARY, "--name", self.member_name, "--data-dir", str(self.data_dir),
            "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            # Ignored once the data dir exists, so a restarted member rejoins its cluster.
            "--initial-cluster", self.initial_cluster, "--initial-cluster-state", "new",
            "--initial-cluster-token", self.cluster_token,
            "--heartbeat-interval", str(HEARTBEAT_INTERVAL_MS), "--election-timeout", str(ELECTION_TIMEOUT_MS),
            # A member coming back from a pause or restart must not depose a working leader.
            "--pre-vote",
            "--logger", "zap", "--log-outputs", "stderr",
        ]

    def ready(self):
        return port_open(self.peer_port)

    @property
    def healthy(self):
        """True if the member answers clients and sees a leader."""
        reply = gateway_call(self.client_port, "/health")
        return bool(reply) and reply.get("health") == "true"

    def status(self):
        """Return the member's ``/v3/maintenance/status`` reply (member id, leader id, raft term), or None."""
        if not self.running:
            return None
        return gateway_call(self.client_port, "/v3/maintenance/status", {})

    @property
    def leads(self):
        """True if the member's status names the member itself as the leader."""
        status = self.status()
        return bool(status) and status.get("leader") == status.get("header", {}).get("member_id")


class EtcdCluster(Cluster):
    """Three (or ``size``) members on free loopback ports, each in its own directory under ``workdir``."""

    service = "etcd"

    def __init__(self, workdir, size=3):
        self.workdir = Path(workdir)
        ports = [(free_port(), free_port()) for _ in range(size)]
        initial_cluster = ",".join(f"m{i}=http://127.0.0.1:{peer}" for i, (_, peer) in enumerate(ports, 1))
        token = f"distlock-{uuid.uuid4().hex[:8]}"
        self.members = [
            EtcdMember(f"m{i}", client, peer, initial_cluster, token, self.workdir / f"member-{i}")
            for i, (client, peer) in enumerate(ports, 1)
        ]

    @property
    def endpoints(self):
        """The ``ENDPOINTS`` option: "127.0.0.1:c1,127.0.0.1:c2,127.0.0.1:c3"."""
        return ",".join(member.address for member in self.members)

    def _gateway(self, path, body):
        for member in self.members:
            if member.running:
                reply = gateway_call(member.client_port, path, body, timeout=5)
                if reply is not None:
                    return reply
        raise RuntimeError(f"no etcd member answered {path}")

    def leases(self):
        """Return the ids of every live lease (the lease list API), for leak tests."""
        return [int(lease["ID"]) for lease in self._gateway("/v3/lease/leases", {}).get("leases", [])]

    def keys(self, prefix):
        """Return ``(key, create_revision, lease_id)`` of every key starting with ``prefix`` (bytes), in key order."""
        end = prefix[:-1] + bytes([prefix[-1] + 1])
        reply = self._gateway("/v3/kv/range", {"key": base64.b64encode(prefix).decode(),
                                               "range_end": base64.b64encode(end).decode()})
        return [(base64.b64decode(kv["key"]), int(kv.get("create_revision", 0)), int(kv.get("lease", 0)))
                for kv in reply.get("kvs", [])]

    def revoke_lease(self, lease_id):
        """Revoke a lease as an operator would: etcd deletes every key attached to it."""
        self._gateway("/v3/lease/revoke", {"ID": str(lease_id)})


def start_etcd(tmp):
    """The 3-member cluster of the contract suite."""
    cluster = EtcdCluster(f"{tmp}/etcd").start()
    return {"DISTLOCK_TEST_ETCD_ENDPOINTS": cluster.endpoints}, cluster.members
