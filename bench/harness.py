"""Measure any lock the same way: uncontended acquire+release, and 4 processes contending for one key.

A *contender* is anything with ``acquire(name) -> handle`` and ``release(handle)``, built in each
process by a factory named by dotted path (``ContenderSpec``), so distlock aliases and stock
recipes (``bench.redis_baselines``) run through identical loops:

- ``uncontended()``: one process, one key nobody else wants; acquire+release pairs per second, with
  p50/p99 of the pair's latency.
- ``contended()``: ``processes`` worker processes loop acquire → critical section → release on one
  key; it reports critical sections per second, hand-offs per second (consecutive critical
  sections by different processes), the p99 of the wait in ``acquire`` and Jain's fairness index
  over the processes' acquisition counts (1.0: equal shares; 1/n: one process starves the rest).

The machine is shared and noisy, so both run several short rounds that interleave the contenders
and report the median round: contenders compared in one call see the same load.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field

from django.utils.module_loading import import_string

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class ContenderSpec:
    """How to build a contender in any process: ``import_string(factory)(**kwargs)``."""

    label: str
    factory: str
    kwargs: dict = field(default_factory=dict)

    def build(self):
        return import_string(self.factory)(**self.kwargs)


class Contender:
    """A lock recipe reduced to the two calls the loops make."""

    def __init__(self, acquire, release):
        self.acquire = acquire
        self.release = release


def alias_contender(alias, ttl=30):
    """distlock through its public API, as applications call it: ``acquire()`` and ``lease.release()``."""
    import distlock  # noqa: PLC0415 - after django.setup()

    return Contender(lambda name: distlock.acquire(name, ttl=ttl, using=alias), lambda lease: lease.release())


def backend_contender(alias, ttl=30):
    """distlock's backend alone, without the API layer's argument checks, metrics and signals."""
    from distlock.handler import locks  # noqa: PLC0415

    backend = locks[alias]
    return Contender(lambda name: backend.acquire(name, ttl=ttl, timeout=None, blocking=True), backend.release)


# -- uncontended ----------------------------------------------------------------------------------

@dataclass
class Uncontended:
    label: str
    rounds: list = field(default_factory=list)  # ops/s of each round
    latencies_ns: list = field(default_factory=list)

    @property
    def ops(self):
        return statistics.median(self.rounds)

    def percentile_us(self, fraction):
        ordered = sorted(self.latencies_ns)
        return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))] / 1000


def uncontended(specs, *, seconds=0.25, rounds=8):
    """Return ``{label: Uncontended}``: each spec loops acquire+release for ``seconds``, ``rounds`` times, interleaved."""
    contenders = [(spec.label, spec.build()) for spec in specs]
    results = {label: Uncontended(label) for label, _ in contenders}
    for label, contender in contenders:  # warm up: connections, script cache, imports
        name = f"bench:warmup:{uuid.uuid4().hex}"
        for _ in range(20):
            contender.release(contender.acquire(name))
    for round_index in range(rounds):
        # Each round starts one contender later: none always runs right after the same one (a server
        # still busy with the previous contender's leftovers would always slow the same one).
        shift = round_index % len(contenders)
        for label, contender in contenders[shift:] + contenders[:shift]:
            name = f"bench:uncontended:{uuid.uuid4().hex}"
            acquire, release, clock = contender.acquire, contender.release, time.perf_counter_ns
            latencies = results[label].latencies_ns
            started = clock()
            end = started + int(seconds * 1e9)
            count = 0
            now = started
            while now < end:
                release(acquire(name))
                finished = clock()
                latencies.append(finished - now)
                now = finished
                count += 1
            results[label].rounds.append(count / ((now - started) / 1e9))
    return results


def print_uncontended(results, title):
    print(f"\n{title}")
    print(f"  {'contender':<34}{'ops/s':>10}{'p50 µs':>10}{'p99 µs':>10}")
    for result in results.values():
        print(f"  {result.label:<34}{result.ops:>10.0f}{result.percentile_us(0.5):>10.0f}"
              f"{result.percentile_us(0.99):>10.0f}")


# -- contended ------------------------------------------------------------------------------------

@dataclass
class Slot:
    """One round of one contender: every worker loops on ``name`` from ``start`` to ``end`` (monotonic ns)."""

    label: str
    name: str
    start: int
    end: int


@dataclass
class Contended:
    label: str
    critical_sections: list = field(default_factory=list)  # per second, one entry per round
    handoffs: list = field(default_factory=list)
    wait_p99_ms: list = field(default_factory=list)
    jain: list = field(default_factory=list)

    def median(self, metric):
        return statistics.median(getattr(self, metric))


def jain_index(counts):
    """Jain's fairness index: (Σx)² / (n·Σx²); 1.0 when every process got the same share."""
    total = sum(counts)
    return total * total / (len(counts) * sum(count * count for count in counts)) if total else 0.0


def wait_until_ready(workers):
    """Wait for each bench worker's "ready" line; raise with its stderr if one failed to start."""
    for worker in workers:
        line = worker.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"bench worker failed to start:\n{line}{worker.stderr.read()[-4000:]}")


