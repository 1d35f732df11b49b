"""Private redis-servers on their own loopback ports: one, optionally TLS-only and with ACL users, a
Sentinel deployment (a master, its replica and three Sentinels), or a Redis Cluster of three masters."""

import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import quote, urlencode

import redis

from tests.servers import ManagedProcess, free_port, port_open, wait_until


def make_tls_files(directory):
    """Write a throwaway CA, a server certificate for 127.0.0.1/localhost and a client certificate; return their paths.

    EC keys (fast to make), valid for two days, made with ``openssl`` at test time: nothing secret is
    kept in the repository. Files already there are reused.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = {name: directory / name for name in
             ("ca.crt", "ca.key", "server.crt", "server.key", "client.crt", "client.key")}
    if all(path.exists() for path in paths.values()):
        return paths
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def openssl(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=directory)

    openssl("req", "-x509", *key, "-days", "2", "-subj", "/CN=distlock test CA", "-keyout", "ca.key", "-out", "ca.crt")
    extensions = directory / "san.cnf"
    extensions.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for who in ("server", "client"):
        openssl("req", *key, "-subj", f"/CN=distlock test {who}", "-keyout", f"{who}.key", "-out", f"{who}.csr")
        openssl("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-days", "2", "-out", f"{who}.crt", "-extfile", "san.cnf")
    return paths


class RedisServer(ManagedProcess):
    """redis-server without persistence by default (``--save '' --appendonly no``), like a cache node.

    ``persistent=True`` gives ``appendonly yes`` + ``appendfsync always`` for the fault scenarios
    that compare the two.

    ``tls=True`` serves TLS only (``--port 0 --tls-port``), with certificates from ``make_tls_files``
    and client certificates required (``tls-auth-clients yes``). ``password`` is the default user's
    (``requirepass``); ``users`` maps ACL user names to ``(password, rules)``, e.g.
    ``{"locks": ("secret", "~distlock:* &* +@all")}``. ``url`` connects as the default user with
    whatever it needs; ``url_for()`` as another user.
    """

    def __init__(self, port=None, *, persistent=False, workdir=None, name=None, tls=False, password=None,
                 users=None):
        self.port = port or free_port()
        super().__init__(name or f"redis-{self.port}", workdir)
        self.persistent = persistent
        self.tls = tls
        self.password = password
        self.users = dict(users or {})
        self.tls_files = None

    @property
    def url(self):
        return self.url_for(None, self.password)

    def url_for(self, username, password, *, tls_parameters=True):
        """The URL of this server as ``username`` (None: the default user), TLS parameters included if ``tls``."""
        scheme = "rediss" if self.tls else "redis"
        userinfo = ""
        if password is not None:
            userinfo = f"{quote(username or '', safe='')}:{quote(password, safe='')}@"
        query = f"?{urlencode(self.tls_parameters())}" if self.tls and tls_parameters else ""
        return f"{scheme}://{userinfo}127.0.0.1:{self.port}/0{query}"

    def tls_parameters(self):
        """redis-py's TLS keyword arguments for this server, as ``from_url`` takes them from a URL's query."""
        files = self.tls_files or make_tls_files(self.workdir / "tls")
        return {"ssl_ca_certs": str(files["ca.crt"]), "ssl_certfile": str(files["client.crt"]),
                "ssl_keyfile": str(files["client.key"]), "ssl_cert_reqs": "required"}

    def prepare(self):
        if self.tls:
            self.tls_files = make_tls_files(self.workdir / "tls")

    def command(self):
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.persistent else [
            "--save", "", "--appendonly", "no"]
        if self.tls:
            files = self.tls_files
            listen = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(files["server.crt"]),
                      "--tls-key-file", str(files["server.key"]), "--tls-ca-cert-file", str(files["ca.crt"]),
                      "--tls-auth-clients", "yes"]
        else:
            listen = ["--port", str(self.port)]
        security = ["--requirepass", self.password] if self.password is not None else []
        for user, (password, rules) in self.users.items():
            security += ["--user", user, "on", f">{password}", *rules.split()]
        return [binary, "--bind", "127.0.0.1", *listen, "--dir", str(self.workdir),
                "--daemonize", "no", "--protected-mode", "no", *persistence, *security]

    def ready(self):
        return port_open(self.port) and "Ready to accept connections" in self.new_logs()


def start_redis(tmp):
    """The single Redis instance of the contract suite."""
    server = RedisServer(workdir=f"{tmp}/redis").start()
    return {"DISTLOCK_TEST_REDIS_URL": server.url}, [server]


def start_redlock(tmp):
    """Five independent Redis masters for the Redlock backend."""
    servers = [RedisServer(workdir=f"{tmp}/redlock-{i}").start() for i in range(5)]
    return {"DISTLOCK_TEST_REDLOCK_URLS": ",".join(server.url for server in servers)}, servers


# -- Redis Sentinel ----------------------------------------------------------------------------------------

class SentinelNode(RedisServer):
    """A data node of a ``SentinelDeployment``: a ``RedisServer`` that starts as a replica if told to.

    Everybody reaches it at ``address_port``: its own port, or the port of a proxy in front of it.
    It announces that port to its master (``replica-announce-port``), so the Sentinels, which find
    replicas in the master's ``INFO``, reach it there too.
    """

    def __init__(self, *, workdir, name, password=None):
        super().__init__(workdir=workdir, name=name, password=password)
        self.address_port = self.port
        #: The address port of the master to replicate from at the next start, or None to start as a master.
        self.replica_of = None

    def command(self):
        command = [*super().command(), "--replica-announce-ip", "127.0.0.1",
                   "--replica-announce-port", str(self.address_port), "--repl-diskless-sync-delay", "0"]
        if self.password is not None:
            command += ["--masterauth", self.password]
        if self.replica_of is not None:
            command += ["--replicaof", "127.0.0.1", str(self.replica_of)]
        return command

    def client(self):
        """Return a redis-py client on the node's own port (not through its proxy), for the test's inspections."""
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5)

    def replication(self):
        """Return the node's ``INFO replication``."""
        with self.client() as client:
            return client.info("replication")


