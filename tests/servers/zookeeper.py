"""A private ZooKeeper ensemble on loopback: members that start, stop, crash, pause and report their role.

Each member runs ``QuorumPeerMain`` from the Debian package ``zookeeper`` with its own conf dir,
data dir and log. ``tickTime`` is 250 ms, so the server negotiates session timeouts between 0.5 s
(2 ticks) and 5 s (20 ticks): tests see session expiry within seconds. The four-letter words are
enabled (``srvr``, ``ruok``, ``wchp``...): readiness and ``leader()`` use them, and tests use ``wchp``
to see who watches what.
"""

import socket
import time
from pathlib import Path

from tests.servers import ManagedProcess, free_port, wait_until

ZOOKEEPER_JAR = "/usr/share/java/zookeeper.jar"
#: slf4j -> log4j 1.2, so the server logs to stdout (our log file); zookeeper.jar's manifest brings the rest.
LOGGING_JARS = ["/usr/share/java/slf4j-log4j12.jar", "/usr/share/java/log4j-1.2.jar"]

TICK_MS = 250

LOG4J_PROPERTIES = """\
log4j.rootLogger=INFO, CONSOLE
log4j.appender.CONSOLE=org.apache.log4j.ConsoleAppender
log4j.appender.CONSOLE.layout=org.apache.log4j.PatternLayout
log4j.appender.CONSOLE.layout.ConversionPattern=%d{ISO8601} %-5p [%t:%C{1}@%L] - %m%n
"""


def four_letter_word(port, command, timeout=2.0):
    """Send a four-letter word (``ruok``, ``srvr``, ``wchp``...) to 127.0.0.1:port; return the reply, "" if none."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(command.encode())
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
    except OSError:
        return ""
    return b"".join(chunks).decode(errors="replace")


class ZooKeeperMember(ManagedProcess):
    """One member of an ensemble. ``ready()`` means the process answers; ``serving`` means it is in a quorum.

    A member started alone (the others down) is ready but not serving, so the fault suite can restart
    members one by one and wait for the quorum separately with ``ZooKeeperEnsemble.wait_serving()``.
    """

    def __init__(self, myid, client_port, peer_port, election_port, servers, workdir):
        self.myid = myid
        self.client_port = client_port
        self.peer_port = peer_port
        self.election_port = election_port
        #: "server.N=..." lines of the whole ensemble, shared by every member.
        self.servers = servers
        super().__init__(f"zookeeper-{myid}", workdir)
        self.conf_dir = self.workdir / "conf"
        self.data_dir = self.workdir / "data"

    @property
    def address(self):
        return f"127.0.0.1:{self.client_port}"

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
            "clientPortAddress=127.0.0.1",
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
            "",
        ]))

    def command(self):
        classpath = ":".join([str(self.conf_dir), ZOOKEEPER_JAR, *LOGGING_JARS])
        return ["java", "-Xmx256m", "-Xms32m", "-XX:+UseSerialGC", "-Djava.net.preferIPv4Stack=true",
                "-Dzookeeper.admin.enableServer=false", "-Dlog4j.configuration=log4j.properties",
                "-cp", classpath, "org.apache.zookeeper.server.quorum.QuorumPeerMain",
                str(self.conf_dir / "zoo.cfg")]

    def ready(self):
        return four_letter_word(self.client_port, "ruok", timeout=0.5) == "imok"

    def command_reply(self, word):
        """Return this member's reply to a four-letter word ("" if it does not answer)."""
        return four_letter_word(self.client_port, word)

    @property
    def mode(self):
        """Return "leader", "follower", or None while the member is down, paused or out of quorum."""
        for line in self.command_reply("srvr").splitlines():
            if line.startswith("Mode:"):
                return line.split(":", 1)[1].strip()
        return None

    @property
    def serving(self):
        return self.mode in ("leader", "follower")


class ZooKeeperEnsemble:
    """Three (or ``size``) members on free loopback ports, each in its own directory under ``workdir``."""

    def __init__(self, workdir, size=3):
        self.workdir = Path(workdir)
        ports = [(free_port(), free_port(), free_port()) for _ in range(size)]
        servers = [f"server.{i}=127.0.0.1:{peer}:{election}" for i, (_, peer, election) in enumerate(ports, 1)]
        self.members = [
            ZooKeeperMember(i, client, peer, election, servers, self.workdir / f"member-{i}")
            for i, (client, peer, election) in enumerate(ports, 1)
        ]

    @property
    def hosts(self):
        """The connection string for kazoo: "127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3"."""
        return ",".join(member.address for member in self.members)

    def __getitem__(self, index):
        return self.members[index]

    def start(self, timeout=60):
        """Start every member and return once the whole ensemble serves clients."""
        for member in self.members:
            member.start()
        self.wait_serving(timeout, members=self.members)
        return self

    def wait_serving(self, timeout=30, members=None):
        """Wait until ``members`` (default: every running member) are in a quorum with a leader."""
        members = members or [member for member in self.members if member.running]
        try:
            wait_until(lambda: all(member.serving for member in members) and self.leader() is not None,
                       timeout, "ZooKeeper quorum")
        except TimeoutError:
            logs = "\n".join(f"--- {member.name}\n{member.new_logs()[-3000:]}" for member in members)
            raise TimeoutError(f"the ZooKeeper ensemble formed no quorum within {timeout}s:\n{logs}") from None

    def leader(self):
        """Return the member that is the leader right now, or None."""
        return next((member for member in self.members if member.running and member.mode == "leader"), None)

    def followers(self):
        return [member for member in self.members if member.running and member.mode == "follower"]

    def wait_for_new_leader(self, old, timeout=30):
        """Return the leader elected after ``old`` (a member) stopped leading."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            leader = self.leader()
            if leader is not None and leader is not old:
                return leader
            time.sleep(0.1)
        raise TimeoutError(f"no new ZooKeeper leader within {timeout}s")

    def get_logs(self):
        return "\n".join(f"--- {member.name}\n{member.get_logs()}" for member in self.members)

    def stop(self):
        for member in self.members:
            member.stop()

    def cleanup(self):
        for member in self.members:
            member.cleanup()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.cleanup()


def start_zookeeper(tmp):
    """The 3-member ensemble of the contract suite."""
    ensemble = ZooKeeperEnsemble(f"{tmp}/zookeeper").start()
    return {"DISTLOCK_TEST_ZK_HOSTS": ensemble.hosts}, ensemble.members