def run_schedule(workers, slots, slot_seconds):
    """Send every worker the schedule ``slots`` (JSON-able dicts); return each worker's last JSON line."""
    schedule = json.dumps(slots)
    for worker in workers:
        worker.stdin.write(schedule + "\n")
        worker.stdin.flush()
    reports = []
    for worker in workers:
        out, err = worker.communicate(timeout=len(slots) * slot_seconds + 120)
        if worker.returncode != 0:
            raise RuntimeError(f"bench worker exited with {worker.returncode}:\n{err[-4000:]}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def stop_workers(workers):
    """Kill the workers still running (after a failure)."""
    for worker in workers:
        if worker.poll() is None:
            worker.kill()
            worker.communicate()


def contended(specs, *, processes=4, seconds=2.0, rounds=3, gap=0.5, hold_ms=0.0):
    """Return ``{label: Contended}``: ``processes`` workers contend for one key per round, contenders interleaved.

    The workers start once, build every contender and warm it up, then run the same schedule of
    slots; each slot uses a fresh key, and a gap lets the last holder of a slot finish first.
    """
    workers = [_spawn_worker(specs, hold_ms) for _ in range(processes)]
    try:
        wait_until_ready(workers)
        begin = time.monotonic_ns() + int(0.2e9)
        slots, step = [], int((seconds + gap) * 1e9)
        for index in range(rounds * len(specs)):
            spec = specs[index % len(specs)]
            start = begin + index * step
            slots.append(Slot(spec.label, f"bench:contended:{uuid.uuid4().hex}", start, start + int(seconds * 1e9)))
        reports = run_schedule(workers, [slot.__dict__ for slot in slots], seconds + gap)
    finally:
        stop_workers(workers)
    results = {spec.label: Contended(spec.label) for spec in specs}
    for index, slot in enumerate(slots):
        _score(results[slot.label], slot, [report[index] for report in reports])
    return results


def _score(result, slot, per_worker):
    """Add one slot's figures: ``per_worker`` is each worker's ``{"pid", "enters", "waits"}`` for the slot."""
    seconds = (slot.end - slot.start) / 1e9
    events = sorted((enter, record["pid"]) for record in per_worker for enter in record["enters"])
    waits = sorted(wait for record in per_worker for wait in record["waits"])
    handoffs = sum(1 for (_, before), (_, after) in zip(events, events[1:]) if before != after)
    result.critical_sections.append(len(events) / seconds)
    result.handoffs.append(handoffs / seconds)
    result.wait_p99_ms.append(waits[min(len(waits) - 1, int(len(waits) * 0.99))] / 1e6 if waits else float("nan"))
    result.jain.append(jain_index([len(record["enters"]) for record in per_worker]))


def print_contended(results, title):
    print(f"\n{title}")
    print(f"  {'contender':<34}{'CS/s':>10}{'hand-offs/s':>13}{'wait p99 ms':>13}{'Jain':>8}")
    for result in results.values():
        print(f"  {result.label:<34}{result.median('critical_sections'):>10.0f}{result.median('handoffs'):>13.0f}"
              f"{result.median('wait_p99_ms'):>13.1f}{result.median('jain'):>8.3f}")


def _spawn_worker(specs, hold_ms):
    from tests.workers import child_env  # noqa: PLC0415 - the test settings' aliases and databases

    arguments = json.dumps({"specs": [spec.__dict__ for spec in specs], "hold_ms": hold_ms})
    return subprocess.Popen([sys.executable, "-m", "bench.harness", arguments], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT)


def _run_worker(arguments):
    """A contended worker: build the contenders, say ready, read the schedule, run it, print one JSON report."""
    import django  # noqa: PLC0415

    django.setup()
    specs = [ContenderSpec(**spec) for spec in arguments["specs"]]
    contenders = {spec.label: spec.build() for spec in specs}
    for contender in contenders.values():
        name = f"bench:warmup:{uuid.uuid4().hex}"
        contender.release(contender.acquire(name))
    print("ready", flush=True)
    slots = [Slot(**slot) for slot in json.loads(sys.stdin.readline())]
    hold = arguments["hold_ms"] / 1000
    clock, pid, report = time.monotonic_ns, os.getpid(), []
    for slot in slots:
        contender = contenders[slot.label]
        acquire, release = contender.acquire, contender.release
        enters, waits = [], []
        delay = (slot.start - clock()) / 1e9
        if delay > 0:
            time.sleep(delay)
        while True:
            asked = clock()
            if asked >= slot.end:
                break
            handle = acquire(slot.name)
            entered = clock()
            if hold:
                time.sleep(hold)
            release(handle)
            if entered < slot.end:
                enters.append(entered)
                waits.append(entered - asked)
        report.append({"pid": pid, "enters": enters, "waits": waits})
    print(json.dumps(report), flush=True)


def verdict(value, target):
    """Return how a ratio compares with its ">= target" goal, as the baselines modules print it."""
    return "meets" if value >= target else "MISSES"


def round_options(prog, description, argv):
    """Parse the round lengths and counts every baselines module takes; return them as ``run()`` keywords."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=0.25, help="length of an uncontended round (default 0.25)")
    parser.add_argument("--rounds", type=int, default=20, help="uncontended rounds (default 20)")
    parser.add_argument("--contended-seconds", type=float, default=2.0, help="length of a contended round (default 2)")
    parser.add_argument("--contended-rounds", type=int, default=3, help="contended rounds (default 3)")
    return vars(parser.parse_args(argv))


if __name__ == "__main__":
    _run_worker(json.loads(sys.argv[1]))
