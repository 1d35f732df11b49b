"""Throughput as processes grow: 1 to 16 client processes on distinct names, per alias, next to its floor.

    python -m tests.servers -- python -m bench.processes [--processes 1,2,4,8,16] [--seconds 3] [--aliases redis]

For each alias whose server is up (``default`` is SQLite, then ``postgres``, ``redis``, ``redlock``,
``zookeeper``, ``etcd``), N worker processes loop uncontended acquire+release through the public API
(``distlock.acquire(name, ttl=..., using=alias).release()``), each on a name of its own, from a common
start time to a common end; then the same N processes run the alias's bare-protocol floor (the
``floor()`` of ``bench/database_baselines.py``, ``bench/redis_baselines.py``,
``bench/redlock_baselines.py``, ``bench/zookeeper_baselines.py`` or ``bench/etcd_baselines.py``, the
code the baselines' floor rows run) in the slot after, rounds interleaved. Printed per alias and N:
aggregate acquire+release pairs per second, the p99 of one pair's latency over every process, the
floor's two figures, and the ratio distlock/floor (median over rounds of the two figures measured
side by side).

An alias whose backend has no floor in ``bench/`` (locmem, Redis set by ``CACHE``, Redlock under 5 masters)
shows distlock's figures alone. The header gives the machine's core count: beyond it the processes
share cores, so the curve then measures the client's CPU cost as much as the server's.

The worker processes start once per alias (the most processes asked for), build both contenders and
warm them up; a slot runs on the first N of them while the others wait. The schedule, the start
signal and the report go through ``bench.harness``'s ``run_schedule``. ``DISTLOCK_BENCH_PROCESSES_SECONDS``
sets the slot length when ``python -m bench`` runs this module.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid

from django.conf import settings

from bench import configured_aliases, run_standalone
from bench.harness import ContenderSpec, run_schedule, stop_workers, wait_until_ready

#: The aliases of the test settings measured by default, in this order (locmem is per process).
ALIASES = ("default", "postgres", "redis", "redlock", "zookeeper", "etcd")
#: The server ``python -m tests.servers`` starts for each alias but the embedded SQLite one.
#: Slot length when ``python -m bench`` runs this module (it passes no arguments).
SECONDS_VARIABLE = "DISTLOCK_BENCH_PROCESSES_SECONDS"
DEFAULT_SECONDS = 3.0
DEFAULT_PROCESSES = (1, 2, 4, 8, 16)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def floor_spec(alias):
    """Return the ``ContenderSpec`` of ``alias``'s bare-protocol floor from the baselines modules, or None."""
    from bench import (  # noqa: PLC0415
        database_baselines,
        etcd_baselines,
        redis_baselines,
        redlock_baselines,
        zookeeper_baselines,
    )

    options = settings.DISTLOCK[alias].get("OPTIONS", {})
    if alias in database_baselines.database_aliases():
        return ContenderSpec("floor", "bench.database_baselines.floor",
                             {"database": database_baselines.lock_database(alias)})
    if alias in redis_baselines.redis_aliases():
        return ContenderSpec("floor", "bench.redis_baselines.floor", {"url": options["URL"]})
    if alias in redlock_baselines.redlock_aliases():
        return ContenderSpec("floor", "bench.redlock_baselines.floor", {"urls": list(options["URLS"])})
    if alias in zookeeper_baselines.zookeeper_aliases():
        from distlock.handler import locks  # noqa: PLC0415

        return ContenderSpec("floor", "bench.zookeeper_baselines.floor", {"hosts": locks[alias].settings["HOSTS"]})
    if alias in etcd_baselines.etcd_aliases():
        return ContenderSpec("floor", "bench.etcd_baselines.floor",
                             {"endpoint": etcd_baselines.first_endpoint(options)})
    return None



# -- the parent -----------------------------------------------------------------------------------

