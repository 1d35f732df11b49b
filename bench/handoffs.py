"""Contended hand-offs on the database backend: 4 processes on one lock per alias, this checkout next to another.

    python -m tests.servers --servers postgres -- python -m bench.handoffs [--before /tmp/before] \\
        [--aliases default,postgres] [--processes 4] [--seconds 3] [--rounds 2] [--hold-ms 0]

For each database alias (``default`` is SQLite, ``postgres`` PostgreSQL), ``processes`` worker
processes loop ``distlock.acquire(name, ttl=30, timeout=5, using=alias)`` → critical section
(``hold_ms``) → ``lease.release()`` on one name per slot. With ``--before``, as many workers run the
``distlock`` of that checkout (``git worktree add /tmp/before <commit>``), each with its checkout as
working directory and first on ``sys.path``, so the polling code before the waiter queue and NOTIFY
runs beside this checkout's, in slots that alternate between the two sides, on the same databases
(made by this process with this checkout's schema). The loop is this file's on both sides; only
``distlock`` differs. Printed per alias and side (median slot):

- *CS/s*: critical sections per second; *hand-offs/s*: consecutive critical sections of different
  processes per second;
- *wait p50/p99 ms*: time in ``acquire``, from the call to its return;
- *Jain*: Jain's fairness index over the processes' critical-section counts (1.0: equal shares);
  *max share*: the largest process's share of the critical sections;
- *unavailable*: acquires or releases that raised ``BackendUnavailable`` (summed over slots);
  *timeouts*: acquires that ran out of their 5 s (``LockNotAcquired``, summed).

``python -m bench`` runs this module without ``--before``: this checkout alone.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The aliases of the test settings measured by default: SQLite, then PostgreSQL.
ALIASES = ("default", "postgres")
#: The caller's timeout of every acquire in the loop.
TIMEOUT = 5
SIDES = ("after", "before")


def database_aliases(aliases):
    """Return those of ``aliases`` that are configured with the database backend, saying which are skipped."""
    from django.conf import settings  # noqa: PLC0415

    chosen = []
    for alias in aliases:
        entry = settings.DISTLOCK.get(alias)
        if entry is None or entry.get("BACKEND") != "distlock.backends.database.DatabaseBackend":
            print(f"[{alias}] skipped: not a database alias of these settings (start its server: --servers postgres)")
            continue
        chosen.append(alias)
    return chosen


def _spawn(tree, alias, hold_ms):
    from tests.workers import child_env  # noqa: PLC0415 - the test settings' aliases and databases

    # -P: this file's directory (bench/, which holds modules named like packages) stays off sys.path.
    arguments = json.dumps({"alias": alias, "hold_ms": hold_ms, "tree": tree})
    return subprocess.Popen([sys.executable, "-P", os.path.abspath(__file__), "--worker", arguments],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env(PYTHONPATH=tree), cwd=tree)


def measure(alias, trees, *, processes, seconds, rounds, hold_ms, gap=0.5):
    """Return ``{side: [slot figures]}``: each side's workers contend in turn, slots alternating between sides."""
    from bench.harness import run_schedule, stop_workers, wait_until_ready  # noqa: PLC0415

    workers = {side: [_spawn(tree, alias, hold_ms) for _ in range(processes)] for side, tree in trees.items()}
    everyone = [worker for side in workers.values() for worker in side]
    try:
        wait_until_ready(everyone)
        begin, step = time.monotonic_ns() + int(0.5e9), int((seconds + gap) * 1e9)
        slots = []
        for index in range(rounds * len(trees)):
            side = list(trees)[(index + index // len(trees)) % len(trees)]  # each round starts with the other side
            start = begin + index * step
            slots.append({"side": side, "name": f"bench:handoffs:{uuid.uuid4().hex}", "start": start,
                          "end": start + int(seconds * 1e9)})
        # Every worker gets the whole schedule and sits out the other side's slots.
        reports = run_schedule(everyone, slots, seconds + gap)
    finally:
        stop_workers(everyone)
    figures = {side: [] for side in trees}
    for index, slot in enumerate(slots):
        side_reports = [report[index] for worker, report in zip(everyone, reports) if worker in workers[slot["side"]]]
        figures[slot["side"]].append(score(slot, side_reports))
    return figures


def score(slot, per_worker):
    """Return one slot's figures from each of its side's workers' ``{"pid", "enters", "waits", ...}``."""
    seconds = (slot["end"] - slot["start"]) / 1e9
    events = sorted((enter, record["pid"]) for record in per_worker for enter in record["enters"])
    waits = sorted(wait for record in per_worker for wait in record["waits"])
    counts = [len(record["enters"]) for record in per_worker]
    total = sum(counts)

    def percentile(fraction):
        return waits[min(len(waits) - 1, int(len(waits) * fraction))] / 1e6 if waits else float("nan")

    return {
        "cs": total / seconds,
        "handoffs": sum(1 for (_, before), (_, after) in zip(events, events[1:]) if before != after) / seconds,
        "p50": percentile(0.5), "p99": percentile(0.99),
        "jain": total * total / (len(counts) * sum(count * count for count in counts)) if total else 0.0,
        "max_share": max(counts) / total if total else float("nan"),
        "unavailable": sum(record["unavailable"] for record in per_worker),
        "timeouts": sum(record["timeouts"] for record in per_worker),
        "error": next((record["error"] for record in per_worker if record["error"]), None),
    }


def print_table(alias, figures, trees, *, processes, seconds, rounds, hold_ms):
    print(f"\n[{alias}] contended: {processes} processes on one lock, critical section {hold_ms:g} ms "
          f"({rounds} round(s) of {seconds:g} s per side, sides alternating; medians, errors summed)")
    print(f"  | {'side':<44} | {'CS/s':>6} | {'hand-offs/s':>11} | {'wait p50 ms':>11} | {'wait p99 ms':>11} | "
          f"{'Jain':>5} | {'max share':>9} | {'unavailable':>11} | {'timeouts':>8} |")
    print(f"  |{'-' * 46}|{'-' * 8}|{'-' * 13}|{'-' * 13}|{'-' * 13}|{'-' * 7}|{'-' * 11}|{'-' * 13}|{'-' * 10}|")
    for side, slots in figures.items():
        median = {key: statistics.median(slot[key] for slot in slots)
                  for key in ("cs", "handoffs", "p50", "p99", "jain", "max_share")}
        label = f"{side} ({trees[side]})"[:44]
        print(f"  | {label:<44} | {median['cs']:>6.0f} | {median['handoffs']:>11.1f} | {median['p50']:>11.1f} | "
              f"{median['p99']:>11.1f} | {median['jain']:>5.3f} | {median['max_share']:>9.3f} | "
              f"{sum(slot['unavailable'] for slot in slots):>11} | {sum(slot['timeouts'] for slot in slots):>8} |")
    for side, slots in figures.items():
        error = next((slot["error"] for slot in slots if slot["error"]), None)
        if error:
            print(f"  {side}: first error: {error}")
    if "before" in figures:
        after, before = figures["after"], figures["before"]
        ratios = [a["handoffs"] / b["handoffs"] for a, b in zip(after, before) if b["handoffs"]]
        if ratios:
            print(f"  hand-offs/s after/before: {statistics.median(ratios):.1f}x (median over rounds run back to back)")


def run(*, aliases=ALIASES, before=None, processes=4, seconds=3.0, rounds=2, hold_ms=0.0):
    trees = {"after": ROOT}
    if before is not None:
        trees["before"] = os.path.abspath(before)
    for alias in database_aliases(aliases):
        try:
            figures = measure(alias, trees, processes=processes, seconds=seconds, rounds=rounds, hold_ms=hold_ms)
        except Exception as exc:  # noqa: BLE001 - one broken alias must not hide the others' figures
            print(f"\n[{alias}] failed: {type(exc).__name__}: {exc}")
            continue
        print_table(alias, figures, trees, processes=processes, seconds=seconds, rounds=rounds, hold_ms=hold_ms)


# -- a worker process -------------------------------------------------------------------------------------

def _run_worker(config):
    """Loop acquire → hold → release in each slot of this worker's side; print one JSON report per slot."""
    import django  # noqa: PLC0415

    django.setup()
    import distlock  # noqa: PLC0415

    if os.path.dirname(os.path.dirname(os.path.abspath(distlock.__file__))) != os.path.abspath(config["tree"]):
        raise RuntimeError(f"imported {distlock.__file__}, not the distlock of {config['tree']}")
    alias, hold = config["alias"], config["hold_ms"] / 1000
    side = "after" if os.path.abspath(config["tree"]) == ROOT else "before"
    distlock.acquire(f"bench:warmup:{uuid.uuid4().hex}", ttl=30, using=alias).release()
    print("ready", flush=True)
    slots = json.loads(sys.stdin.readline())
    clock, pid, report = time.monotonic_ns, os.getpid(), []
    for slot in slots:
        record = {"pid": pid, "enters": [], "waits": [], "unavailable": 0, "timeouts": 0, "error": None}
        report.append(record)
        if slot["side"] != side:
            continue
        delay = (slot["start"] - clock()) / 1e9
        if delay > 0:
            time.sleep(delay)
        while (asked := clock()) < slot["end"]:
            try:
                lease = distlock.acquire(slot["name"], ttl=30, timeout=TIMEOUT, using=alias)
                entered = clock()
                if hold:
                    time.sleep(hold)
                lease.release()
            except distlock.LockNotAcquired:
                record["timeouts"] += 1
                continue
            except distlock.BackendUnavailable as exc:
                record["unavailable"] += 1
                record["error"] = record["error"] or f"{type(exc).__name__}: {exc}"
                continue
            if entered < slot["end"]:
                record["enters"].append(entered)
                record["waits"].append(entered - asked)
    print(json.dumps(report), flush=True)


def main(argv):
    parser = argparse.ArgumentParser(prog="python -m bench.handoffs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="another checkout to run side by side (the code before a change)")
    parser.add_argument("--aliases", default=",".join(ALIASES), help="comma-separated database aliases")
    parser.add_argument("--processes", type=int, default=4, help="contending processes per side (default 4)")
    parser.add_argument("--seconds", type=float, default=3.0, help="length of a slot (default 3)")
    parser.add_argument("--rounds", type=int, default=2, help="slots per side and alias (default 2)")
    parser.add_argument("--hold-ms", type=float, default=0.0, help="critical section in ms (default 0)")
    args = parser.parse_args(argv)
    run(aliases=args.aliases.split(","), before=args.before, processes=args.processes, seconds=args.seconds,
        rounds=args.rounds, hold_ms=args.hold_ms)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _run_worker(json.loads(sys.argv[2]))
    else:
        from bench import run_standalone  # noqa: PLC0415

        run_standalone(main)
