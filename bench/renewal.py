"""Many auto-renewed leases in one process: threads, CPU, calls to the server per renewal interval, leases lost.

    python -m tests.servers --servers redis,postgres -- .venv/bin/python -m bench.renewal \\
        [--aliases redis,postgres,default] [--leases 100,1000,10000] [--ttl 15] [--seconds 45]

For each alias and count: acquire that many leases with ``auto_renew=True`` on distinct names, then
watch for ``--seconds`` while this thread sleeps: every thread the process added, the CPU time of
the whole process in that window (renewal is all it does: a share of one core), the calls to the
server renewal made (``extend_many`` rounds, and single extensions) per renewal interval, and the
leases lost. Targets (issue 16): at most 2 threads added, CPU under 5 % of one core with 10,000
leases, at most 1 call per interval on Redis and the database, 0 lost.
"""

import argparse
import os
import threading
import time
import uuid

from bench import configured_aliases, run_standalone

THREADS_TARGET = 2
CPU_TARGET = 0.05
CALLS_PER_INTERVAL_TARGET = 1


def watch(alias, count, ttl, seconds):
    """Return (threads added, CPU share of one core, calls per interval, lost, seconds to acquire)."""
    import distlock  # noqa: PLC0415 - after django.setup()
    from distlock.backends.base import BaseLockBackend  # noqa: PLC0415
    from distlock.handler import locks  # noqa: PLC0415

    backend = locks[alias]
    distlock.acquire(f"bench:renewal:{uuid.uuid4().hex}", using=alias).release()  # connections, metrics thread
    threads_before = threading.active_count()
    prefix = f"bench:renewal:{uuid.uuid4().hex}"
    # A call to the server: a round of a backend that batches (its own extend_many), else each extension.
    batches = type(backend).extend_many is not BaseLockBackend.extend_many
    calls = []
    extend_many, extend = backend.extend_many, backend.extend

    def counting_extend_many(requests):
        if batches:
            calls.append(len(requests))
        return extend_many(requests)

    def counting_extend(lease, ttl):
        if not batches:
            calls.append(1)
        return extend(lease, ttl)

    started = time.monotonic()
    leases = [distlock.acquire(f"{prefix}:{index}", ttl=ttl, auto_renew=True, using=alias) for index in range(count)]
    acquiring = time.monotonic() - started
    backend.extend_many, backend.extend = counting_extend_many, counting_extend
    try:
        time.sleep(ttl / 3)  # past the first round, which the acquisitions spread out
        calls.clear()
        cpu, wall = time.process_time(), time.monotonic()
        time.sleep(seconds)
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
        threads_added = threading.active_count() - threads_before
        lost = sum(1 for lease in leases if lease.lost)
    finally:
        del backend.extend_many, backend.extend
        for lease in leases:
            lease.release()
    intervals = wall / (ttl / 3)
    return threads_added, cpu / wall, len(calls) / intervals, lost, acquiring


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.renewal", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--aliases", default="redis,postgres,default",
                        help="comma-separated DISTLOCK aliases (default: redis,postgres,default)")
    parser.add_argument("--leases", default="1000,10000", help="comma-separated lease counts (default 1000,10000)")
    parser.add_argument("--ttl", type=float, default=15.0, help="ttl of each lease, seconds (default 15)")
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds watched per row (default 30)")
    args = parser.parse_args(argv)
    counts = [int(count) for count in args.leases.split(",")]
    print(f"Auto-renewed leases in one process, ttl {args.ttl:g}s (renewed every {args.ttl / 3:g}s), watched for "
          f"{args.seconds:g}s after the first round. Targets: threads added <= {THREADS_TARGET}, CPU < "
          f"{CPU_TARGET:.0%} of one core, calls per interval <= {CALLS_PER_INTERVAL_TARGET} (Redis, database), "
          "0 lost.")
    print(f"  {'alias':<10}{'leases':>8}{'acquired in':>13}{'threads added':>15}{'CPU of a core':>15}"
          f"{'calls/interval':>16}{'lost':>6}")
    for alias in configured_aliases(args.aliases.split(",")):
        for count in counts:
            try:
                added, cpu, calls, lost, acquiring = watch(alias, count, args.ttl, args.seconds)
            except Exception as exc:  # noqa: BLE001 - one broken alias must not hide the others' figures
                print(f"  {alias:<10}{count:>8}  failed: {type(exc).__name__}: {exc}")
                continue
            print(f"  {alias:<10}{count:>8}{acquiring:>12.1f}s{added:>15}{cpu:>15.1%}{calls:>16.2f}{lost:>6}",
                  flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    run_standalone(main)
