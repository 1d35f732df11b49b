"""The ZooKeeper backend against kazoo's ``Lock`` recipe on the same ensemble, in the same run, with the target.

- kazoo's ``Lock``, used as its docs show, a new ``client.Lock(path)`` per critical section:
  ``ensure_path`` (an exists), create, get_children; release = delete. Two writes and two reads.
- kazoo's ``Lock`` with one object per name, reused: ``ensure_path`` runs once per object, so one read
  less; the fastest way to use the recipe.
- distlock's backend: multi[create parent, create node, set_data parent] (the set_data returns the
  token), then multi[delete node, delete parent]. Two requests, both transactions, and no empty
  znode left.

- the protocol floor: a bare create and delete of one znode, the two writes any ZooKeeper lock makes.

Both sides make two transactions per acquire+release (any ZooKeeper lock must write twice); what
distlock saves is requests and round trips. The ops/s ratio therefore depends on how much a read
round trip costs next to a transaction on the machine at hand: the floor's ratio over kazoo is the
ceiling of that run. The requests and transactions the ensemble counted are printed as the
load-free view.

Target (issue 3): uncontended acquire+release ≥ 1.5× kazoo's ``Lock``. Contended figures (4 processes,
one key) are printed beside kazoo's. Afterwards the script counts the znodes each left behind:
kazoo's recipe keeps one empty parent per lock name forever.

    python -m tests.servers --servers zookeeper -- python -m bench.zookeeper_baselines [--rounds 10]
"""

import os
import re
import threading
import uuid

from django.conf import settings

from bench import run_standalone
from bench.harness import (
    Contender,
    ContenderSpec,
    contended,
    print_contended,
    print_uncontended,
    round_options,
    uncontended,
    verdict,
)
from tests.servers.zookeeper import four_letter_word

#: Target ratio of issue 3.
KAZOO_RATIO_TARGET = 1.5

KAZOO_ROOT = "/bench-kazoo-lock"
FLOOR_ROOT = "/bench-floor"


def _kazoo_client(hosts):
    from kazoo.client import KazooClient  # noqa: PLC0415

    client = KazooClient(hosts=hosts)
    client.start(timeout=15)
    return client


def kazoo_lock(hosts, reuse=False):
    """kazoo's ``Lock`` recipe; a new ``Lock`` per acquire, or (``reuse``) one ``Lock`` object per name."""
    client = _kazoo_client(hosts)
    objects = {}
    objects_lock = threading.Lock()

    def new_lock(name):
        return client.Lock(f"{KAZOO_ROOT}/{name}", f"pid {os.getpid()}")

    def reused_lock(name):
        with objects_lock:
            if name not in objects:
                objects[name] = new_lock(name)
            return objects[name]

    make = reused_lock if reuse else new_lock

    def acquire(name):
        lock = make(name)
        lock.acquire(blocking=True)
        return lock

    return Contender(acquire, lambda lock: lock.release())


def floor(hosts):
    """The protocol floor: the two writes any ZooKeeper lock makes (create its znode, delete it), nothing else.

    Not a lock (it never looks whether another znode holds the name): uncontended only. Its ops/s
    over kazoo's are the most any ZooKeeper lock can gain on kazoo in the same run, since both write twice.
    """
    from distlock.backends.zookeeper import encode_name  # noqa: PLC0415

    client = _kazoo_client(hosts)
    client.ensure_path(FLOOR_ROOT)
    return Contender(lambda name: client.create(f"{FLOOR_ROOT}/{encode_name(name)}", ephemeral=True), client.delete)


def zookeeper_aliases():
    return [alias for alias, entry in settings.DISTLOCK.items()
            if entry.get("BACKEND") == "distlock.backends.zookeeper.ZooKeeperBackend"]


def count_znodes(hosts, root):
    """Return how many znodes exist under ``root`` (recursively), 0 if it does not exist."""
    client = _kazoo_client(hosts)
    try:
        def count(path):
            children = client.get_children(path)
            return len(children) + sum(count(f"{path}/{child}") for child in children)

        return count(root) if client.exists(root) else 0
    finally:
        client.stop()
        client.close()


def server_counters(hosts):
    """Return (requests received by all members, the ensemble's last zxid counter), from ``srvr``."""
    received, zxid = 0, 0
    for host in hosts.split(","):
        reply = four_letter_word(int(host.rsplit(":", 1)[1]), "srvr")
        received += int(re.search(r"Received: (\d+)", reply).group(1))
        zxid = max(zxid, int(re.search(r"Zxid: (0x[0-9a-f]+)", reply).group(1), 16) & 0xFFFFFFFF)
    return received, zxid


