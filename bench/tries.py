"""Contended tries: grants/s of back-to-back non-blocking tries on one name, per alias, next to Redis.

    python -m tests.servers -- python -m bench.tries [--seconds 8] [--rounds 1] [--aliases redis,etcd]

``processes`` worker processes x ``threads`` threads each (default 2 x 20, the shape of issue 21)
call ``distlock.acquire(name, blocking=False, ttl=..., using=alias)`` back to back on one name; a
thread that is granted the lock holds it ``hold_ms`` (3 ms) and releases it. Every alias runs in
the same worker processes, in interleaved slots of ``seconds`` on a fresh name, so the figures
compare under the same load. Printed per alias (median slot):

- *grants/s* and *tries/s*; *grant %*: the share of tries that got the lock;
- *held %*: the share of the slot during which some thread held the lock (from the grant's return
  to the release's return);
- *errors*: tries or releases that raised anything but ``LockNotAcquired``; *overlaps*: pairs of
  critical sections (grant's return .. release call) of different threads that intersected in time
  (must be 0);
- *vs redis*: the alias's grants/s over the ``redis`` alias's in the same run;
- *alone/s*: grants/s of one thread trying back to back on its own (same holds, same processes
  idle otherwise), and *vs alone*, the contended rate over it. A hand-off needs the release to land
  and a try to follow it, about what one thread alone does, so contention should cost little. A
  lock that is free much of the time (low held %) and granted far less often than alone, while
  hundreds of tries a second miss it, is one whose tries fail each other.

locmem is left out: its locks are per process, so the two processes would not contend.
``DISTLOCK_BENCH_TRIES_SECONDS`` sets the slot length when ``python -m bench`` runs this module.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid

from django.conf import settings

from bench import run_standalone
from bench.harness import run_schedule, stop_workers, wait_until_ready

#: The alias every other alias's grant rate is compared with.
REFERENCE = "redis"
#: Slot length when ``python -m bench`` runs this module (it passes no arguments).
SECONDS_VARIABLE = "DISTLOCK_BENCH_TRIES_SECONDS"
DEFAULT_SECONDS = 2.0
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shared_aliases(aliases=None):
    """Return the configured aliases whose locks are shared between processes (not locmem), in settings order."""
    from django.utils.module_loading import import_string  # noqa: PLC0415

    from distlock.backends.locmem import LocMemBackend  # noqa: PLC0415

    chosen = []
    for alias in aliases or settings.DISTLOCK:
        try:
            backend_cls = import_string(settings.DISTLOCK[alias]["BACKEND"])
        except ImportError as exc:
            print(f"[{alias}] skipped: its backend cannot be imported ({exc})")
            continue
        if issubclass(backend_cls, LocMemBackend):
            print(f"[{alias}] skipped: locmem locks are per process, so its processes would not contend")
            continue
        chosen.append(alias)
    return chosen


# -- the parent -----------------------------------------------------------------------------------

def measure(aliases, *, processes=2, threads=20, seconds=2.0, rounds=2, hold_ms=3.0, ttl=10.0, gap=0.5):
    """Return ``{alias: [slot figures]}``: every alias's slots, interleaved, run by the same worker processes."""
    config = {"aliases": aliases, "threads": threads, "hold_ms": hold_ms, "ttl": ttl}
    workers = [_spawn_worker({**config, "index": index}) for index in range(processes)]
    try:
        wait_until_ready(workers)
        begin = time.monotonic_ns() + int(0.3e9)
        step = int((seconds + gap) * 1e9)
        slots = []
        # Per round: every alias contended, then every alias tried by one thread alone (its best grant rate).
        shapes = [(alias, processes, threads) for alias in aliases] + [(alias, 1, 1) for alias in aliases]
        for index in range(rounds * len(shapes)):
            alias, active_processes, active_threads = shapes[index % len(shapes)]
            start = begin + index * step
            slots.append({"alias": alias, "name": f"bench:tries:{uuid.uuid4().hex}", "processes": active_processes,
                          "threads": active_threads, "start": start, "end": start + int(seconds * 1e9)})
        reports = run_schedule(workers, slots, seconds + gap)
    finally:
        stop_workers(workers)
    figures = {alias: {"contended": [], "alone": []} for alias in aliases}
    for index, slot in enumerate(slots):
        shape = "alone" if slot["threads"] == 1 else "contended"
        figures[slot["alias"]][shape].append(score(slot, [report[index] for report in reports]))
    return figures


