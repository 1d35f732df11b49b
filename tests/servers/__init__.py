"""Real servers for the tests, on loopback, in temporary directories: start, stop, kill, pause, restart.

The fault-injection suite reuses these classes to run its own instances on its own ports; the
shared instances the contract suite uses are started by ``python -m tests.servers``.
"""

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def free_port():
    """Return a TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_open(port, host="127.0.0.1", timeout=0.5):
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_until(predicate, timeout, what, *, every=0.05):
    """Poll ``predicate`` every ``every`` seconds until it is true; raise ``TimeoutError`` naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(every)
    raise TimeoutError(f"{what} not ready after {timeout}s")


class ManagedProcess:
    """One server process whose whole life the tests own: its directory, its log, its signals."""

    #: Seconds to wait for readiness after start.
    start_timeout = 30

    def __init__(self, name, workdir=None):
        self.name = name
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix=f"distlock-{name}-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / f"{name}.log"
        self.process = None

    def command(self):
        raise NotImplementedError

    def ready(self):
        raise NotImplementedError

    def env(self):
        return None

    def popen_kwargs(self):
        """Extra ``subprocess.Popen`` arguments (a server that refuses to run as root sets ``user=``)."""
        return {}

    def exec_prefix(self):
        """What runs before ``command()``: nothing, or ``ip netns exec`` for a member on a test host."""
        return []

    def start(self):
        self.prepare()
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [*self.exec_prefix(), *self.command()], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=self.workdir, env=self.env(), start_new_session=True, **self.popen_kwargs(),
        )
        self._log = log
        try:
            wait_until(self._ready_or_dead, self.start_timeout, self.name)
        except TimeoutError:
            raise TimeoutError(f"{self.name} did not start; its log:\n{self.get_logs()[-4000:]}") from None
        if self.process.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.process.returncode}; log:\n{self.get_logs()[-4000:]}")
        return self

    def prepare(self):
        """Write config files before the first start."""

    def _ready_or_dead(self):
        return self.process.poll() is not None or self.ready()

    @property
    def running(self):
        return self.process is not None and self.process.poll() is None

    def signal(self, signum):
        if self.running:
            os.kill(self.process.pid, signum)

    def pause(self):
        """Freeze the server (SIGSTOP): it keeps its sockets but answers nothing."""
        self.signal(signal.SIGSTOP)

    def resume(self):
        self.signal(signal.SIGCONT)

    def kill(self):
        """Kill without warning (SIGKILL), like a crash."""
        if self.running:
            self.signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait()
        self._close_log()

    def stop(self, timeout=10):
        if self.running:
            self.signal(signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._close_log()

    def restart(self):
        self.stop()
        return self.start()

    def _close_log(self):
        log = getattr(self, "_log", None)
        if log is not None:
            log.close()
            self._log = None

    def get_logs(self):
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def new_logs(self):
        """Return what the server logged since its last start (readiness checks read only this)."""
        return self.get_logs()[getattr(self, "_log_offset", 0):]

    def cleanup(self):
        self.stop()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.cleanup()


class ClusterMember(ManagedProcess):
    """One member of a ``Cluster``: a server process that answers clients on ``ip``:``client_port``.

    ``host``: a ``tests.servers.netns.TestHost`` the member runs in (its own address, links a test can
    cut), or None for loopback.
    """

    def __init__(self, name, client_port, workdir, host=None):
        self.client_port = client_port
        self.host = host
        self.ip = host.address if host else "127.0.0.1"
        super().__init__(name, workdir)

    def exec_prefix(self):
        return self.host.exec_prefix() if self.host else []

    @property
    def address(self):
        """The client address, "ip:port", as the backends' host lists take it."""
        return f"{self.ip}:{self.client_port}"

    @property
    def healthy(self):
        """True if the member serves clients, which it does only within a quorum that has a leader."""
        raise NotImplementedError

    @property
    def leads(self):
        raise NotImplementedError


class Cluster:
    """``ClusterMember`` processes of one replicated server on loopback; a subclass builds ``self.members``."""

    #: The server's name in timeout messages ("etcd", "ZooKeeper").
    service = None

    def start(self, timeout=60):
        """Start every member and return once each of them is healthy."""
        for member in self.members:
            member.start()
        self.wait_healthy(timeout, members=self.members)
        return self

    def wait_healthy(self, timeout=30, members=None):
        """Wait until ``members`` (default: every running member) are healthy and one member leads."""
        members = members or [member for member in self.members if member.running]
        try:
            wait_until(lambda: all(member.healthy for member in members) and self.leader() is not None,
                       timeout, f"{self.service} quorum")
        except TimeoutError:
            logs = "\n".join(f"--- {member.name}\n{member.new_logs()[-3000:]}" for member in members)
            raise TimeoutError(f"the {self.service} cluster had no healthy quorum within {timeout}s:\n{logs}") from None

    def restore(self, timeout=60):
        """Resume paused members, start stopped ones and wait until all are healthy: undo a fault test."""
        for member in self.members:
            member.resume()
            if not member.running:
                member.start()
        self.wait_healthy(timeout, members=self.members)

    def leader(self):
        """Return the member that leads right now, or None (during an election, or without quorum)."""
        return next((member for member in self.members if member.running and member.leads), None)

    def followers(self):
        """Return the running members that serve clients and do not lead."""
        return [member for member in self.members if member.running and member.healthy and not member.leads]

    def cleanup(self):
        for member in self.members:
            member.cleanup()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.cleanup()
