"""Long randomized runs: generated workloads under a random nemesis, on every backend, every history checked.

    make soak MINUTES=120 [RUNS=300] [JOBS=2] [SEED=7] [BACKENDS=zookeeper,etcd]
    python -m tests.servers -- python -m tests.faults.soak --minutes 120 --seed 7 --report soak.md --keep failed

One *run* is one episode on one backend: a fresh lock name and fenced counter row; the clients loop
acquire, ``claim()``, critical section of a random length, increment, release, each run writing
either through the lease or with the bare token (judged by the store alone); meanwhile the nemesis
draws one fault from the backend's catalogue (or none), keeps it a random while and undoes it. The
run's events (its lock's, its row's commits, the nemesis's) go through the checker.

Everything random in a run derives from ``(seed, run number)``: ``--seed S --replay N`` runs that
run again with the same backend, fault, timings and client seeds (the machine's scheduling differs).
A run with a violation keeps its folder under ``--keep``: histories, nemesis schedule, store commits,
server logs, and ``replay.txt``, the command that replays it. Needs root for the test network of the
ZooKeeper and etcd members (their faults are skipped, and said so, where namespaces are refused).

``--minutes`` and ``--runs`` (per backend) together go on until both are reached. ``--jobs N`` runs
the backends in N lanes side by side, each a soak process of its own (its own servers, test network,
databases and seed, ``--seed`` + lane), and merges their tallies into one report: the cores a lane
leaves idle while its clients wait out ttls and faults run another lane's runs.
"""

import argparse
import ast
import dataclasses
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.faults.settings")

import django  # noqa: E402

django.setup()

from django.test.utils import setup_databases, teardown_databases  # noqa: E402

from distlock.conformance.checker import check  # noqa: E402
from distlock.conformance.history import load  # noqa: E402
from distlock.conformance.run import Run  # noqa: E402
from distlock.conformance.store import FencedStore  # noqa: E402
from tests.faults.nemesis import (CLIENT_FAULTS, CLIENT_HOST_FAULTS, CLUSTER_FAULTS, CUT_OFF_OVERLAP,  # noqa: E402
                                  REDIS_FAULTS, REDLOCK_FAULTS, Deployment, contend, spawn_on_host)
from tests.faults.targets import TARGETS  # noqa: E402
from tests.servers.etcd import EtcdCluster  # noqa: E402
from tests.servers.netns import TestNetwork, namespaces_refused  # noqa: E402
from tests.servers.redis import RedisServer  # noqa: E402
from tests.servers.zookeeper import ZooKeeperEnsemble  # noqa: E402

__all__ = ["BACKENDS", "BROKEN", "RUNS_PER_BLOCK", "flagged_in_output", "lanes", "main", "rejudge", "upper_bound"]

#: The backends in the order runs go round them, by the module name of their ``BACKEND``.
BACKENDS = ["database", "redis", "redlock", "zookeeper", "etcd"]

#: Not in the default round: the database backend with every token 1 (``tests/faults/broken.py``), which
#: the soak must catch in its first runs (``tests/faults/test_soak.py``).
BROKEN = "broken"

#: Runs in a row on one backend with the same client processes (starting clients costs seconds).
RUNS_PER_BLOCK = 10

CLIENTS = 4
TTL = 2.0
HOLDS = [(0.0, 0.005), (0.01, 0.05), (0.05, 0.3)]
STORE_DATABASE = "postgres"


def upper_bound(violations, runs, confidence=0.95):
    """The one-sided upper bound on the violation rate: 3/N for none in N runs, else Clopper-Pearson."""
    if runs == 0:
        return 1.0
    if violations == 0:
        return min(1.0, 3 / runs)
    alpha = 1 - confidence

    def at_most(p):  # P(X <= violations) for X ~ Binomial(runs, p)
        return sum(math.comb(runs, k) * p**k * (1 - p) ** (runs - k) for k in range(violations + 1))

    low, high = violations / runs, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if at_most(middle) > alpha else (low, middle)
    return high


@dataclass
class Tally:
    """What the runs of one fault kind on one backend did."""

    runs: int = 0
    operations: int = 0
    faults: int = 0
    violations: int = 0
    overlaps: int = 0
    stale_accepted: int = 0
    rejections: int = 0
    failing_runs: list = field(default_factory=list)
    problems: list = field(default_factory=list)