def score(slot, per_worker):
    """Return one slot's figures from each worker's ``{"tries", "grants", "errors", "holds", "error"}``.

    A hold is ``(granted, left, released, holder)``: the grant's return, the end of the critical
    section (the release call) and the release's return, monotonic ns.
    """
    seconds = (slot["end"] - slot["start"]) / 1e9
    tries = sum(record["tries"] for record in per_worker)
    grants = sum(record["grants"] for record in per_worker)
    holds = sorted(tuple(hold) for record in per_worker for hold in record["holds"])
    held_ns = sum(min(released, slot["end"]) - max(start, slot["start"]) for start, _, released, _ in holds
                  if released > slot["start"] and start < slot["end"])
    return {"grants": grants / seconds, "tries": tries / seconds, "held": held_ns / (slot["end"] - slot["start"]),
            "errors": sum(record["errors"] for record in per_worker), "overlaps": overlaps(holds),
            "error": next((record["error"] for record in per_worker if record["error"]), None)}


def overlaps(holds):
    """Count pairs of critical sections ``(start, end, _, holder)`` of different holders that intersect (sorted)."""
    count = 0
    for index, (start, end, _, holder) in enumerate(holds):
        for other_start, _, _, other in holds[index + 1:]:
            if other_start >= end:
                break
            count += other != holder
    return count


def print_figures(figures, *, processes, threads, seconds, rounds, hold_ms):
    print(f"\nContended tries: {processes} processes x {threads} threads, acquire(blocking=False) back to back "
          f"on one name, {hold_ms:g} ms holds ({rounds} interleaved slot(s) of {seconds:g} s per alias and shape, "
          "medians)")
    print(f"  {'alias':<12}{'grants/s':>10}{'tries/s':>10}{'grant %':>9}{'held %':>8}{'errors':>8}{'overlaps':>10}"
          f"{'vs ' + REFERENCE:>10}{'alone/s':>9}{'vs alone':>10}")
    reference = figures.get(REFERENCE)
    reference_grants = statistics.median(slot["grants"] for slot in reference["contended"]) if reference else None
    errors = []
    for alias, shapes in figures.items():
        slots = shapes["contended"]
        grants, tries, held = (statistics.median(slot[key] for slot in slots) for key in ("grants", "tries", "held"))
        alone = statistics.median(slot["grants"] for slot in shapes["alone"])
        ratio = f"{grants / reference_grants:9.2f}x" if reference_grants else f"{'—':>10}"
        print(f"  {alias:<12}{grants:>10.0f}{tries:>10.0f}{100 * grants / tries if tries else 0:>8.1f}%"
              f"{100 * held:>7.1f}%{sum(slot['errors'] for slot in slots):>8}"
              f"{sum(slot['overlaps'] for slot in slots):>10}{ratio}{alone:>9.0f}"
              f"{grants / alone if alone else 0:>9.2f}x")
        errors += [(alias, slot["error"]) for slot in slots + shapes["alone"] if slot["error"]][:1]
    print("  held %: share of the time the lock was held (grant returned .. release returned); alone/s: one "
          "thread trying alone; vs alone far below 1 with held % low: tries fail each other")
    for alias, error in errors:
        print(f"  first error ({alias}): {error}")
    if reference_grants is None:
        print(f"  (no '{REFERENCE}' alias in this run: start the Redis server for the ratio)")


def run(*, aliases=None, processes=2, threads=20, seconds=DEFAULT_SECONDS, rounds=2, hold_ms=3.0, ttl=10.0):
    aliases = shared_aliases(aliases)
    if not aliases:
        print("Contended tries: no alias shared between processes is configured; skipped.")
        return
    figures = measure(aliases, processes=processes, threads=threads, seconds=seconds, rounds=rounds,
                      hold_ms=hold_ms, ttl=ttl)
    print_figures(figures, processes=processes, threads=threads, seconds=seconds, rounds=rounds, hold_ms=hold_ms)


