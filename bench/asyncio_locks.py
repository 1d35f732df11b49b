"""``alock()`` against the sync ``lock()``, uncontended, per alias, in one process.

    python -m tests.servers --servers redis -- \\
        python -m bench.asyncio_locks [--aliases redis,zookeeper] [--coroutines 50] [--seconds 2] [--rounds 3]

Three sides, each acquiring and releasing its own lock name over and over for a slot of ``--seconds``:

- *sync, 1 thread*: ``with distlock.lock(name, ttl=30, using=alias): pass``;
- *alock, 1 coroutine*: ``async with distlock.alock(name, ttl=30, using=alias): pass``;
- *alock, N coroutines*: ``--coroutines`` coroutines on one event loop, each on a name of its own.

The slots alternate (sync, 1 coroutine, N coroutines, sync, ...) for ``--rounds`` rounds, so the
machine's drift and other processes' bursts hit every side alike. Each row prints the operations per
second of each side over all its slots, and two ratios: 1 coroutine / sync (issue 17's target for
Redis: >= 0.9) and N coroutines / sync (target: >= 3). Every backend is offloaded today (each server
call on a worker thread: see "asyncio" in the README), which the first ratio pays for.
"""

import argparse
import asyncio
import os
import time
import traceback
import uuid

from bench import configured_aliases, run_standalone

#: The lease's ttl on every side.
TTL = 30
#: Issue 17's targets for Redis: 1 coroutine / sync, N coroutines / sync.
TARGET_ONE, TARGET_MANY = 0.9, 3.0
DEFAULT_ALIASES = "redis"


def sync_slot(distlock, alias, seconds):
    """Return the acquire+release cycles one thread made in ``seconds``."""
    name = f"bench:asyncio:{uuid.uuid4().hex}"
    done, ends = 0, time.monotonic() + seconds
    while time.monotonic() < ends:
        with distlock.lock(name, ttl=TTL, using=alias):
            pass
        done += 1
    return done


async def _cycles(distlock, alias, ends):
    name = f"bench:asyncio:{uuid.uuid4().hex}"
    done = 0
    while time.monotonic() < ends:
        async with distlock.alock(name, ttl=TTL, using=alias):
            pass
        done += 1
    return done


def async_slot(distlock, alias, seconds, coroutines):
    """Return the acquire+release cycles ``coroutines`` coroutines on one loop made in ``seconds``."""
    async def run():
        ends = time.monotonic() + seconds
        return sum(await asyncio.gather(*(_cycles(distlock, alias, ends) for _ in range(coroutines))))

    return asyncio.run(run())


def run_alias(alias, *, coroutines, seconds, rounds):
    import distlock  # noqa: PLC0415 - after django.setup()

    sync_slot(distlock, alias, 0.2)  # warm-up: connections, scripts, the worker pool
    async_slot(distlock, alias, 0.2, coroutines)
    totals = {"sync": 0, "one": 0, "many": 0}
    for _ in range(rounds):
        totals["sync"] += sync_slot(distlock, alias, seconds)
        totals["one"] += async_slot(distlock, alias, seconds, 1)
        totals["many"] += async_slot(distlock, alias, seconds, coroutines)
    rates = {side: count / (seconds * rounds) for side, count in totals.items()}
    print(f"  | {alias:<12} | {rates['sync']:>10.0f} | {rates['one']:>13.0f} | {rates['many']:>14.0f} | "
          f"{rates['one'] / rates['sync']:>9.2f} | {rates['many'] / rates['sync']:>9.2f} |", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.asyncio_locks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--aliases", default=DEFAULT_ALIASES,
                        help=f"comma-separated DISTLOCK aliases (default: {DEFAULT_ALIASES})")
    parser.add_argument("--coroutines", type=int, default=50, help="coroutines of the N side (default 50)")
    parser.add_argument("--seconds", type=float, default=2.0, help="length of one slot (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="slots of each side (default 3)")
    args = parser.parse_args(argv)
    print(f"alock() vs lock(), uncontended acquire+release, ttl {TTL}s, {args.rounds} alternated slots of "
          f"{args.seconds:g}s per side (targets for Redis: 1 coroutine / sync >= {TARGET_ONE:g}, "
          f"{args.coroutines} coroutines / sync >= {TARGET_MANY:g})")
    print(f"  | {'alias':<12} | {'sync ops/s':>10} | {'1 coro ops/s':>13} | {f'{args.coroutines} coro ops/s':>14} | "
          f"{'1 / sync':>9} | {'N / sync':>9} |")
    for alias in configured_aliases(args.aliases.split(",")):
        try:
            run_alias(alias, coroutines=args.coroutines, seconds=args.seconds, rounds=args.rounds)
        except Exception:  # noqa: BLE001 - one broken alias must not hide the others' figures
            print(f"  [{alias}] failed:\n{traceback.format_exc(limit=3)}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    run_standalone(main)