def server_work(spec, hosts, cycles=200):
    """Return (requests, transactions) the ensemble handled per acquire+release of ``spec``, one process.

    Counted by the servers themselves, so the figure does not depend on the machine's load
    (heartbeats of the bench's own idle sessions add a few hundredths).
    """
    contender = spec.build()
    name = f"bench:work:{uuid.uuid4().hex}"
    contender.release(contender.acquire(name))
    received, zxid = server_counters(hosts)
    for _ in range(cycles):
        contender.release(contender.acquire(name))
    received_after, zxid_after = server_counters(hosts)
    return (received_after - received) / cycles, (zxid_after - zxid) / cycles


def run(*, seconds=0.25, rounds=20, contended_seconds=2.0, contended_rounds=3):
    """Print the baselines against the first ZooKeeper alias, and the ratio against the target."""
    aliases = zookeeper_aliases()
    if not aliases:
        print("\nZooKeeper baselines: no DISTLOCK alias uses ZooKeeperBackend; skipped.")
        return
    from distlock.handler import locks  # noqa: PLC0415

    alias = aliases[0]
    hosts, root = locks[alias].settings["HOSTS"], locks[alias].settings["KEY_PREFIX"]
    here = "bench.zookeeper_baselines"
    api = ContenderSpec(f"distlock '{alias}' (public API)", "bench.harness.alias_contender", {"alias": alias})
    backend = ContenderSpec(f"distlock '{alias}' (backend only)", "bench.harness.backend_contender", {"alias": alias})
    kazoo = ContenderSpec("kazoo Lock (new per acquire)", f"{here}.kazoo_lock", {"hosts": hosts})
    kazoo_reused = ContenderSpec("kazoo Lock (reused per name)", f"{here}.kazoo_lock", {"hosts": hosts, "reuse": True})
    bare = ContenderSpec("floor: bare create + delete", f"{here}.floor", {"hosts": hosts})

    print(f"\n== ZooKeeper baselines: alias '{alias}' against kazoo's Lock on the same ensemble ({hosts}) ==")
    before = {root: count_znodes(hosts, root), KAZOO_ROOT: count_znodes(hosts, KAZOO_ROOT)}
    alone = uncontended([api, backend, kazoo, kazoo_reused, bare], seconds=seconds, rounds=rounds)
    print_uncontended(alone, f"Uncontended acquire+release, 1 process ({rounds} interleaved rounds of {seconds:g} s, "
                             "median ops/s)")
    together = contended([api, kazoo], seconds=contended_seconds, rounds=contended_rounds)
    print_contended(together, f"Contended: 4 processes on one key ({contended_rounds} interleaved rounds of "
                              f"{contended_seconds:g} s, medians)")

    print("\nServer work per uncontended acquire+release, counted by the ensemble (srvr): the load-free view")
    print(f"  {'contender':<34}{'requests':>10}{'transactions':>14}")
    for spec in (backend, kazoo, kazoo_reused):
        requests, transactions = server_work(spec, hosts)
        print(f"  {spec.label:<34}{requests:>10.2f}{transactions:>14.2f}")

    kazoo_ops, reused_ops = alone[kazoo.label].ops, alone[kazoo_reused.label].ops
    print("\nTargets")
    for spec in (api, backend):
        ratio = alone[spec.label].ops / kazoo_ops
        print(f"  {spec.label + ' vs kazoo Lock:':<52}{ratio:5.2f}x  (target >= {KAZOO_RATIO_TARGET}x: "
              f"{verdict(ratio, KAZOO_RATIO_TARGET)})")
    for spec in (api, backend):
        ratio = alone[spec.label].ops / reused_ops
        print(f"  {spec.label + ' vs kazoo Lock reused:':<52}{ratio:5.2f}x  (for reference)")
    ceiling = alone[bare.label].ops / kazoo_ops
    print(f"  {'(ceiling) floor vs kazoo Lock:':<52}{ceiling:5.2f}x  (the most any lock making two writes "
          "could reach in this run)")
    print(f"  {backend.label + ' vs the floor:':<52}{alone[backend.label].ops / alone[bare.label].ops:5.2f}x")
    handoff_ratio = together[api.label].median("handoffs") / max(together[kazoo.label].median("handoffs"), 1e-9)
    print(f"  {'contended hand-offs/s vs kazoo Lock:':<52}{handoff_ratio:5.2f}x  "
          f"(Jain {together[api.label].median('jain'):.3f} vs {together[kazoo.label].median('jain'):.3f})")
    print("\nZnodes left behind by this run")
    print(f"  distlock under {root}: {count_znodes(hosts, root) - before[root]}")
    print(f"  kazoo Lock under {KAZOO_ROOT}: {count_znodes(hosts, KAZOO_ROOT) - before[KAZOO_ROOT]} "
          "(one empty parent per lock name)")


def main(argv):
    run(**round_options("python -m bench.zookeeper_baselines", __doc__, argv))


if __name__ == "__main__":
    run_standalone(main)
