"""A private ZooKeeper ensemble on loopback: members that start, stop, crash, pause and report their role.

Each member runs ``QuorumPeerMain`` from the Debian package ``zookeeper`` with its own conf dir,
data dir and log. ``tickTime`` is 250 ms, so the server negotiates session timeouts between 0.5 s
(2 ticks) and 5 s (20 ticks): tests see session expiry within seconds. The four-letter words are
enabled (``srvr``, ``ruok``, ``wchp``...): readiness and ``leader()`` use them, and tests use ``wchp``
to see who watches what.

Secured instances: ``TlsMaterial`` makes a throwaway CA and certificates with ``openssl`` in the
test's directory; a member given it also listens on a TLS-only ``secureClientPort`` (Netty, PEM
key and trust stores, client certificates required). Digest auth needs no server setting: ACLs are
per znode.
"""

import socket
import subprocess
from pathlib import Path

from tests.servers import Cluster, ClusterMember, free_port

ZOOKEEPER_JAR = "/usr/share/java/zookeeper.jar"
#: slf4j -> log4j 1.2, so the server logs to stdout (our log file); zookeeper.jar's manifest brings the rest.
LOGGING_JARS = ["/usr/share/java/slf4j-log4j12.jar", "/usr/share/java/log4j-1.2.jar"]
#: Netty's codec and resolver, which the TLS client port (Netty) needs and zookeeper.jar's manifest leaves out.
NETTY_JARS = ["/usr/share/java/netty-codec.jar", "/usr/share/java/netty-resolver.jar"]

TICK_MS = 250

LOG4J_PROPERTIES = """\
log4j.rootLogger=INFO, CONSOLE
log4j.appender.CONSOLE=org.apache.log4j.ConsoleAppender
log4j.appender.CONSOLE.layout=org.apache.log4j.PatternLayout
log4j.appender.CONSOLE.layout.ConversionPattern=%d{ISO8601} %-5p [%t:%C{1}@%L] - %m%n
"""


def four_letter_word(port, command, timeout=2.0, ip="127.0.0.1"):
    """Send a four-letter word (``ruok``, ``srvr``, ``wchp``...) to ip:port; return the reply, "" if none."""
    try:
        with socket.create_connection((ip, port), timeout=timeout) as sock:
            sock.sendall(command.encode())
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
    except OSError:
        return ""
    return b"".join(chunks).decode(errors="replace")


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


