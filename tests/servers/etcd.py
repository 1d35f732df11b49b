"""A private etcd cluster on loopback: members that start, stop, crash, pause and report who leads.

Each member runs ``/usr/bin/etcd`` (Debian package ``etcd-server``, 3.4) with its own data dir and
log, on free loopback client and peer ports. Timing is etcd's default (heartbeat 100 ms, election
timeout 1 s), so the shortest lease etcd grants is 2 s (1.5 x election timeout, rounded up): a
shared 2-core machine makes shorter election timeouts flap. Health and leadership are read through
etcd's JSON gateway (``/health``, ``/v3/maintenance/status``), so the harness needs no gRPC client;
``leases()``, ``keys()`` and ``revoke_lease()`` inspect and disturb the cluster the same way, from
outside the client under test.

A cluster can also be secured like a production one: TLS on the client port with a throwaway CA
made by ``openssl`` at test time (``make_pki``), client certificates required (``--client-cert-auth``),
and etcd auth enabled (``enable_auth``: a root user with a password, through the same gateway).
"""

import base64
import json
import ssl
import subprocess
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from tests.servers import Cluster, ClusterMember, free_port, port_open

ETCD_BINARY = "/usr/bin/etcd"

#: Milliseconds; etcd's defaults. The minimum lease TTL etcd grants is ceil(1.5 x ELECTION_TIMEOUT_MS) s.
HEARTBEAT_INTERVAL_MS = 100
ELECTION_TIMEOUT_MS = 1000


@dataclass(frozen=True)
class TestPKI:
    """PEM files of a throwaway CA, a server certificate for 127.0.0.1 signed by it, a client certificate
    signed by it, and an unrelated CA (for "wrong CA" tests)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    #: The harness's own client certificate, without a CommonName: with auth enabled, etcd 3.4's JSON
    #: gateway refuses a client certificate that has one ("CommonName ... will be ignored").
    harness_cert: Path
    harness_key: Path

    def client_context(self):
        """An ``ssl`` context that trusts the CA and presents the harness's certificate (for the gateway)."""
        context = ssl.create_default_context(cafile=str(self.ca))
        context.load_cert_chain(str(self.harness_cert), str(self.harness_key))
        return context


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def make_pki(directory):
    """Write a CA, a server and a client certificate (EC P-256, valid 2 days) into ``directory`` with openssl."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca in ("ca", "other-ca"):
        _openssl("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2",
                 "-subj", f"/CN=distlock-test-{ca}", "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=directory)
    for name, usage, extra, subject in (
            ("server", "serverAuth,clientAuth", "subjectAltName=IP:127.0.0.1,DNS:localhost", "/CN=127.0.0.1"),
            ("client", "clientAuth", "", "/CN=distlock-test-client"),
            ("harness", "clientAuth", "", "/O=distlock-test-harness")):
        (directory / f"{name}.ext").write_text(f"extendedKeyUsage={usage}\n{extra}\n")
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=directory)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=directory)
    return TestPKI(ca=directory / "ca.pem", server_cert=directory / "server.pem", server_key=directory / "server.key",
                   client_cert=directory / "client.pem", client_key=directory / "client.key",
                   other_ca=directory / "other-ca.pem", harness_cert=directory / "harness.pem",
                   harness_key=directory / "harness.key")


def gateway_call(port, path, body=None, timeout=1.0, tls=None, token=None, ip="127.0.0.1"):
    """POST ``body`` (GET if None) to etcd's JSON gateway on ip:port; return the JSON reply or None.

    ``tls``: the ``TestPKI`` of a TLS cluster (https, client certificate); ``token``: an auth token.
    """
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = token
    scheme = "https" if tls else "http"
    request = urllib.request.Request(f"{scheme}://{ip}:{port}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout,  # noqa: S310 - loopback only
                                    context=tls.client_context() if tls else None) as reply:
            return json.loads(reply.read())
    except (OSError, urllib.error.URLError, ValueError):
        return None


class EtcdMember(ClusterMember):
    """One member of a cluster. ``ready()`` means the process listens for peers; ``healthy`` means it serves.

    A member cannot serve clients before a quorum exists, so ``start()`` returns as soon as the
    process is up and ``EtcdCluster.wait_healthy()`` waits for the quorum: members can be restarted
    one at a time by the fault suite.
    """

    def __init__(self, name, client_port, peer_port, initial_cluster, cluster_token, workdir, pki=None, host=None):
        self.member_name = name
        self.peer_port = peer_port
        #: "name=http://ip:peer,..." for the whole cluster, shared by every member.
        self.initial_cluster = initial_cluster
        self.cluster_token = cluster_token
        #: A ``TestPKI``: the client port speaks TLS and requires client certificates signed by its CA.
        self.pki = pki
        #: The auth token the harness's gateway calls carry once auth is enabled (``EtcdCluster.enable_auth``).
        self.token = None
        super().__init__(f"etcd-{name}", client_port, workdir, host)
        self.data_dir = self.workdir / "data"

    def gateway(self, path, body=None, timeout=1.0):
        return gateway_call(self.client_port, path, body, timeout, tls=self.pki, token=self.token, ip=self.ip)

    def command(self):
        client_url = f"{'https' if self.pki else 'http'}://{self.ip}:{self.client_port}"
        peer_url = f"http://{self.ip}:{self.peer_port}"
        tls = [] if self.pki is None else [
            "--cert-file", str(self.pki.server_cert), "--key-file", str(self.pki.server_key),
            "--trusted-ca-file", str(self.pki.ca), "--client-cert-auth",
        ]
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
            *tls,
        ]

    def ready(self):
        return port_open(self.peer_port, host=self.ip)

    @property
    def healthy(self):
        """True if the member answers clients and sees a leader."""
        reply = self.gateway("/health")
        return bool(reply) and reply.get("health") == "true"

    def status(self):
        """Return the member's ``/v3/maintenance/status`` reply (member id, leader id, raft term), or None."""
        if not self.running:
            return None
        return self.gateway("/v3/maintenance/status", {})

    @property
    def leads(self):
        """True if the member's status names the member itself as the leader."""
        status = self.status()
        return bool(status) and status.get("leader") == status.get("header", {}).get("member_id")


