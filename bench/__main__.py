"""Run every benchmark: ``python -m tests.servers --servers redis,postgres -- python -m bench`` (``make bench``).

1. For each configured ``DISTLOCK`` alias (whatever servers were started): uncontended
   acquire+release ops/s with p50/p99, and, for aliases shared between processes, 4 processes
   contending for one key (critical sections/s, hand-offs/s, wait p99, Jain's fairness index).
2. ``bench.redis_baselines``: the Redis backend against the protocol floor, redis-py's ``Lock`` and
   python-redis-lock on the same server, with the target ratios.
3. Every other module of this package that has a ``main(argv)`` (e.g. ``bench.celery``), with its defaults;
   ``bench.tries`` (grants/s of contended non-blocking tries per alias, next to Redis) takes its slot
   length from ``DISTLOCK_BENCH_TRIES_SECONDS``, ``bench.listing`` (the admin page's first page and
   ``distlock list``'s stream with 1,000 to 100,000 locks held) its sizes from ``DISTLOCK_BENCH_LISTING_SIZES``,
   ``bench.processes`` (1 to 16 processes on distinct names per alias, next to the bare-protocol floor)
   its slot length from ``DISTLOCK_BENCH_PROCESSES_SECONDS``, and ``bench.handoffs`` (4 processes on one
   database lock: hand-offs/s, wait p50/p99, fairness, ``BackendUnavailable``) runs this checkout alone
   (``--before`` puts another checkout beside it).

The database backends need their tables: test databases are created (and dropped afterwards) as the
test runner does, and worker processes use them.
"""

import argparse
import importlib
import os
import pkgutil
import sys
import traceback

#: Modules this entry point runs itself; any other module with ``main(argv)`` is run after them.
OWN_MODULES = {"__main__", "harness", "redis_baselines"}


def alias_rows(aliases, args):
    from django.conf import settings  # noqa: PLC0415
    from django.utils.module_loading import import_string  # noqa: PLC0415

    from bench.harness import ContenderSpec, contended, print_contended, print_uncontended, uncontended  # noqa: PLC0415
    from distlock.backends.locmem import LocMemBackend  # noqa: PLC0415

    print(f"== distlock aliases: {', '.join(aliases)} ==")
    for alias in aliases:
        try:
            backend_cls = import_string(settings.DISTLOCK[alias]["BACKEND"])
        except ImportError as exc:
            print(f"\n[{alias}] skipped: its backend cannot be imported ({exc})")
            continue
        spec = ContenderSpec(f"distlock '{alias}'", "bench.harness.alias_contender", {"alias": alias})
        try:
            print_uncontended(uncontended([spec], seconds=args.seconds, rounds=args.rounds),
                              f"[{alias}] uncontended acquire+release, 1 process")
            # locmem locks are per process: four processes would not contend at all.
            if not issubclass(backend_cls, LocMemBackend):
                print_contended(contended([spec], seconds=args.contended_seconds, rounds=args.contended_rounds),
                                f"[{alias}] contended: 4 processes on one key")
        except Exception:  # noqa: BLE001 - one broken alias must not hide the others' figures
            print(f"\n[{alias}] failed:\n{traceback.format_exc(limit=3)}")


def other_modules():
    import bench  # noqa: PLC0415

    for module in sorted(info.name for info in pkgutil.iter_modules(bench.__path__)):
        if module not in OWN_MODULES:
            loaded = importlib.import_module(f"bench.{module}")
            if callable(getattr(loaded, "main", None)):
                yield module, loaded.main


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--aliases", help="comma-separated DISTLOCK aliases (default: every configured one)")
    parser.add_argument("--seconds", type=float, default=0.25, help="length of an uncontended round (default 0.25)")
    parser.add_argument("--rounds", type=int, default=4, help="uncontended rounds per alias (default 4)")
    parser.add_argument("--contended-seconds", type=float, default=2.0, help="length of a contended round (default 2)")
    parser.add_argument("--contended-rounds", type=int, default=2, help="contended rounds per alias (default 2)")
    parser.add_argument("--only", choices=["aliases", "redis", "others"], help="run one part only")
    args = parser.parse_args(argv)

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django  # noqa: PLC0415

    django.setup()
    from django.conf import settings  # noqa: PLC0415
    from django.db import connections  # noqa: PLC0415
    from django.test.utils import setup_databases, teardown_databases  # noqa: PLC0415

    from bench import redis_baselines  # noqa: PLC0415
    from distlock import metrics  # noqa: PLC0415
    from distlock.handler import locks  # noqa: PLC0415

    aliases = args.aliases.split(",") if args.aliases else list(settings.DISTLOCK)
    databases = setup_databases(verbosity=0, interactive=False)
    try:
        if args.only in (None, "aliases"):
            alias_rows(aliases, args)
        if args.only in (None, "redis"):
            redis_baselines.run()
        if args.only in (None, "others"):
            for module, module_main in other_modules():
                print(f"\n== bench.{module} ==", flush=True)
                module_main([])
    finally:
        # Write this process's pending lock metrics while their table exists, and close the database
        # backend's own connection: the test databases cannot be dropped while it is open.
        metrics.flush()
        locks.close_all()
        connections.close_all()
        teardown_databases(databases, verbosity=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