def _spawn_worker(config):
    from tests.workers import child_env  # noqa: PLC0415 - the test settings' aliases and databases

    return subprocess.Popen([sys.executable, "-m", "bench.tries", "--worker", json.dumps(config)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env(), cwd=ROOT)


# -- a worker process ------------------------------------------------------------------------------

def _try_loop(acquire, not_acquired, slots, ttl, hold, position, out):
    """One thread: for each slot, try back to back from its start to its end; append its figures to ``out``.

    The threads live for the whole schedule (no thread starts or ends between slots), so the
    figures are the tries' own, not those of threads coming and going. ``position`` is
    (worker index, thread index): a slot runs on its first ``processes`` x ``threads`` of them.
    """
    clock, me = time.monotonic_ns, f"{os.getpid()}:{threading.get_native_id()}"
    for slot in slots:
        record = {"tries": 0, "grants": 0, "errors": 0, "holds": [], "error": None}
        out.append(record)
        if position[0] >= slot["processes"] or position[1] >= slot["threads"]:
            continue
        delay = (slot["start"] - clock()) / 1e9
        if delay > 0:
            time.sleep(delay)
        name, alias, end = slot["name"], slot["alias"], slot["end"]
        while clock() < end:
            record["tries"] += 1
            try:
                lease = acquire(name, blocking=False, ttl=ttl, using=alias)
            except not_acquired:
                continue
            except Exception as exc:  # noqa: BLE001 - counted and shown; the loop goes on
                record["errors"] += 1
                record["error"] = record["error"] or f"{type(exc).__name__}: {exc}"
                continue
            entered = clock()
            time.sleep(hold)
            left = clock()
            try:
                lease.release()
            except Exception as exc:  # noqa: BLE001
                record["errors"] += 1
                record["error"] = record["error"] or f"release: {type(exc).__name__}: {exc}"
            record["grants"] += 1
            record["holds"].append((entered, left, clock(), me))


def _run_worker(config):
    """Build every alias's backend, say ready, read the schedule, run it with ``threads`` threads, print one report."""
    import django  # noqa: PLC0415

    django.setup()
    import distlock  # noqa: PLC0415

    for alias in config["aliases"]:  # warm up: connections, sessions, scripts
        distlock.acquire(f"bench:warmup:{uuid.uuid4().hex}", ttl=config["ttl"], using=alias).release()
    print("ready", flush=True)
    slots = json.loads(sys.stdin.readline())
    outs = [[] for _ in range(config["threads"])]
    threads = [threading.Thread(target=_try_loop, name=f"bench-tries-{index}",
                                args=(distlock.acquire, distlock.LockNotAcquired, slots, config["ttl"],
                                      config["hold_ms"] / 1000, (config["index"], index), out))
               for index, out in enumerate(outs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    report = []
    for index in range(len(slots)):
        records = [out[index] for out in outs]
        report.append({"tries": sum(r["tries"] for r in records), "grants": sum(r["grants"] for r in records),
                       "errors": sum(r["errors"] for r in records),
                       "holds": [hold for r in records for hold in r["holds"]],
                       "error": next((r["error"] for r in records if r["error"]), None)})
    print(json.dumps(report), flush=True)


def main(argv):
    parser = argparse.ArgumentParser(prog="python -m bench.tries", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--aliases", help="comma-separated DISTLOCK aliases (default: every shared one)")
    parser.add_argument("--seconds", type=float, default=float(os.environ.get(SECONDS_VARIABLE, DEFAULT_SECONDS)),
                        help=f"length of a slot (default ${SECONDS_VARIABLE} or {DEFAULT_SECONDS:g})")
    parser.add_argument("--rounds", type=int, default=2, help="slots per alias, interleaved (default 2)")
    parser.add_argument("--processes", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--threads", type=int, default=20, help="threads per process (default 20)")
    parser.add_argument("--hold-ms", type=float, default=3.0, help="hold of a granted try (default 3)")
    parser.add_argument("--ttl", type=float, default=10.0, help="ttl of each try (default 10)")
    args = parser.parse_args(argv)
    run(aliases=args.aliases.split(",") if args.aliases else None, processes=args.processes, threads=args.threads,
        seconds=args.seconds, rounds=args.rounds, hold_ms=args.hold_ms, ttl=args.ttl)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _run_worker(json.loads(sys.argv[2]))
    else:
        run_standalone(main)