class TlsMaterial:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate, made by ``openssl``.

    The client's key is encrypted with ``key_password``. ``other_ca`` signed nothing here: a client
    that trusts it must refuse the server.
    """

    key_password = "client-key-pass"

    def __init__(self, directory):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.ca = self._path("ca.pem")
        self.other_ca = self._path("other-ca.pem")
        #: The server's private key followed by its certificate: ZooKeeper reads it as a PEM key store.
        self.server_keystore = self._path("server-keystore.pem")
        self.client_cert = self._path("client.pem")
        self.client_key = self._path("client.key")
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2"]
        for name, subject in (("ca", "distlock test CA"), ("other-ca", "distlock unrelated CA")):
            openssl("req", "-x509", *ec, "-keyout", f"{name}.key", "-out", f"{name}.pem", "-subj", f"/CN={subject}",
                    cwd=self.directory)
        (self.directory / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1", cwd=self.directory)
        self._sign("server", "-extfile", "server.ext")
        (self.directory / "server-keystore.pem").write_text(
            (self.directory / "server.key").read_text() + (self.directory / "server.pem").read_text())
        openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-aes-256-cbc",
                "-pass", f"pass:{self.key_password}", "-out", "client.key", cwd=self.directory)
        openssl("req", "-new", "-key", "client.key", "-passin", f"pass:{self.key_password}", "-out", "client.csr",
                "-subj", "/CN=distlock test client", cwd=self.directory)
        self._sign("client")

    def _path(self, name):
        return str(self.directory / name)

    def _sign(self, name, *extra):
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", *extra, cwd=self.directory)

    def server_config(self, secure_port):
        """The zoo.cfg lines of a TLS-only client port (ZooKeeper passes ``ssl.*`` on as system properties)."""
        return [
            f"secureClientPort={secure_port}",
            "secureClientPortAddress=127.0.0.1",
            "serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory",
            "authProvider.x509=org.apache.zookeeper.server.auth.X509AuthenticationProvider",
            f"ssl.keyStore.location={self.server_keystore}",
            "ssl.keyStore.type=PEM",
            f"ssl.trustStore.location={self.ca}",
            "ssl.trustStore.type=PEM",
            "ssl.clientAuth=need",
        ]


class ZooKeeperMember(ClusterMember):
    """One member of an ensemble. ``ready()`` means the process answers; ``healthy`` means it is in a quorum.

    A member started alone (the others down) is ready but not healthy, so the fault suite can restart
    members one by one and wait for the quorum separately with ``ZooKeeperEnsemble.wait_healthy()``.
    """

    def __init__(self, myid, client_port, servers, workdir, *, tls=None, host=None):
        self.myid = myid
        #: A ``TlsMaterial``: the member also serves TLS clients on ``secure_port``.
        self.tls = tls
        self.secure_port = free_port() if tls else None
        #: "server.N=ip:peer:election" lines of the whole ensemble, shared by every member.
        self.servers = servers
        super().__init__(f"zookeeper-{myid}", client_port, workdir, host)
        self.conf_dir = self.workdir / "conf"
        self.data_dir = self.workdir / "data"

    def prepare(self):
        self.conf_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "myid").write_text(f"{self.myid}\n")
        (self.conf_dir / "log4j.properties").write_text(LOG4J_PROPERTIES)
        (self.conf_dir / "zoo.cfg").write_text("\n".join([
            f"tickTime={TICK_MS}",
            # Followers get 10 s to sync at start-up and 2.5 s to answer later: the machine is shared and slow.
            "initLimit=40",
            "syncLimit=10",
            f"dataDir={self.data_dir}",
            f"clientPort={self.client_port}",
            f"clientPortAddress={self.ip}",
            "maxClientCnxns=0",
            "4lw.commands.whitelist=*",
            "admin.enableServer=false",
            "reconfigEnabled=false",
            "standaloneEnabled=false",
            # No fsync and 1 MB log pre-allocation instead of 64 MB: these are throw-away test servers.
            "forceSync=no",
            "preAllocSize=1024",
            "autopurge.snapRetainCount=3",
            "autopurge.purgeInterval=1",
            *self.servers,
            *(self.tls.server_config(self.secure_port) if self.tls else []),
            "",
        ]))

    def command(self):
        classpath = ":".join([str(self.conf_dir), ZOOKEEPER_JAR, *LOGGING_JARS, *(NETTY_JARS if self.tls else [])])
        return ["java", "-Xmx256m", "-Xms32m", "-XX:+UseSerialGC", "-Djava.net.preferIPv4Stack=true",
                "-Dzookeeper.admin.enableServer=false", "-Dlog4j.configuration=log4j.properties",
                "-cp", classpath, "org.apache.zookeeper.server.quorum.QuorumPeerMain",
                str(self.conf_dir / "zoo.cfg")]

    def ready(self):
        return four_letter_word(self.client_port, "ruok", timeout=0.5, ip=self.ip) == "imok"

    @property
    def secure_address(self):
        """The TLS client address, "127.0.0.1:port" (members started with ``tls`` only)."""
        return f"127.0.0.1:{self.secure_port}"

    def command_reply(self, word):
        """Return this member's reply to a four-letter word ("" if it does not answer)."""
        return four_letter_word(self.client_port, word, ip=self.ip)

    @property
    def mode(self):
        """Return "leader", "follower", or None while the member is down, paused or out of quorum."""
        for line in self.command_reply("srvr").splitlines():
            if line.startswith("Mode:"):
                return line.split(":", 1)[1].strip()
        return None

    @property
    def healthy(self):
        return self.mode in ("leader", "follower")

    @property
    def leads(self):
        return self.mode == "leader"


class ZooKeeperEnsemble(Cluster):
    """Three (or ``size``) members, each in its own directory under ``workdir``.

    On free loopback ports, or, given a ``tests.servers.netns.TestNetwork``, each member on a test host
    of its own ("zk1", "zk2"...) with ZooKeeper's usual ports: links between members can then be cut.
    """

    service = "ZooKeeper"

    def __init__(self, workdir, size=3, *, tls=None, network=None):
        self.workdir = Path(workdir)
        if network is None:
            hosts = [None] * size
            ports = [(free_port(), free_port(), free_port()) for _ in range(size)]
        else:
            hosts = [network.add_host(f"zk{i}") for i in range(1, size + 1)]
            ports = [(2181, 2888, 3888)] * size
        servers = [f"server.{i}={host.address if host else '127.0.0.1'}:{peer}:{election}"
                   for i, (host, (_, peer, election)) in enumerate(zip(hosts, ports), 1)]
        self.members = [
            ZooKeeperMember(i, client, servers, self.workdir / f"member-{i}", tls=tls, host=host)
            for i, (host, (client, _, _)) in enumerate(zip(hosts, ports), 1)
        ]

    @property
    def hosts(self):
        """The connection string for kazoo: "ip1:p1,ip2:p2,ip3:p3"."""
        return ",".join(member.address for member in self.members)

    @property
    def secure_hosts(self):
        """The TLS connection string (an ensemble started with ``tls``)."""
        return ",".join(member.secure_address for member in self.members)


def start_zookeeper(tmp):
    """The 3-member ensemble of the contract suite."""
    ensemble = ZooKeeperEnsemble(f"{tmp}/zookeeper").start()
    return {"DISTLOCK_TEST_ZK_HOSTS": ensemble.hosts}, ensemble.members