class Backend:
    """The servers of one backend for the whole soak, the alias that points at them, and its fault catalogue."""

    def __init__(self, key, workdir, network, stack):
        self.key = key
        self.network = None
        self.deployment = Deployment()
        faults = list(CLIENT_FAULTS)
        if key == BROKEN:
            self.label = "database, every token 1 (broken on purpose)"
            self.entry = {"BACKEND": "tests.faults.broken.ConstantTokenBackend", "OPTIONS": {"DATABASE": STORE_DATABASE}}
            self.faults = faults
            return
        target = TARGETS[key]
        self.label = target.label
        if key == "database":
            self.entry = target.entry(database=STORE_DATABASE)
        elif key == "redis":
            server = stack.enter_context(RedisServer(workdir=workdir / "redis"))
            self.deployment.servers = [server]
            self.entry = target.entry(url=server.url)
            faults += REDIS_FAULTS
        elif key == "redlock":
            servers = [stack.enter_context(RedisServer(workdir=workdir / f"redlock-{i}")) for i in range(5)]
            self.deployment.servers = servers
            self.entry = target.entry(urls=[server.url for server in servers])
            faults += REDLOCK_FAULTS
        else:
            cluster_class = ZooKeeperEnsemble if key == "zookeeper" else EtcdCluster
            cluster = stack.enter_context(cluster_class(workdir / key, network=network))
            self.deployment.cluster, self.deployment.network = cluster, network
            self.network = network
            address = {"hosts": cluster.hosts} if key == "zookeeper" else {"endpoints": cluster.endpoints}
            self.entry = target.entry(**address)
            if network is not None:
                faults += CLUSTER_FAULTS + CLIENT_HOST_FAULTS
        self.faults = faults

    def server_logs(self):
        members = self.deployment.cluster.members if self.deployment.cluster else self.deployment.servers
        return [member.log_path for member in members]