def measure(alias, floor, *, processes, seconds, rounds, ttl=30.0, gap=0.5):
    """Return ``{label: {n: [slot figures]}}`` for distlock (and the floor) on ``alias``, slots interleaved."""
    specs = [ContenderSpec("distlock", "bench.harness.alias_contender", {"alias": alias, "ttl": ttl})]
    if floor is not None:
        specs.append(floor)
    workers = [_spawn_worker({"specs": [spec.__dict__ for spec in specs], "index": index})
               for index in range(max(processes))]
    try:
        wait_until_ready(workers)
        begin = time.monotonic_ns() + int(1e9)
        step = int((seconds + gap) * 1e9)
        shapes = []
        for count in processes:
            for round_index in range(rounds):
                # Each round starts with the other contender: neither always runs after the same one.
                shift = round_index % len(specs)
                shapes += [(spec.label, count) for spec in specs[shift:] + specs[:shift]]
        slots = []
        for index, (label, count) in enumerate(shapes):
            start = begin + index * step
            slots.append({"label": label, "processes": count, "name": f"bench:processes:{uuid.uuid4().hex}",
                          "start": start, "end": start + int(seconds * 1e9)})
        reports = run_schedule(workers, slots, seconds + gap)
    finally:
        stop_workers(workers)
    figures = {spec.label: {count: [] for count in processes} for spec in specs}
    for index, slot in enumerate(slots):
        figures[slot["label"]][slot["processes"]].append(score(slot, [report[index] for report in reports]))
    return figures


def score(slot, per_worker):
    """Return one slot's figures from each active worker's ``{"pairs", "latencies_us", "errors", "error"}``."""
    active = per_worker[:slot["processes"]]
    latencies = sorted(latency for record in active for latency in record["latencies_us"])
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] / 1000 if latencies else float("nan")
    return {"ops": sum(record["pairs"] for record in active) / ((slot["end"] - slot["start"]) / 1e9),
            "p99_ms": p99, "errors": sum(record["errors"] for record in active),
            "error": next((record["error"] for record in active if record["error"]), None)}


def print_table(alias, figures, *, seconds, rounds):
    """Print one alias's table: distlock and its floor at each process count, and their ratio."""
    ours, floor = figures["distlock"], figures.get("floor")
    print(f"\n[{alias}] uncontended acquire+release on distinct names, N processes "
          f"({rounds} interleaved round(s) of {seconds:g} s, medians; {os.cpu_count()} cores)")
    if floor is None:
        print("  (no bare-protocol floor in bench/*_baselines.py for this backend)")
    print(f"  | {'processes':>9} | {'distlock ops/s':>14} | {'p99 ms':>8} | {'floor ops/s':>11} | "
          f"{'floor p99 ms':>12} | {'ratio':>6} |")
    print(f"  |{'-' * 11}|{'-' * 16}|{'-' * 10}|{'-' * 13}|{'-' * 14}|{'-' * 8}|")
    errors = []
    for count, slots in ours.items():
        ops, p99 = (statistics.median(slot[key] for slot in slots) for key in ("ops", "p99_ms"))
        if floor is None:
            floor_ops = floor_p99 = ratio = "—"
        else:
            floor_ops = f"{statistics.median(slot['ops'] for slot in floor[count]):.0f}"
            floor_p99 = f"{statistics.median(slot['p99_ms'] for slot in floor[count]):.2f}"
            ratios = [a["ops"] / b["ops"] for a, b in zip(slots, floor[count]) if b["ops"]]
            ratio = f"{statistics.median(ratios):.2f}x" if ratios else "—"
        print(f"  | {count:>9} | {ops:>14.0f} | {p99:>8.2f} | {floor_ops:>11} | {floor_p99:>12} | {ratio:>6} |")
        for label, by_count in figures.items():
            failed = [slot for slot in by_count[count] if slot["errors"]]
            if failed:
                errors.append((label, count, sum(slot["errors"] for slot in failed), failed[0]["error"]))
    for label, count, number, error in errors:
        print(f"  {label}, {count} processes: {number} failed acquire+release pair(s); first: {error}")