class SentinelServer(ManagedProcess):
    """One ``redis-server --sentinel`` watching ``service``, whose master starts at 127.0.0.1:``master_port``.

    The configuration file is written once; Sentinel rewrites it with what it learns (replicas, the
    other Sentinels, the current master), so a restarted Sentinel remembers it.
    """

    def __init__(self, *, workdir, name, service, master_port, quorum, down_after_ms, failover_timeout_ms,
                 password=None):
        self.port = free_port()
        super().__init__(name, workdir)
        self.service = service
        self.master_port = master_port
        self.quorum = quorum
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.password = password
        self.config_path = self.workdir / "sentinel.conf"

    def prepare(self):
        if self.config_path.exists():
            return
        lines = [f"port {self.port}", "bind 127.0.0.1", "daemonize no", "protected-mode no", f"dir {self.workdir}",
                 f"sentinel monitor {self.service} 127.0.0.1 {self.master_port} {self.quorum}",
                 f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}",
                 f"sentinel failover-timeout {self.service} {self.failover_timeout_ms}",
                 f"sentinel parallel-syncs {self.service} 1"]
        if self.password is not None:
            lines += [f"requirepass {self.password}", f"sentinel sentinel-pass {self.password}",
                      f"sentinel auth-pass {self.service} {self.password}"]
        self.config_path.write_text("\n".join(lines) + "\n")

    def command(self):
        return [shutil.which("redis-server") or "/usr/bin/redis-server", str(self.config_path), "--sentinel"]

    def ready(self):
        return port_open(self.port) and "+monitor master" in self.new_logs()

    def ask(self, *args):
        """Return the reply to ``SENTINEL <args> <service>``, unparsed: redis-py parses these differently by release."""
        with redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5,
                         decode_responses=True) as client:
            return client.execute_command("SENTINEL", *args, self.service)

    def named_master_port(self):
        """Return the port at which this Sentinel says the service's master is, or None if it says none."""
        address = self.ask("GET-MASTER-ADDR-BY-NAME")
        return None if address is None else int(address[1])

    def master_flags(self):
        """Return the flags this Sentinel gives the service's master: {"master"} unless it thinks it down or fails it over."""
        fields = self.ask("MASTER")
        fields = fields if isinstance(fields, dict) else dict(zip(fields[::2], fields[1::2]))
        return set(fields["flags"].split(","))

    def replicas(self):
        """Return what this Sentinel knows of the service's replicas: one dict of its fields per replica.

        RESP3 (redis-py 8's default) sends each as a map, RESP2 as a flat list of names and values.
        """
        return [fields if isinstance(fields, dict) else dict(zip(fields[::2], fields[1::2]))
                for fields in self.ask("REPLICAS")]


