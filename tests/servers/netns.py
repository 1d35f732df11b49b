"""Test hosts in network namespaces of their own, on one bridge, with links a nemesis cuts and heals.

Each ``TestHost`` is a Linux network namespace with one veth into a bridge of the root namespace.
The bridge has the subnet's first address: processes of the root namespace (the tests, their
client processes) reach every host through it, and the hosts see them as ``CLIENTS``. A server
started in a host listens on the host's own address, so members of one cluster can use the same
ports and be cut from each other for real, between servers, not only in front of a client.

A cut is silent, as a real partition is: every host has an nftables table whose ``cut`` set lists the
addresses it neither sends to nor hears from; packets are dropped, no reset or ICMP error comes
back, and TCP retransmits until it gives up. ``cut(a, b)`` puts each host in the other's set;
``heal()`` empties them. A bridge partition (one host sees both sides) is two groups cut from each
other except through that host.

Names carry the creating process's pid (``dl<pid>...``), so concurrent test runs never share a
namespace, and a run that died is cleaned up by the next one (``remove_leftovers()``). Only the
project's own subnet 10.251.x.0/24 is used, x chosen free at creation.
"""

import itertools
import os
import random
import re
import subprocess
from functools import lru_cache

__all__ = ["CLIENTS", "NetworkUnavailable", "TestHost", "TestNetwork", "namespaces_refused", "remove_leftovers"]

#: The pseudo-host of every process in the root namespace: the tests and their client processes.
CLIENTS = "clients"

_PARTITION_TABLE = """\
table inet partition {
  set cut { type ipv4_addr; }
  chain incoming { type filter hook input priority 0; ip saddr @cut drop; }
  chain outgoing { type filter hook output priority 0; ip daddr @cut drop; }
}
"""

_NAME = re.compile(r"^dl(\d+)[a-z]")


class NetworkUnavailable(RuntimeError):
    """The kernel or the tools refuse what a test network needs (namespaces, veth, a bridge, nftables)."""


def _run(*command, namespace=None, stdin=None):
    prefix = ["ip", "netns", "exec", namespace] if namespace else []
    done = subprocess.run([*prefix, *command], input=stdin, capture_output=True, text=True)
    if done.returncode:
        raise NetworkUnavailable(f"`{' '.join(map(str, command))}` failed: {done.stderr.strip()}")
    return done.stdout


@lru_cache(maxsize=None)
def namespaces_refused():
    """Return why test networks cannot be built here (not root, no ``ip``/``nft``, a kernel that refuses), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"dl{os.getpid()}probe"
    try:
        _run("ip", "netns", "add", probe)
        try:
            _run("nft", "-f", "-", namespace=probe, stdin=_PARTITION_TABLE)
        finally:
            _run("ip", "netns", "delete", probe)
    except (NetworkUnavailable, FileNotFoundError) as exc:
        return f"this machine cannot build test networks: {exc}"
    return None


def remove_leftovers():
    """Delete namespaces and bridges of test runs whose process is gone (a run killed before its teardown)."""
    def dead(name):
        match = _NAME.match(name)
        return bool(match) and not os.path.exists(f"/proc/{match.group(1)}")

    for name in _run("ip", "netns", "list").split():
        if dead(name):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    for line in _run("ip", "-o", "link", "show", "type", "bridge").splitlines():
        name = line.split(":")[1].strip()
        if dead(name):
            subprocess.run(["ip", "link", "delete", name], capture_output=True)


class TestHost:
    """One namespace: its name, its address, and the addresses it is cut from right now."""

    __test__ = False  # not a pytest test class

    def __init__(self, network, name, address, namespace):
        self.network = network
        self.name = name
        self.address = address
        self.namespace = namespace
        self.cut_from = set()

    def exec_prefix(self):
        """The command prefix that runs a program inside this host (its pid is the program's own)."""
        return ["ip", "netns", "exec", self.namespace]

    def _apply(self):
        _run("nft", "flush", "set", "inet", "partition", "cut", namespace=self.namespace)
        if self.cut_from:
            elements = "{ " + ", ".join(sorted(self.cut_from)) + " }"
            _run("nft", "add", "element", "inet", "partition", "cut", elements, namespace=self.namespace)

    def __repr__(self):
        return f"<TestHost {self.name} {self.address}>"


class TestNetwork:
    """A bridge and the hosts on it; ``cut``/``isolate``/``partition`` and ``heal`` change who hears whom."""

    __test__ = False

    _counter = itertools.count()

    def __init__(self):
        reason = namespaces_refused()
        if reason:
            raise NetworkUnavailable(reason)
        remove_leftovers()
        self.tag = f"dl{os.getpid()}n{next(self._counter)}"
        self.subnet = self._free_subnet()
        self.bridge = self.tag
        self.client_address = f"{self.subnet}.1"
        self.hosts = {}
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.client_address}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")

    @staticmethod
    def _free_subnet():
        used = set(re.findall(r"inet 10\.251\.(\d+)\.", _run("ip", "-o", "addr")))
        free = [x for x in range(1, 255) if str(x) not in used]
        if not free:
            raise NetworkUnavailable("every 10.251.x.0/24 subnet is in use")
        return f"10.251.{random.choice(free)}"

    def add_host(self, name):
        """Create a host named ``name`` (a short word) with the next address of the subnet; return it."""
        number = len(self.hosts) + 2
        host = TestHost(self, name, f"{self.subnet}.{number}", f"{self.tag}{name}")
        veth = f"{self.tag}h{number}"
        _run("ip", "netns", "add", host.namespace)
        self.hosts[name] = host
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", host.namespace)
        _run("ip", "link", "set", veth, "master", self.bridge, "up")
        _run("ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _run("ip", "-n", host.namespace, "link", "set", "eth0", "up")
        _run("ip", "-n", host.namespace, "link", "set", "lo", "up")
        _run("nft", "-f", "-", namespace=host.namespace, stdin=_PARTITION_TABLE)
        return host

    def _address(self, name):
        return self.client_address if name == CLIENTS else self.hosts[name].address

    def cut(self, a, b):
        """Cut the link between hosts ``a`` and ``b`` (names; ``CLIENTS`` for the root namespace), both ways."""
        for near, far in ((a, b), (b, a)):
            if near != CLIENTS:
                host = self.hosts[near]
                host.cut_from.add(self._address(far))
                host._apply()

    def partition(self, *groups):
        """Cut every link between hosts of different ``groups`` (iterables of names); links within a group stay."""
        for left, right in itertools.combinations(groups, 2):
            for a in left:
                for b in right:
                    self.cut(a, b)

    def isolate(self, name, *, from_clients=False):
        """Cut ``name`` from every other host (and from the clients too with ``from_clients``)."""
        others = [other for other in self.hosts if other != name]
        self.partition([name], others + ([CLIENTS] if from_clients else []))

    def heal(self):
        """Restore every link."""
        for host in self.hosts.values():
            if host.cut_from:
                host.cut_from.clear()
                host._apply()

    def links_cut(self):
        """Return ``{host: sorted addresses it is cut from}`` for the hosts cut from anything (for logs)."""
        return {name: sorted(host.cut_from) for name, host in self.hosts.items() if host.cut_from}

    def teardown(self):
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "delete", host.namespace], capture_output=True)
        subprocess.run(["ip", "link", "delete", self.bridge], capture_output=True)
        self.hosts.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.teardown()