class Soak:
    def __init__(self, args, workdir, stack):
        self.args = args
        self.workdir = workdir
        self.stack = stack
        self.keep = Path(args.keep)
        self.store = FencedStore(STORE_DATABASE).create()
        stack.callback(self.store.drop)
        self.network = None
        if {"zookeeper", "etcd"} & set(args.backends):
            refused = namespaces_refused()
            if refused:
                print(f"[soak] no test network ({refused}): ZooKeeper and etcd run on loopback, without "
                      "partitions", flush=True)
            else:
                self.network = stack.enter_context(TestNetwork())
        self.backends = {}
        self.tallies = defaultdict(Tally)
        self.started = time.monotonic()
        self.runs_done = 0
        self.done = defaultdict(int)
        #: run number -> what the checker found in it, for the folder it keeps.
        self.violations = {}

    def backend(self, key):
        if key not in self.backends:
            print(f"[soak] starting the servers of {key}", flush=True)
            self.backends[key] = Backend(key, self.workdir, self.network, self.stack)
        return self.backends[key]

    def backend_of(self, number):
        return self.args.backends[(number // RUNS_PER_BLOCK) % len(self.args.backends)]

    def wanted(self, key):
        """True while ``key`` needs more runs: until ``--minutes`` are up and it has ``--runs``, of those given."""
        minutes_left = self.args.minutes is not None and time.monotonic() - self.started < self.args.minutes * 60
        runs_left = self.args.runs is not None and self.done[key] < self.args.runs
        return minutes_left or runs_left

    def go(self):
        if self.args.replay is not None:
            number = self.args.replay
            self.block(self.backend(self.backend_of(number)), [number])
            return
        number = 0
        while any(self.wanted(key) for key in self.args.backends):
            key = self.backend_of(number)
            if self.wanted(key):
                self.block(self.backend(key), range(number, number + RUNS_PER_BLOCK))
            number += RUNS_PER_BLOCK

    def block(self, backend, numbers):
        """Runs ``numbers`` on ``backend`` with one set of clients (replacing those a fault killed)."""
        directory = self.workdir / f"runs-{numbers[0]:05d}-{backend.key}"
        env = {"DJANGO_SETTINGS_MODULE": "tests.faults.settings", "DISTLOCK_TEST_CHILD": "1",
               "DISTLOCK_FAULTS_ALIASES": json.dumps({backend.key: backend.entry}), "DISTLOCK_FAULTS_DATABASES": "{}"}
        run = Run(backend.key, directory, store=self.store, env=env)
        deployment = backend.deployment
        failed = []
        with ExitStack() as clients_stack:
            deployment.clients = run.spawn(*[f"client-{i}" for i in range(CLIENTS - 1)])
            if backend.network is not None:
                client, deployment.client_host = spawn_on_host(run, backend.network, f"client-{CLIENTS - 1}",
                                                               f"c{backend.key[0]}", clients_stack)
                deployment.clients.append(client)
            else:
                deployment.clients += run.spawn(f"client-{CLIENTS - 1}")
            try:
                for number in numbers:
                    if self.args.replay is None and not self.wanted(backend.key):
                        break
                    self.replace_killed(run, backend, number, clients_stack)
                    if not self.episode(run, backend, number):
                        failed.append(number)
            finally:
                run.close()
        for number in failed:
            self.keep_run(run, backend, number)
        shutil.rmtree(directory, ignore_errors=True)

    def replace_killed(self, run, backend, number, stack):
        deployment = backend.deployment
        for i, client in enumerate(deployment.clients):
            if client.alive:
                continue
            proc = f"client-{i}-after-{number}"
            if backend.network is not None and i == CLIENTS - 1:
                deployment.clients[i], _ = spawn_on_host(run, backend.network, proc, deployment.client_host.name,
                                                         stack)
            else:
                (deployment.clients[i],) = run.spawn(proc)

    def episode(self, run, backend, number):
        """One run: contend on a new lock while the drawn fault (or none) happens; tally it; return True if ok."""
        rng = random.Random(f"{self.args.seed}:{number}")
        fault = rng.choice([None, *backend.faults])
        name = run.lock_name()
        row = run.row() if run.fenced else None
        counts = contend(run, backend.deployment, [fault] if fault else [], name=name, row=row, rng=rng, ttl=TTL,
                         via=rng.choice(["lease", "token"]), hold=rng.choice(HOLDS),
                         settle=1.5 if fault is None else 1.0)
        scenario = fault.name if fault else "no fault"
        forgot = fault is not None and fault.forgets_grants and "the restarted server forgot the lock"
        result = run.judge(scenario, backend.label, 1, lock=name, rows=[row] if row is not None else [],
                           expect_overlap=CUT_OFF_OVERLAP if fault else False, forgets_grants=forgot)
        tally = self.tallies[(backend.key, scenario)]
        tally.runs += 1
        self.done[backend.key] += 1
        tally.faults += fault is not None
        tally.operations += sum(count.get(kind, 0) for count in counts
                                for kind in ("acquired", "failed", "accepted", "refused"))
        tally.overlaps += result.overlaps
        tally.stale_accepted += result.stale_accepted or 0
        tally.rejections += result.rejections or 0
        self.runs_done += 1
        if result.violations:
            tally.violations += 1
            tally.failing_runs.append(number)
            tally.problems.extend(result.violations)
            self.violations[number] = result.violations
            print(f"[soak] run {number} ({backend.key}, {scenario}): VIOLATION {result.violations}", flush=True)
            return False
        if self.runs_done % 10 == 0:
            print(f"[soak] {self.runs_done} runs, {(time.monotonic() - self.started) / 60:.1f} min", flush=True)
        return True

    def keep_run(self, run, backend, number):
        folder = self.keep / f"seed-{self.args.seed}-run-{number}-{backend.key}"
        shutil.copytree(run.directory, folder, dirs_exist_ok=True)
        for log in backend.server_logs():
            if Path(log).exists():
                shutil.copy(log, folder / f"server-{Path(log).name}")
        (folder / "store-commits.json").write_text(json.dumps(self.store.commits(run.rows), indent=1))
        (folder / "violations.json").write_text(json.dumps(self.violations.get(number, []), indent=1))
        (folder / "replay.txt").write_text(
            f"make soak SOAK_ARGS='--seed {self.args.seed} --replay {number} --backends {','.join(self.args.backends)}'\n")

    def report(self):
        return report(self.tallies, self.args.backends, seeds=[self.args.seed], runs=self.runs_done,
                      minutes=(time.monotonic() - self.started) / 60)

    def tallies_json(self):
        """The tallies as JSON, for the report of a soak whose lanes ran in processes of their own."""
        return json.dumps({"seed": self.args.seed, "runs": self.runs_done,
                           "tallies": [{"backend": key, "scenario": scenario, **dataclasses.asdict(tally)}
                                       for (key, scenario), tally in self.tallies.items()]})


def report(tallies, backends, *, seeds, runs, minutes, lanes=1):
    """The markdown report: one row per backend, then one per backend and fault, each with its 95 % upper bound."""
    command = f"python -m tests.faults.soak --seed {seeds[0]}" + (f" --jobs {lanes}" if lanes > 1 else "")
    lane_seeds = f" (lane seeds {', '.join(map(str, seeds))})" if lanes > 1 else ""
    lines = [
        "# Soak",
        "",
        f"`{command}`{lane_seeds} ran {runs} runs in {minutes:.1f} min on "
        f"this machine ({platform.system()} {platform.release()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}).",
        "",
        "| backend | runs | operations | faults injected | violations | 95 % upper bound |",
        "|---|---|---|---|---|---|",
    ]
    for key in backends:
        rows = [tally for (backend, _), tally in tallies.items() if backend == key]
        runs_of, violations = sum(t.runs for t in rows), sum(t.violations for t in rows)
        lines.append(f"| {key} | {runs_of} | {sum(t.operations for t in rows)} | {sum(t.faults for t in rows)} | "
                     f"{violations} | {upper_bound(violations, runs_of):.2%} |")
    lines += ["", "| backend | fault | runs | operations | overlaps | stale writes accepted | refused writes | "
              "violations | 95 % upper bound | failing runs |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (key, scenario), tally in sorted(tallies.items()):
        lines.append(f"| {key} | {scenario} | {tally.runs} | {tally.operations} | {tally.overlaps} | "
                     f"{tally.stale_accepted} | {tally.rejections} | {tally.violations} | "
                     f"{upper_bound(tally.violations, tally.runs):.2%} | "
                     f"{', '.join(map(str, tally.failing_runs)) or '—'} |")
    return "\n".join(lines) + "\n"


#: Backends whose tokens need not increase.
UNORDERED_TOKENS = {"redlock", BROKEN}
_KEPT = re.compile(r"seed-(\d+)-run-(\d+)-(\w+)$")


def rejudge(folder):
    """Check a kept run again with this checkout's checker; return ``(run, backend, fault, problems)``.

    ``problems`` name the kinds of violation found (each violation's text up to its colon).

    The folder holds the run's whole block (``RUNS_PER_BLOCK``): the run's lock is the block's
    ``run % RUNS_PER_BLOCK``-th, its rows those its clients wrote, its fault the nemesis's start while
    its lock was in use. Grants recorded before they carried their ttl get the soak's ``TTL``.
    """
    seed, number, key = _KEPT.search(str(folder)).groups()
    number = int(number)
    events = load(folder)
    block_lock = next(event["lock"] for event in events if (event.get("lock") or "").startswith("distlock-verify:"))
    lock = f"{block_lock.rsplit(':', 1)[0]}:{number % RUNS_PER_BLOCK}"
    mine = [event for event in events if event.get("lock") == lock]
    if not mine:
        return number, key, None, [f"no event of its lock {lock!r} in the folder"]
    first, last = mine[0]["t"], mine[-1]["t"]
    for event in mine:
        if event["op"] == "acquire" and event.get("phase") == "ok":
            event.setdefault("ttl", TTL)
    faults = {fault.name: fault for fault in [*CLIENT_FAULTS, *CLIENT_HOST_FAULTS, *CLUSTER_FAULTS, *REDIS_FAULTS,
                                              *REDLOCK_FAULTS]}
    started = [event.get("what") for event in events if event.get("proc") == "nemesis" and "lock" not in event
               and event.get("phase") == "start" and first <= event["t"] <= last]
    fault = faults.get(started[0]) if started else None
    rows = {event["row"] for event in mine if event.get("row") is not None}
    commits = [commit for commit in json.loads((Path(folder) / "store-commits.json").read_text())
               if commit["row"] in rows]
    final = {row: next((commit["value"] for commit in reversed(commits)
                        if commit["row"] == row and commit["accepted"] and commit["value"] is not None), 0)
             for row in rows}
    history = [event for event in events if event.get("lock", lock) == lock and event["t"] <= last] + commits
    verdict = check(history, initial=dict.fromkeys(rows, 0), final=final,
                    tokens_must_increase=key not in UNORDERED_TOKENS,
                    forgets_grants=bool(fault and fault.forgets_grants), only_faults_cause_overlaps=fault is not None)
    problems = [] if verdict.ok else [name for name, found in (
        ("not linearizable (P4)", verdict.linearizability_violations and not verdict.forgets_grants),
        ("overlap no fault explains", verdict.unexplained_overlaps and verdict.only_faults_cause_overlaps),
        ("stale write accepted", verdict.stale_accepted), ("write refused without a newer token",
                                                            verdict.false_rejections),
        ("token issued twice or going back", verdict.duplicate_tokens or verdict.regressions),
        ("lost update or write", verdict.lost_updates or verdict.lost_writes), ("stale read", verdict.stale_reads),
        ("token not issued to its writer", verdict.stray_tokens)) if found]
    if fault is None and verdict.overlaps:
        problems.append(f"{verdict.overlaps} overlapping critical section(s) without any fault")
    return number, key, started[0] if started else "no fault", problems


_FLAGGED = re.compile(r"^\[soak\] run (\d+) \((\w+), .*?\): VIOLATION (\[.*\])$")


def flagged_in_output(text):
    """Return ``{(run, backend): violations}`` from a soak's printed output (its ``VIOLATION`` lines)."""
    return {(int(match.group(1)), match.group(2)): ast.literal_eval(match.group(3))
            for match in map(_FLAGGED.match, text.splitlines()) if match}


def rejudged_section(folders, seeds, output=None):
    """The report's section of runs flagged at run time and checked again (``rejudge``), with what the
    run-time check found: the folder's ``violations.json``, or the soak's printed ``output`` for
    folders kept before soaks wrote that file."""
    printed = flagged_in_output(output) if output else {}
    lines = ["", "## Flagged runs, checked again", "",
             f"`python -m tests.faults.soak --rejudge` with the checker of commit {_commit()}: each run the soak "
             "flagged, from the folder it kept.", "",
             "| seed | run | backend | fault | at run time | checked again |", "|---|---|---|---|---|---|"]
    for folder in sorted(folders, key=lambda path: tuple(map(int, _KEPT.search(str(path)).groups()[:2]))):
        seed = int(_KEPT.search(str(folder)).group(1))
        if seed not in seeds:
            continue
        number, key, fault, problems = rejudge(folder)
        recorded = folder / "violations.json"
        violations = json.loads(recorded.read_text()) if recorded.exists() else printed.get((number, key))
        found = sorted({text.split(":")[0] for text in violations}) if violations else ["flagged"]
        lines.append(f"| {seed} | {number} | {key} | {fault} | {'; '.join(found)} | {'; '.join(problems) or 'ok'} |")
    return "\n".join(lines) + "\n"


def _commit():
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
    return done.stdout.strip() or "unknown"


def lanes(backends, jobs):
    """Split ``backends`` into ``jobs`` lanes, round robin (in the default order ZooKeeper and etcd, the heaviest,
    fall into different lanes)."""
    return [lane for lane in (backends[i::jobs] for i in range(min(jobs, len(backends)))) if lane]


def run_lanes(args, argv):
    """Run the soak's lanes as processes of their own, side by side; print and write the merged report."""
    started = time.monotonic()
    folder = Path(tempfile.mkdtemp(prefix="distlock-soak-lanes-"))
    passed_on = [*argv]
    for option in ("--jobs", "--backends", "--seed", "--report"):
        while option in passed_on:
            at = passed_on.index(option)
            del passed_on[at:at + 2]
    children, seeds = [], []
    run_id = os.environ.get("DISTLOCK_TEST_RUN_ID", str(os.getpid()))
    for number, lane in enumerate(lanes(args.backends, args.jobs)):
        seeds.append(args.seed + number)
        command = [sys.executable, "-m", "tests.faults.soak", *passed_on, "--backends", ",".join(lane),
                   "--seed", str(seeds[-1]), "--tallies", str(folder / f"lane-{number}.json")]
        print(f"[soak] lane {number}: {' '.join(lane)}, seed {seeds[-1]}", flush=True)
        children.append(subprocess.Popen(command, env={**os.environ, "DISTLOCK_TEST_RUN_ID": f"{run_id}lane{number}"}))
    try:
        codes = [child.wait() for child in children]
    except KeyboardInterrupt:
        # Each lane writes its tallies on an interrupt as on its end: report what they did.
        for child in children:
            child.send_signal(signal.SIGINT)
        codes = [child.wait() for child in children]
    tallies, runs = {}, 0
    for path in sorted(folder.glob("lane-*.json")):
        lane = json.loads(path.read_text())
        runs += lane["runs"]
        for row in lane["tallies"]:
            key = (row.pop("backend"), row.pop("scenario"))
            tallies[key] = Tally(**row)
    shutil.rmtree(folder, ignore_errors=True)
    text = report(tallies, args.backends, seeds=seeds, runs=runs, minutes=(time.monotonic() - started) / 60,
                  lanes=len(children))
    print(text, flush=True)
    if args.report:
        Path(args.report).write_text(text)
    return max(codes, default=0)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tests.faults.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=None,
                        help="how long to go on at least (default 10, unless --runs is given)")
    parser.add_argument("--runs", type=int, default=None, help="runs per backend at least")
    parser.add_argument("--jobs", type=int, default=1, help="lanes of backends run side by side (default 1)")
    parser.add_argument("--tallies", default=None, help=argparse.SUPPRESS)  # a lane's tallies, for --jobs
    parser.add_argument("--rejudge", nargs="+", default=None, metavar="FOLDER",
                        help="check the runs kept in these folders again (of --seed and the next --jobs - 1 "
                             "seeds) and append the table to --report")
    parser.add_argument("--soak-output", default=None, metavar="FILE",
                        help="with --rejudge: the soak's printed output, for folders without violations.json")
    parser.add_argument("--seed", type=int, default=None, help="the soak's seed (default: a random one, printed)")
    parser.add_argument("--replay", type=int, default=None, metavar="N", help="run only run N of --seed")
    parser.add_argument("--backends", type=lambda text: text.split(","), default=BACKENDS,
                        help=f"comma-separated, of {', '.join(BACKENDS)} (default: all), or {BROKEN} (a "
                             "backend broken on purpose, which the soak must catch)")
    parser.add_argument("--report", default=None, help="write the markdown report to this file too")
    parser.add_argument("--keep", default="soak-failures", help="where failing runs leave their folder")
    args = parser.parse_args(argv)
    unknown = set(args.backends) - {*BACKENDS, BROKEN}
    if unknown:
        parser.error(f"unknown backend(s): {', '.join(sorted(unknown))}")
    if args.rejudge is None and not os.environ.get("DISTLOCK_TEST_PG"):
        parser.error("run it under `python -m tests.servers` (make soak): the fenced store needs its PostgreSQL")
    if args.replay is not None and args.seed is None:
        parser.error("--replay needs the --seed of the soak")
    if args.jobs < 1:
        parser.error("--jobs must be 1 or more")
    if args.rejudge is not None:
        if args.seed is None:
            parser.error("--rejudge needs the --seed of the soak")
        output = Path(args.soak_output).read_text(encoding="utf-8") if args.soak_output else None
        text = rejudged_section([Path(folder) for folder in args.rejudge], range(args.seed, args.seed + args.jobs),
                                output)
        print(text, flush=True)
        if args.report:
            with open(args.report, "a", encoding="utf-8") as report_file:
                report_file.write(text)
        return 0
    if args.minutes is None and args.runs is None:
        args.minutes = 10.0
    if args.seed is None:
        args.seed = random.randrange(10**6)
    print(f"[soak] seed {args.seed}", flush=True)
    if args.jobs > 1 and args.replay is None:
        return run_lanes(args, sys.argv[1:] if argv is None else argv)
    workdir = Path(tempfile.mkdtemp(prefix="distlock-soak-"))
    old_config = setup_databases(verbosity=0, interactive=False, aliases={"default", STORE_DATABASE})
    try:
        with ExitStack() as stack:
            soak = Soak(args, workdir, stack)
            try:
                soak.go()
            finally:
                text = soak.report()
                print(text, flush=True)
                if args.report:
                    Path(args.report).write_text(text)
                if args.tallies:
                    Path(args.tallies).write_text(soak.tallies_json())
        return 1 if any(tally.violations for tally in soak.tallies.values()) else 0
    finally:
        teardown_databases(old_config, verbosity=0)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
