"""``lock_many()`` of k names against k single acquisitions, per alias, uncontended, in one process.

    python -m tests.servers --servers postgres,redis,redlock,zookeeper,etcd -- \\
        python -m bench.lock_many [--aliases default,redis] [--k 2,4,8] [--rounds 200] [--seconds 20]

For each alias and each k, one operation of each side on k fresh names (distinct in every
operation, so no cache on either side sees a name twice), timed from the first call to the last
release's return:

- *lock_many*: ``with distlock.lock_many(names, ttl=30, using=alias): pass``;
- *k singles*: ``leases = [distlock.acquire(name, ttl=30, using=alias) for name in sorted(names)]``,
  then ``lease.release()`` for each, last first: the order and the work ``lock_many()`` does,
  without its set.

The two sides alternate, one operation each (lock_many, singles, lock_many, ...), so the machine's
drift and other processes' bursts hit both alike, for ``--rounds`` pairs or until ``--seconds`` have
passed on that k (whichever comes first; at least ``MIN_PAIRS``). Each row prints the median time
of one operation of each side, in ms, and their ratio, lock_many / k singles. Target (issue 17):
ratio <= 1.1. Aliases whose server was not started are skipped with a line saying so.
"""

import argparse
import os
import statistics
import time
import traceback
import uuid


from bench import configured_aliases, run_standalone

#: The ratio lock_many / k singles a row should not exceed (issue 17).
TARGET = 1.1
#: The lease's ttl on both sides, as ``bench.harness.alias_contender``.
TTL = 30
#: Pairs run on each k before any is timed: connections, scripts, the metrics thread.
WARMUP_PAIRS = 3
#: Pairs timed on each k even when ``--seconds`` has passed.
MIN_PAIRS = 5
DEFAULT_ALIASES = "default,locmem,postgres,redis,redlock,zookeeper,etcd"


def fresh_names(k):
    """Return ``k`` lock names nobody used before, in no particular order."""
    prefix = f"bench:many:{uuid.uuid4().hex}"
    return [f"{prefix}:{index}" for index in reversed(range(k))]


def time_lock_many(distlock, names, alias):
    """Return the ns ``with distlock.lock_many(names): pass`` took."""
    started = time.perf_counter_ns()
    with distlock.lock_many(names, ttl=TTL, using=alias):
        pass
    return time.perf_counter_ns() - started


def time_singles(distlock, names, alias):
    """Return the ns ``names`` took acquired one at a time in sorted order and released last first."""
    started = time.perf_counter_ns()
    leases = [distlock.acquire(name, ttl=TTL, using=alias) for name in sorted(names)]
    for lease in reversed(leases):
        lease.release()
    return time.perf_counter_ns() - started


def measure(alias, k, *, rounds, seconds):
    """Return (lock_many ns, singles ns): one list per side of per-operation times, pairs alternated."""
    import distlock  # noqa: PLC0415 - after django.setup()

    for _ in range(WARMUP_PAIRS):
        time_lock_many(distlock, fresh_names(k), alias)
        time_singles(distlock, fresh_names(k), alias)
    many, singles = [], []
    deadline = time.monotonic() + seconds
    while len(many) < rounds and (len(many) < MIN_PAIRS or time.monotonic() < deadline):
        many.append(time_lock_many(distlock, fresh_names(k), alias))
        singles.append(time_singles(distlock, fresh_names(k), alias))
    return many, singles


def run_alias(alias, ks, *, rounds, seconds):
    """Print the alias's table: one row per k."""
    print(f"\n[{alias}] lock_many of k names vs k single acquisitions (medians of one operation; "
          f"target ratio <= {TARGET:g})")
    print(f"  | {'k':>2} | {'lock_many ms':>12} | {'k singles ms':>12} | {'ratio':>6} |")
    pairs = []
    for k in ks:
        many, singles = measure(alias, k, rounds=rounds, seconds=seconds)
        many_ms, singles_ms = statistics.median(many) / 1e6, statistics.median(singles) / 1e6
        print(f"  | {k:>2} | {many_ms:>12.3f} | {singles_ms:>12.3f} | {many_ms / singles_ms:>6.3f} |", flush=True)
        pairs.append(f"k={k}: {len(many)}")
    print(f"  pairs timed: {', '.join(pairs)}")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.lock_many", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--aliases", default=DEFAULT_ALIASES,
                        help=f"comma-separated DISTLOCK aliases (default: {DEFAULT_ALIASES})")
    parser.add_argument("--k", default="2,4,8", help="comma-separated set sizes (default 2,4,8)")
    parser.add_argument("--rounds", type=int, default=200,
                        help="pairs of operations (one per side) per alias and k (default 200)")
    parser.add_argument("--seconds", type=float, default=10.0,
                        help=f"stop an alias's k after this many seconds even short of --rounds "
                             f"(at least {MIN_PAIRS} pairs; default 10)")
    args = parser.parse_args(argv)
    ks = [int(k) for k in args.k.split(",")]
    print(f"lock_many() vs k single acquisitions, uncontended, one process, ttl {TTL}s: up to {args.rounds} "
          f"alternated pairs or {args.seconds:g}s per alias and k, fresh names every operation.")
    for alias in configured_aliases(args.aliases.split(",")):
        try:
            run_alias(alias, ks, rounds=args.rounds, seconds=args.seconds)
        except Exception:  # noqa: BLE001 - one broken alias must not hide the others' figures
            print(f"\n[{alias}] failed:\n{traceback.format_exc(limit=3)}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    run_standalone(main)