class SentinelDeployment:
    """One master, one replica and three Sentinels (quorum 2) on loopback ports of their own.

    ``front(port)``, if given, returns a started proxy (with ``port`` and ``stop()``) in front of a
    node's port: every client, Sentinel and replica then reaches that node through it, so a test can
    stall the replication stream of one node alone. ``password`` is the nodes' and the Sentinels'.
    ``down_after_ms`` is how long a master must not answer before a Sentinel thinks it down;
    ``failover_timeout_ms`` bounds a failover that stalls (and spaces two failovers of one master by
    twice that).
    """

    #: The Sentinel service name, as URLs give it: ``redis://distlock/0``.
    service = "distlock"

    def __init__(self, workdir, *, front=None, password=None, down_after_ms=1000, failover_timeout_ms=3000):
        self.workdir = Path(workdir)
        self.front = front
        self.password = password
        self.nodes = [SentinelNode(workdir=self.workdir / f"node-{i}", name=f"sentinel-node-{i}", password=password)
                      for i in range(2)]
        self.proxies = {}
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.sentinels = []

    # -- what tests configure distlock with ------------------------------------------------------------

    @property
    def url(self):
        """The alias's ``URL``: the service, with the nodes' password."""
        userinfo = f":{quote(self.password, safe='')}@" if self.password is not None else ""
        return f"redis://{userinfo}{self.service}/0"

    @property
    def sentinel_addresses(self):
        """The alias's ``SENTINELS``."""
        return [("127.0.0.1", sentinel.port) for sentinel in self.sentinels]

    @property
    def sentinel_kwargs(self):
        """The alias's ``SENTINEL_KWARGS``."""
        return {"password": self.password} if self.password is not None else {}

    def options(self, **more):
        """Return ``OPTIONS`` of an alias on this deployment."""
        return {"URL": self.url, "SENTINELS": self.sentinel_addresses, "SENTINEL_KWARGS": self.sentinel_kwargs,
                **more}

    # -- life ---------------------------------------------------------------------------------------

    def start(self, timeout=60):
        """Start the master, then its replica, then the Sentinels; return once each Sentinel knows them all."""
        try:
            self._start(timeout)
        except BaseException:
            self.cleanup()
            raise
        return self

    def _start(self, timeout):
        master, replica = self.nodes
        for node in self.nodes:
            if self.front is not None:
                self.proxies[node] = self.front(node.port)
                node.address_port = self.proxies[node].port
        master.start()
        replica.replica_of = master.address_port
        replica.start()
        wait_until(lambda: self._synced(replica), timeout, "the replica's first sync")
        for i in range(3):
            self.sentinels.append(SentinelServer(
                workdir=self.workdir / f"sentinel-{i}", name=f"sentinel-{i}", service=self.service,
                master_port=master.address_port, quorum=2, down_after_ms=self.down_after_ms,
                failover_timeout_ms=self.failover_timeout_ms, password=self.password))
            self.sentinels[-1].start()
        self.wait_settled(timeout)

    def wait_settled(self, timeout=60):
        """Wait until the deployment is settled and stays so for twice ``down_after_ms``.

        Settled: every Sentinel names one master, with no failover under way or wanted, sees its
        replica up and in sync, and knows the other two; the replica says it is one. It must stay so,
        because right after a failover a Sentinel that could not reach the promoted master for
        ``down_after_ms`` (its connections were killed by the promotion) starts another failover.
        """
        settled_since = []

        def settled_now():
            ports = {sentinel.named_master_port() for sentinel in self.sentinels}
            if ports != {self.master().address_port} or not self._synced(self.replica()):
                return False
            for sentinel in self.sentinels:
                if sentinel.master_flags() != {"master"}:
                    return False
                if len(sentinel.ask("SENTINELS")) != len(self.sentinels) - 1:
                    return False
                if not any(int(replica["port"]) == self.replica().address_port and "s_down" not in replica["flags"]
                           and replica["master-link-status"] == "ok" for replica in sentinel.replicas()):
                    return False
            return True

        def settled():
            if not settled_now():
                settled_since.clear()
                return False
            settled_since[:1] = settled_since[:1] or [time.monotonic()]
            return time.monotonic() - settled_since[0] >= 2 * self.down_after_ms / 1000

        try:
            wait_until(settled, timeout, "the Sentinel deployment")
        except TimeoutError:
            logs = "\n".join(f"--- {process.name}\n{process.new_logs()[-3000:]}"
                             for process in [*self.nodes, *self.sentinels])
            raise TimeoutError(f"the Sentinels did not settle within {timeout}s:\n{logs}") from None

    @staticmethod
    def _synced(node):
        try:
            return node.replication().get("master_link_status") == "up"
        except redis.RedisError:
            return False

    def master(self):
        """Return the running node that says it is a master (the one the Sentinels name once settled)."""
        for node in self.nodes:
            if node.running:
                try:
                    if node.replication()["role"] == "master":
                        return node
                except redis.RedisError:
                    continue
        raise LookupError("no running node is a master")

    def replica(self):
        """Return the node that is not the master."""
        master = self.master()
        return next(node for node in self.nodes if node is not master)

    def replica_behind(self):
        """Return how many bytes of the master's replication stream the replica has not processed (``INFO``).

        None while the replica has no link to the master: a restarted node, or one a Sentinel has just
        told again whom to replicate, reports no offset until it has synced.
        """
        master_offset = self.master().replication()["master_repl_offset"]
        replica = self.replica().replication()
        if replica.get("master_link_status") != "up" or "slave_repl_offset" not in replica:
            return None
        return master_offset - replica["slave_repl_offset"]

    def fail_over(self, timeout=30):
        """Kill the master (SIGKILL) and return the replica once every Sentinel names it the master and it says so."""
        old, new = self.master(), self.replica()
        old.kill()
        wait_until(lambda: self._promoted(new), timeout, "the failover to the replica")
        return new

    def switch_over(self, timeout=30):
        """Ask a Sentinel for a failover (``SENTINEL FAILOVER``) of the running master; return the new master.

        The old master keeps running, and is made a replica of the new one here, as the Sentinels
        would do themselves after about 10 to 20 s (their ``+convert-to-slave``); they see it as one
        on their next ``INFO`` of it, within 10 s.
        """
        old, new = self.master(), self.replica()
        self.sentinels[0].ask("FAILOVER")
        wait_until(lambda: self._promoted(new), timeout, "the switch-over to the replica")
        with old.client() as client:
            client.replicaof("127.0.0.1", new.address_port)
        wait_until(lambda: self._synced(old), timeout, "the demoted master's sync")
        return new

    def _promoted(self, node):
        """True once ``node`` says it is a master and every Sentinel names it."""
        try:
            return (node.replication()["role"] == "master"
                    and all(sentinel.named_master_port() == node.address_port for sentinel in self.sentinels))
        except redis.RedisError:
            return False

    def restore(self, timeout=60):
        """Start the killed node again, as a replica of the current master, and wait until the Sentinels see it."""
        master = self.master()
        for node in self.nodes:
            if not node.running:
                node.replica_of = master.address_port
                node.start()
        wait_until(lambda: self._synced(self.replica()), timeout, "the restarted replica's sync")
        self.wait_settled(timeout)

    def cleanup(self):
        for process in [*self.sentinels, *self.nodes]:
            process.cleanup()
        for proxy in self.proxies.values():
            proxy.stop()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.cleanup()