def run(*, aliases=ALIASES, processes=DEFAULT_PROCESSES, seconds=DEFAULT_SECONDS, rounds=1):
    print(f"Throughput as processes grow: {', '.join(map(str, processes))} processes; this machine has "
          f"{os.cpu_count()} cores (more processes than cores share them)")
    for alias in configured_aliases(aliases):
        try:
            floor = floor_spec(alias)
            figures = measure(alias, floor, processes=processes, seconds=seconds, rounds=rounds)
        except Exception as exc:  # noqa: BLE001 - one broken alias must not hide the others' figures
            print(f"\n[{alias}] failed: {type(exc).__name__}: {exc}")
            continue
        print_table(alias, figures, seconds=seconds, rounds=rounds)


def _spawn_worker(config):
    from tests.workers import child_env  # noqa: PLC0415 - the test settings' aliases and databases

    return subprocess.Popen([sys.executable, "-m", "bench.processes", "--worker", json.dumps(config)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env(), cwd=ROOT)


# -- a worker process ------------------------------------------------------------------------------

def _run_worker(config):
    """Build and warm up the contenders, say ready, read the schedule, run its slots, print one JSON report.

    A slot runs only on workers whose index is below its ``processes``; each loops on its own name
    (the slot's name and the worker's index) from the slot's start to its end.
    """
    import django  # noqa: PLC0415

    django.setup()
    contenders = {spec["label"]: ContenderSpec(**spec).build() for spec in config["specs"]}
    for contender in contenders.values():  # warm up: connections, sessions, scripts, imports
        name = f"bench:warmup:{uuid.uuid4().hex}"
        for _ in range(20):
            contender.release(contender.acquire(name))
    print("ready", flush=True)
    slots = json.loads(sys.stdin.readline())
    clock, report = time.monotonic_ns, []
    for slot in slots:
        record = {"pairs": 0, "latencies_us": [], "errors": 0, "error": None}
        report.append(record)
        if config["index"] >= slot["processes"]:
            continue
        contender = contenders[slot["label"]]
        acquire, release, latencies = contender.acquire, contender.release, record["latencies_us"]
        name = f"{slot['name']}:{config['index']}"
        delay = (slot["start"] - clock()) / 1e9
        if delay > 0:
            time.sleep(delay)
        end, pairs, now = slot["end"], 0, clock()
        while now < end:
            try:
                release(acquire(name))
            except Exception as exc:  # noqa: BLE001 - counted and shown; the loop goes on
                record["errors"] += 1
                record["error"] = record["error"] or f"{type(exc).__name__}: {exc}"
                now = clock()
                continue
            finished = clock()
            latencies.append((finished - now) // 1000)
            if finished <= end:
                pairs += 1
            now = finished
        record["pairs"] = pairs
    print(json.dumps(report), flush=True)


def main(argv):
    parser = argparse.ArgumentParser(prog="python -m bench.processes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--aliases", help=f"comma-separated DISTLOCK aliases (default: {','.join(ALIASES)})")
    parser.add_argument("--processes", default=",".join(map(str, DEFAULT_PROCESSES)),
                        help="comma-separated process counts (default 1,2,4,8,16)")
    parser.add_argument("--seconds", type=float, default=float(os.environ.get(SECONDS_VARIABLE, DEFAULT_SECONDS)),
                        help=f"length of a slot (default ${SECONDS_VARIABLE} or {DEFAULT_SECONDS:g})")
    parser.add_argument("--rounds", type=int, default=1, help="slots per contender and process count (default 1)")
    args = parser.parse_args(argv)
    processes = [int(count) for count in args.processes.split(",") if count]
    if not processes or min(processes) < 1:
        parser.error("--processes takes positive counts, e.g. 1,2,4")
    run(aliases=args.aliases.split(",") if args.aliases else ALIASES, processes=processes, seconds=args.seconds,
        rounds=args.rounds)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _run_worker(json.loads(sys.argv[2]))
    else:
        run_standalone(main)