class EtcdCluster(Cluster):
    """Three (or ``size``) members, each in its own directory under ``workdir``.

    On free loopback ports, or, given a ``tests.servers.netns.TestNetwork``, each member on a test host
    of its own ("et1", "et2"...) with etcd's usual ports: links between members can then be cut.
    """

    service = "etcd"

    def __init__(self, workdir, size=3, tls=False, network=None):
        """``tls``: serve clients over TLS with client certificates required, from a CA made in ``workdir``."""
        self.workdir = Path(workdir)
        self.pki = make_pki(self.workdir / "pki") if tls else None
        if network is None:
            hosts = [None] * size
            ports = [(free_port(), free_port()) for _ in range(size)]
        else:
            hosts = [network.add_host(f"et{i}") for i in range(1, size + 1)]
            ports = [(2379, 2380)] * size
        ips = [host.address if host else "127.0.0.1" for host in hosts]
        initial_cluster = ",".join(f"m{i}=http://{ip}:{peer}" for i, (ip, (_, peer)) in enumerate(zip(ips, ports), 1))
        token = f"distlock-{uuid.uuid4().hex[:8]}"
        self.members = [
            EtcdMember(f"m{i}", client, peer, initial_cluster, token, self.workdir / f"member-{i}", pki=self.pki,
                       host=host)
            for i, (host, (client, peer)) in enumerate(zip(hosts, ports), 1)
        ]

    @property
    def endpoints(self):
        """The ``ENDPOINTS`` option: "ip1:c1,ip2:c2,ip3:c3" (https://... with TLS)."""
        scheme = "https://" if self.pki else ""
        return ",".join(scheme + member.address for member in self.members)

    def tls_options(self):
        """The backend options that trust this cluster's CA and present the client certificate."""
        return {"CA_CERT": str(self.pki.ca), "CERT_CERT": str(self.pki.client_cert),
                "CERT_KEY": str(self.pki.client_key)}

    def enable_auth(self, password, user="root"):
        """Add ``user`` with the root role and ``password``, enable etcd auth, and sign the harness in.

        Done through the JSON gateway (the API ``etcdctl user add`` / ``etcdctl auth enable`` call), so the
        harness needs no etcdctl.
        """
        for path, body in (("/v3/auth/user/add", {"name": user, "password": password}),
                           ("/v3/auth/user/grant", {"user": user, "role": "root"}),
                           ("/v3/auth/enable", {})):
            self._gateway(path, body)
        token = self._gateway("/v3/auth/authenticate", {"name": user, "password": password})["token"]
        for member in self.members:
            member.token = token

    def _gateway(self, path, body):
        for member in self.members:
            if member.running:
                reply = member.gateway(path, body, timeout=5)
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