# -- Redis Cluster ---------------------------------------------------------------------------------------

class ClusterNode(RedisServer):
    """A master of a ``RedisClusterDeployment``: a ``RedisServer`` with ``cluster-enabled yes``.

    Its cluster bus gets a free port of its own (``cluster-port``): the default, the client port plus
    10000, may be taken, or beyond 65535.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.bus_port = free_port()

    def command(self):
        return [*super().command(), "--cluster-enabled", "yes", "--cluster-config-file",
                str(self.workdir / "nodes.conf"), "--cluster-port", str(self.bus_port),
                "--cluster-node-timeout", "2000"]

    def client(self):
        """Return a redis-py client on this node alone (no cluster routing), for the test's inspections."""
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5)

    def cluster_state(self):
        """Return ``cluster_state`` of the node's ``CLUSTER INFO`` ("ok" once every slot is served), or None."""
        try:
            with self.client() as client:
                info = client.execute_command("CLUSTER", "INFO")
        except redis.RedisError:
            return None
        info = info.decode() if isinstance(info, bytes) else info
        return dict(line.split(":", 1) for line in info.split() if ":" in line).get("cluster_state")


class RedisClusterDeployment:
    """Three masters on loopback ports of their own, the 16384 slots split among them by ``redis-cli --cluster create``.

    ``replicas``: replicas per master (0 for the contract suite, which needs keys on several masters, not
    failover); a master that does not answer for ``cluster-node-timeout`` (2 s) is replaced by its replica.
    """

    def __init__(self, workdir, *, masters=3, replicas=0):
        self.workdir = Path(workdir)
        self.replicas = replicas
        self.nodes = [ClusterNode(workdir=self.workdir / f"node-{i}", name=f"cluster-node-{i}")
                      for i in range(masters * (1 + replicas))]

    @property
    def url(self):
        """The alias's ``URL``: one node, from which the backend learns the others."""
        return f"redis://127.0.0.1:{self.nodes[0].port}/0"

    def start(self, timeout=60):
        try:
            for node in self.nodes:
                node.start()
            subprocess.run([shutil.which("redis-cli") or "/usr/bin/redis-cli", "--cluster", "create",
                            *(f"127.0.0.1:{node.port}" for node in self.nodes), "--cluster-replicas",
                            str(self.replicas), "--cluster-yes"],
                           check=True, capture_output=True, timeout=timeout)
            self.wait_ok(timeout)
        except BaseException:
            self.cleanup()
            raise
        return self

    def wait_ok(self, timeout=30):
        """Wait until every running node says ``cluster_state:ok``: every slot has a master that answers."""
        wait_until(lambda: all(node.cluster_state() == "ok" for node in self.nodes if node.running), timeout,
                   "the Redis Cluster (cluster_state:ok on every node)")

    def role(self, node):
        """Return "master" or "slave", as the node's ``ROLE`` says."""
        with node.client() as client:
            role = client.execute_command("ROLE")[0]
        return role.decode() if isinstance(role, bytes) else role

    def replica_of(self, master):
        """Return the node that replicates ``master``."""
        with master.client() as client:
            replicas = client.info("replication")
        port = int(replicas["slave0"]["port"])
        return next(node for node in self.nodes if node.port == port)

    def fail_over(self, master, timeout=30):
        """Kill ``master`` (SIGKILL) and return its replica once it is a master and the cluster serves every slot."""
        replica = self.replica_of(master)
        master.kill()
        wait_until(lambda: self.role(replica) == "master", timeout, "the replica's promotion")
        self.wait_ok(timeout)
        return replica

    def cleanup(self):
        for node in self.nodes:
            node.cleanup()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.cleanup()


def start_redis_cluster(tmp):
    """The three-master Redis Cluster of the contract suite."""
    deployment = RedisClusterDeployment(f"{tmp}/rediscluster").start()
    return {"DISTLOCK_TEST_REDIS_CLUSTER_URL": deployment.url}, [deployment]
