"""Two checkouts side by side: uncontended acquire+release of every alias, before and after a change.

    python -m tests.servers --servers postgres,redis,redlock,zookeeper,etcd -- \\
        python -m bench.before_after --before /tmp/before [--after .] [--aliases a,b] [--rounds N] [--seconds S]
        [--processes K]

For each ``DISTLOCK`` alias of ``tests.settings`` this starts worker processes for each checkout:
each runs with its checkout as working directory and first on ``sys.path``, so it imports that
checkout's ``distlock`` and ``tests.settings`` (it checks which ``distlock`` it got). They loop
``distlock.acquire(name, ttl=30, using=alias)`` and ``lease.release()`` on a fresh key, as
``bench.harness.uncontended`` does, in short rounds that alternate between the checkouts, so the
machine's drift and the other processes' bursts hit both alike; each side's processes take turns
(see ``measure``); the loop is this file's on both sides, only ``distlock`` differs. Both sides use
the same test databases, made (and dropped afterwards) by a helper process in the ``--after``
checkout, whose schema is the one under test; this process imports neither checkout. Each row prints:

- the median round's ops/s of each side, with the spread of its rounds (interquartile range over
  the median, in %);
- *after/before*: the median, over the pairs of rounds run back to back, of their ratio, with its
  95 % confidence interval (which takes the pairs as independent draws);
- *by process*: the lowest and highest after/before of one pair of processes (one per side) alone;
  a spread wider than the interval shows that the processes' luck weighs in too;
- p50/p99 of the acquire+release latency over every recorded round, for each side;
- the verdict: *ok* when after/before >= 0.97; *noise?* when it is below but the interval or a pair
  of processes reaches 0.97; *SLOWER* otherwise.

Comparing a checkout with itself (``--before X --after X``) shows the noise of the machine.
``python -m bench`` runs every module with ``main(argv)`` without arguments: this one then prints
that it needs ``--before`` and returns.
"""

import argparse
import json
import math
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid

__all__ = ["SideBySide", "main", "measure"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The after/before ratio a row needs to be "ok" (issue 14: within 3 %).
TARGET = 0.97
#: The lease's TTL in the loop, as ``bench.harness.alias_contender``.
TTL = 30
SIDES = ("before", "after")


class WorkerFailed(Exception):
    """A worker exited, reported an error or did not answer in time; the message says which and why."""


class _Worker:
    """One process running ``task`` in checkout ``tree``; replies are JSON lines, read with a timeout
    so a stuck server cannot hang the run."""

    def __init__(self, tree, task, **config):
        self.tree = tree
        self._stderr = tempfile.TemporaryFile()
        self._buffer = b""
        env = dict(os.environ, DJANGO_SETTINGS_MODULE="tests.settings", PYTHONPATH=tree)
        if task == "rounds":  # straight to the test databases the "databases" helper made
            env["DISTLOCK_TEST_CHILD"] = "1"
        # -P: the directory of this file (which holds modules named like packages, e.g. celery.py) stays
        # off sys.path; the checkout on PYTHONPATH comes first.
        arguments = json.dumps({"task": task, "tree": tree, **config})
        self._process = subprocess.Popen(
            [sys.executable, "-P", os.path.abspath(__file__), "--worker", arguments],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, bufsize=0, cwd=tree, env=env,
        )

    def send(self, **command):
        try:
            self._process.stdin.write(json.dumps(command).encode() + b"\n")
        except BrokenPipeError:
            raise WorkerFailed(self._failure("exited")) from None

    def receive(self, timeout):
        """Return the next JSON line; raise ``WorkerFailed`` if the worker exits, errs or takes over ``timeout`` s."""
        deadline = time.monotonic() + timeout
        fd = self._process.stdout.fileno()
        while True:
            line, newline, rest = self._buffer.partition(b"\n")
            if newline:
                self._buffer = rest
                if line.startswith(b"{"):  # anything else is the checkout printing
                    break
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise WorkerFailed(self._failure(f"gave no answer within {timeout:.0f} s"))
            chunk = os.read(fd, 65536)
            if not chunk:
                raise WorkerFailed(self._failure("exited"))
            self._buffer += chunk
        reply = json.loads(line)
        if "error" in reply:
            raise WorkerFailed(f"worker in {self.tree} failed:\n{reply['error']}")
        return reply

    def close_stdin(self):
        """Tell the worker to exit: it flushes its metrics and closes its connections on the way out."""
        try:
            self._process.stdin.close()
        except BrokenPipeError:
            pass

    def stop(self, grace=10):
        """Wait for the worker to exit after ``close_stdin``; kill it if it takes over ``grace`` seconds."""
        try:
            self._process.wait(grace)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._stderr.close()

    def _failure(self, what):
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        self._stderr.seek(0)
        err = self._stderr.read().decode(errors="replace")
        return f"worker in {self.tree} {what} (exit code {self._process.returncode}):\n{err[-3000:]}"


class SideBySide:
    """The rounds of one alias on both sides, in run order, and the latencies of each side's processes."""

    def __init__(self, alias, processes):
        self.alias = alias
        self.processes = processes  # round i ran on process i % processes of each side
        self.rounds = {side: [] for side in SIDES}  # ops/s; rounds with the same index ran back to back
        self.latency_sketches = {side: [] for side in SIDES}  # per process: (count, 1001 quantiles in ns)

    def ops(self, side):
        return statistics.median(self.rounds[side])

    def spread(self, side):
        """Interquartile range of the side's rounds over their median, in %."""
        q1, _, q3 = statistics.quantiles(self.rounds[side], n=4)
        return (q3 - q1) / self.ops(side) * 100

    @property
    def pair_ratios(self):
        return [after / before for before, after in zip(self.rounds["before"], self.rounds["after"])]

    @property
    def ratio(self):
        """The median of after/before over the pairs of rounds run back to back.

        Under bursty load each side's median jumps between load levels from one run to the next;
        two rounds run back to back share the load, so their ratio keeps still."""
        return statistics.median(self.pair_ratios)

    @property
    def interval(self):
        """95 % confidence interval of ``ratio``: the order statistics around the median of the pairs."""
        ratios = sorted(self.pair_ratios)
        below = max(0, int(len(ratios) / 2 - 1.96 * math.sqrt(len(ratios)) / 2))
        return ratios[below], ratios[len(ratios) - 1 - below]

    @property
    def by_process(self):
        """``ratio`` of each pair of processes (one per side) alone: the interval cannot see how far they differ."""
        ratios = self.pair_ratios
        return [statistics.median(ratios[first::self.processes]) for first in range(min(self.processes, len(ratios)))]

    @property
    def verdict(self):
        if self.ratio >= TARGET:
            return "ok"
        return "noise?" if max(self.interval[1], *self.by_process) >= TARGET else "SLOWER"

    def latency_us(self, side, fraction):
        """The side's latency percentile over every recorded round of all its processes, in µs."""
        points = sorted((value, count / len(quantiles))  # each quantile stands for as many latencies
                        for count, quantiles in self.latency_sketches[side] for value in quantiles)
        wanted, seen = fraction * sum(weight for _, weight in points), 0
        for value, weight in points:
            seen += weight
            if seen >= wanted:
                return value / 1000
        return float("nan")


def measure(alias, trees, *, seconds, rounds, processes):
    """Return the ``SideBySide`` of ``alias``: ``trees`` maps "before"/"after" to a checkout's directory.

    Each side runs ``processes`` worker processes in turn: a process's own luck (CPU, memory layout)
    would otherwise count as the code's for the whole run. Every process warms up with one
    unrecorded round; round ``i`` runs on process ``i % processes`` of each side, and the side that
    goes first changes with each cycle through the processes, so each process alternates too.
    """
    workers = {side: [_Worker(trees[side], "rounds", alias=alias) for _ in range(processes)] for side in SIDES}
    reply_timeout = seconds + 60
    try:
        for side in SIDES:  # all start (Django set up, backend warmed up) at the same time
            for worker in workers[side]:
                worker.receive(reply_timeout)
        result = SideBySide(alias, processes)
        for round_index in range(-processes, rounds):
            cycle, process = divmod(round_index, processes)
            for side in SIDES if cycle % 2 == 0 else SIDES[::-1]:
                workers[side][process].send(seconds=seconds, record=round_index >= 0)
                ops = workers[side][process].receive(reply_timeout)["ops"]
                if round_index >= 0:
                    result.rounds[side].append(ops)
        for side in SIDES:
            for worker in workers[side]:
                worker.send(finish=True)
            for worker in workers[side]:
                reply = worker.receive(reply_timeout)
                result.latency_sketches[side].append((reply["count"], reply["quantiles_ns"]))
        return result
    finally:
        _stop([worker for side in SIDES for worker in workers[side]])


def _stop(workers):
    """Stop ``workers`` together: their shutdowns (closing clients, flushing metrics) overlap."""
    for worker in workers:
        worker.close_stdin()
    for worker in workers:
        worker.stop()


def describe(tree):
    """Return ``tree`` with its commit and whether it has uncommitted changes (when it is a git checkout)."""
    def git(*args):
        return subprocess.run(["git", "-C", tree, *args], capture_output=True, text=True, check=False)

    head = git("rev-parse", "--short", "HEAD")
    if head.returncode != 0:
        return tree
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    return f"{tree} (git {head.stdout.strip()}{', uncommitted changes' if dirty else ''})"


def migrations(tree):
    """Return ``{path: bytes}`` of the checkout's migration files: both sides share one schema, the after side's."""
    found = {}
    for folder, _, files in os.walk(os.path.join(tree, "distlock")):
        if os.path.basename(folder) == "migrations":
            for file in files:
                if file.endswith(".py"):
                    with open(os.path.join(folder, file), "rb") as source:
                        found[os.path.relpath(os.path.join(folder, file), tree)] = source.read()
    return found


def print_header(trees, args):
    print(f"== before/after: uncontended acquire+release, {args.rounds} alternating rounds of {args.seconds:g} s "
          f"per side, {args.processes} processes per side taking turns ==")
    for side in SIDES:
        print(f"  {side + ':':<8}{describe(trees[side])}")
    if migrations(trees["before"]) != migrations(trees["after"]):
        print("  warning: the migrations differ; both sides run on the after side's schema")
    print(f"\n  {'alias':<13}{'before ops/s':>13}{'IQR%':>6}{'after ops/s':>13}{'IQR%':>6}{'after/before':>14}"
          f"{'95% interval':>14}{'by process':>12}{'p50 µs b/a':>13}{'p99 µs b/a':>13}  verdict", flush=True)


def print_row(result):
    low, high = result.interval
    by_process = result.by_process
    before_p50, after_p50 = result.latency_us("before", 0.5), result.latency_us("after", 0.5)
    before_p99, after_p99 = result.latency_us("before", 0.99), result.latency_us("after", 0.99)
    print(f"  {result.alias:<13}{result.ops('before'):>13.0f}{result.spread('before'):>6.1f}"
          f"{result.ops('after'):>13.0f}{result.spread('after'):>6.1f}{result.ratio:>14.3f}"
          f"{f'{low:.2f}-{high:.2f}':>14}{f'{min(by_process):.2f}-{max(by_process):.2f}':>12}"
          f"{f'{before_p50:.0f}/{after_p50:.0f}':>13}"
          f"{f'{before_p99:.0f}/{after_p99:.0f}':>13}  {result.verdict}", flush=True)


def checkout(path):
    """Return ``path`` as an absolute directory holding a distlock checkout, or raise ``ArgumentTypeError``."""
    tree = os.path.abspath(path)
    for required in ("distlock", os.path.join("tests", "settings.py")):
        if not os.path.exists(os.path.join(tree, required)):
            raise argparse.ArgumentTypeError(f"{tree} is not a distlock checkout (no {required})")
    return tree


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.before_after", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=checkout, help="the checkout to compare with (e.g. the code before a change)")
    parser.add_argument("--after", type=checkout, default=ROOT, help=f"the checkout under test (default {ROOT})")
    parser.add_argument("--aliases", help="comma-separated DISTLOCK aliases (default: every configured one)")
    parser.add_argument("--seconds", type=float, default=0.1, help="length of a round (default 0.1)")
    parser.add_argument("--rounds", type=int, default=60, help="recorded rounds per side and alias (default 60)")
    parser.add_argument("--processes", type=int, default=3,
                        help="worker processes per side and alias, taking turns (default 3)")
    args = parser.parse_args(argv)
    if args.before is None:
        print("skipped: needs --before (a checkout to compare with)")
        return 0
    if args.rounds < 2 or args.processes < 1 or args.seconds <= 0:
        parser.error("--rounds must be at least 2 (the spread needs two rounds), --processes at least 1 "
                     "and --seconds above 0")

    # Every process of the run shares the test databases' names (tests.servers sets this already).
    os.environ.setdefault("DISTLOCK_TEST_RUN_ID", str(os.getpid()))
    trees = {"before": args.before, "after": args.after}
    started = time.monotonic()
    databases = _Worker(args.after, "databases")
    try:
        configured = databases.receive(timeout=300)["aliases"]
        print_header(trees, args)
        failed = False
        for alias in args.aliases.split(",") if args.aliases else configured:
            if alias not in configured:
                failed = True
                print(f"  {alias:<13}not configured in tests.settings (was its server started?)", flush=True)
                continue
            try:
                print_row(measure(alias, trees, seconds=args.seconds, rounds=args.rounds, processes=args.processes))
            except WorkerFailed as exc:
                failed = True
                print(f"  {alias:<13}failed: {exc}", flush=True)
        print(f"\n  after/before: median of the ratios of rounds run back to back. ok: >= {TARGET}; "
              f"noise?: below, but its interval or a process pair reaches it; SLOWER: neither "
              f"({time.monotonic() - started:.0f} s)")
        databases.send(finish=True)
        databases.receive(timeout=300)
    except WorkerFailed as exc:
        print(f"the test databases helper failed: {exc}")
        return 1
    finally:
        databases.close_stdin()
        databases.stop(grace=60)
    return 1 if failed else 0


# -- the workers: they run inside one checkout and import nothing of the checkout this file is in ---

def _run_worker(config):
    """Set Django up, check which distlock was imported, then run ``config["task"]``; report errors as JSON."""
    try:
        import django  # noqa: PLC0415

        django.setup()
        import distlock  # noqa: PLC0415

        tree = os.path.realpath(config["tree"])
        if os.path.commonpath([os.path.realpath(distlock.__file__), tree]) != tree:
            raise RuntimeError(f"imported distlock from {distlock.__file__}, not from {tree}")
        {"rounds": _run_rounds, "databases": _run_databases}[config["task"]](config)
    except Exception:  # noqa: BLE001 - the parent prints it in the alias's row
        _reply(error=traceback.format_exc(limit=-4))


def _run_rounds(config):
    """Warm ``config["alias"]`` up, then loop acquire+release for each round asked on stdin; pool the latencies."""
    from django.conf import settings  # noqa: PLC0415

    import distlock  # noqa: PLC0415

    alias = config["alias"]
    if alias not in settings.DISTLOCK:  # the checkouts' settings differ
        raise RuntimeError(f"alias {alias!r} is not configured in this checkout's tests.settings")

    def pair(name):
        distlock.acquire(name, ttl=TTL, using=alias).release()

    name = f"bench:warmup:{uuid.uuid4().hex}"
    for _ in range(20):  # connections, script cache, imports
        pair(name)
    _reply(ready=distlock.__file__)
    latencies = []
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("finish"):  # 1001 quantiles stand for the latencies: the parent pools the processes'
            latencies.sort()
            last = len(latencies) - 1
            _reply(count=len(latencies), quantiles_ns=[latencies[last * step // 1000] for step in range(1001)]
                   if latencies else [])
            return
        name = f"bench:before-after:{uuid.uuid4().hex}"
        clock, kept = time.perf_counter_ns, latencies if command["record"] else []
        started = now = clock()
        end = started + int(command["seconds"] * 1e9)
        count = 0
        while now < end:
            pair(name)
            finished = clock()
            kept.append(finished - now)
            now = finished
            count += 1
        _reply(ops=count / ((now - started) / 1e9))


def _run_databases(config):
    """Make the test databases, say which aliases are configured, and drop them when stdin says so (or closes)."""
    from django.conf import settings  # noqa: PLC0415
    from django.db import connections  # noqa: PLC0415
    from django.test.utils import setup_databases, teardown_databases  # noqa: PLC0415

    databases = setup_databases(verbosity=0, interactive=False)
    try:
        _reply(aliases=list(settings.DISTLOCK))
        sys.stdin.readline()
    finally:
        connections.close_all()
        teardown_databases(databases, verbosity=0)
    _reply(dropped=True)


def _reply(**fields):
    print(json.dumps(fields), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _run_worker(json.loads(sys.argv[2]))
    else:
        sys.exit(main())
