"""Write docs/SAFETY.md: run the fault suite on private servers and put its results table in a document.

    python -m tests.faults.report [--long] [--output docs/SAFETY.md] [pytest arguments]

It starts the servers the suite needs (``python -m tests.servers``), runs ``pytest tests/faults`` with
``--safety-report``, and the suite's ``pytest_sessionfinish`` writes the file (``write()`` below).
"""

import argparse
import dataclasses
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from distlock.conformance.report import markdown_table

ROOT = Path(__file__).resolve().parents[2]

#: The scenarios in the order of issue 7, then issue 21, then issues 13, 25 and 15, with what each does: (number,
#: name in the results, description).
SCENARIOS = [
    ("1", "client pause", "the holder is frozen (SIGSTOP) in its critical section for 2 x max(ttl, session "
                          "timeout) + 1 s; another client acquires, claims and writes; the holder resumes and "
                          "writes with its old token"),
    ("2", "client crash", "the holder is killed (SIGKILL) in its critical section while another client waits"),
    ("3", "redis restart without persistence", "A holds; Redis is killed (SIGKILL) and restarted empty; B acquires "
                                               "and writes; A writes with its old token"),
    ("3", "redis restart with appendfsync always", "the same with `appendonly yes`, `appendfsync always`"),
    ("4", "redlock: 2 of 5 masters killed", "contention while two masters are killed"),
    ("4", "redlock: 3 of 5 masters killed", "acquire with three masters down, then after their restart"),
    ("4", "redlock: master restarted empty during a hold", "A holds on exactly 3 masters; one of them restarts "
                                                           "empty at once; B acquires on it and the 2 others"),
    ("4", "redlock: master restarted after a ttl", "the same, the master kept down for longer than the ttl"),
    ("5", "zookeeper: session expired", "the holder's session is expired by the server (kazoo's trick: a second "
                                        "client with the same session id); a queued client takes over"),
    ("5", "zookeeper: leader killed during contention", "the ensemble's leader is killed (SIGKILL) and restarted "
                                                        "during contention"),
    ("5", "zookeeper: connection suspended and restored", "the holder's connections are cut and black-holed for "
                                                          "1 s, well within its session"),
    ("6", "etcd: leader killed during contention", "the cluster's leader is killed (SIGKILL) and restarted during "
                                                   "contention"),
    ("6", "etcd: cluster paused past the lease ttl", "every member is frozen (SIGSTOP) for the session lease ttl + "
                                                     "3 s while A holds; B acquires after; A writes"),
    ("6", "etcd: member restarted during contention", "a follower is killed and restarted during contention"),
    ("7", "client wall-clock jump", "the holder's wall clock jumps +1 h, -1 h, then freezes: renewal, validity, "
                                    "server-side expiry and acquire timeouts are measured on the monotonic clock"),
    ("8", "slow network", "a proxy delays every packet 0.25 s, then black-holes the connections: acquire must "
                          "honour its timeout with BackendUnavailable, and work again once healed"),
    ("9", "contention", "4 processes (8 with `--long`) acquire one lock over and over, claim and increment a fenced "
                        "row, with random pauses (SIGSTOP 50-200 ms)"),
    ("10", "threads that come and go", "clients whose threads start and end all the time take locks on 5 names: "
                                       "executor generations (a `ThreadPoolExecutor` of 10 threads doing 40 "
                                       "acquire/release each, recreated, repeated) and a thread per request (a new "
                                       "thread per request, 8 at once, `with distlock.lock(...)`); no crash, no "
                                       "error, no overlap"),
    ("11", "contended tries", "2 processes x 20 threads try one name back to back with `blocking=False`, holding "
                              "3 ms when granted; no overlap; the grant rate is measured (below)"),
    ("12", "interrupts mid-call", "a client's acquire (non-blocking and 50 ms timeouts), extend and release calls on "
                                  "a few names are interrupted at random points by a signal handler that raises (what "
                                  "Celery's soft time limit does), aimed at 0-2x the backend's own call durations, "
                                  "200 calls (1,000 with `--long`); another process holds one name all along and takes "
                                  "turns on another: no grant while another owner holds the lock, no exception but "
                                  "the documented ones and the interrupt, no hang, every name free within ttl + 1 s "
                                  "(+ the session timeout) after the client exits, the alias still usable afterwards "
                                  "(figures below)"),
    ("13", "fork with locks held", "a client holding an auto-renewed lock (ttl 1 s) forks 3 children, as a pre-fork "
                                   "server does; each child and the parent meanwhile take 20 turns on 3 shared names: "
                                   "no child hangs or fails, no error, no overlap, the held lease lives on 2.5 ttls "
                                   "past the forks (5 children and 40 turns with `--long`)"),
    ("14", "token source went back", "the token source is set back: an etcd cluster restored from an older snapshot "
                                     "(`etcdctl snapshot restore`, with its cluster token and with a new one), a "
                                     "ZooKeeper ensemble's data dirs wiped, Redis restarted empty with its clock 1 h "
                                     "behind (libfaketime), SQLite's token row deleted under a client clock 1 day "
                                     "behind, the PostgreSQL token sequence restarted; a process that saw the higher "
                                     "tokens must refuse every later grant and fenced write (`TokenRegression`, the "
                                     "`distlock_token_regressions` metric, the `token_regression` signal), and a fenced "
                                     "row must refuse the lower tokens a process started afterwards gets"),
    ("14", "server clock stepped back", "Redis's clock steps back 1 h (libfaketime on redis-server), SQLite's client "
                                        "clock 1 day, with their token counters intact: tokens keep rising"),
    ("", "bad input", "invalid names, ttls, timeouts, flags, aliases and tokens into acquire, lock, read_lock, "
                       "write_lock, Lease.extend, claim, save and fenced_update"),
]

BACKENDS = ["database (SQLite)", "database (PostgreSQL)", "Redis", "Redlock", "ZooKeeper", "etcd"]


def _order(result):
    names = [name for _, name, _ in SCENARIOS]
    scenario = names.index(result.scenario) if result.scenario in names else len(names)
    backend = BACKENDS.index(result.backend) if result.backend in BACKENDS else len(BACKENDS)
    return scenario, backend, result.scenario, result.backend


def interrupt_table(results):
    """Return the interrupt storms' figures (scenario 12) as a markdown table, or a line saying none ran."""
    stormed = sorted((result for result in results if result.interrupts is not None), key=_order)
    if not stormed:
        return "No interrupt storm ran."
    lines = ["| backend | calls | interrupted | wrong grants | misread replies | hangs | locks left | storm |",
             "|---|---|---|---|---|---|---|---|"]
    for result in stormed:
        counts = result.interrupts
        seconds = "—" if counts.seconds is None else f"{counts.seconds:.1f} s"
        lines.append(f"| {result.backend} | {counts.operations} | {counts.interrupted} | {counts.wrong_grants} | "
                     f"{counts.misread_replies} | {counts.hangs} | {counts.locks_left} | {seconds} |")
    return "\n".join(lines)


def numbered(results):
    """Return the results in issue order, with the scenario number in front of each name."""
    numbers = {name: number for number, name, _ in SCENARIOS}
    ordered = []
    for result in sorted(results, key=_order):
        number = numbers.get(result.scenario)
        if number:
            result = dataclasses.replace(result, scenario=f"{number}. {result.scenario}")
        ordered.append(result)
    return ordered


def table(results):
    return markdown_table(numbered(results))


def rates(results):
    """Return the grant rates the scenarios measured (contended tries) as a markdown table, or a line saying none."""
    measured = sorted((result for result in results if result.grants_per_second is not None), key=_order)
    if not measured:
        return "No scenario measuring grant rates ran."
    lines = ["| scenario | backend | grants/s | tries/s | granted tries |", "|---|---|---|---|---|"]
    for result in measured:
        share = result.grants_per_second / result.tries_per_second if result.tries_per_second else 0
        lines.append(f"| {result.scenario} | {result.backend} | {result.grants_per_second:.1f} | "
                     f"{result.tries_per_second:.0f} | {100 * share:.2f}% |")
    return "\n".join(lines)


HEADER = """\
# Safety under faults

<!-- Generated by `python -m tests.faults.report`; edit tests/faults/report.py, not this file. -->

Generated on {date} by `python -m tests.faults.report{mode}` on this machine ({machine}); the run took {minutes}.
Every row is real client processes (SIGSTOP, SIGCONT, SIGKILL) against real servers on loopback;
scenarios that break a server ran on private instances of their own. Each run recorded a history
(one JSON-lines file per process: acquisitions, critical sections, fenced writes and refusals, on
the machine's monotonic clock), the fenced store logged its commits in commit order, and the checker
(`distlock/conformance/checker.py`) judged the merged history.

## Results

{table}

Failed tests in this run: {failed}

**Grant rates of contended tries** (scenario 11; measured, not asserted: a lock whose tries fail
each other is free most of the time and still rarely granted; `python -m bench.tries` compares
the backends with Redis and with one thread trying alone):

{rates}

**Interrupts mid-call** (scenario 12; every figure but the first two and the storm's duration must be 0):

{interrupts}

**Columns.** *runs*: repetitions (processes, for contention and the scenarios of many threads; inputs tried, for bad
input).
*acquisitions*: locks granted. *overlaps without fencing*: pairs of critical sections of different
holders that intersected in time — expected under a pause past the ttl on every lock with a ttl
(that is why fencing exists), a violation anywhere else. *stale writes accepted with fencing*:
writes through `FencedModel` that the store accepted with a token older than one it had accepted
(must be 0; `n/a` for Redlock, whose tokens `FencedModel` refuses by default). *false rejections*:
writes refused although no newer token had been accepted (must be 0). *rejections logged*: refused
writes, counted by the history, the `FencingRejection` table and the `distlock_fencing_rejections`
metric (one figure when all three agree). *recovery*: from a holder's death (SIGKILL) or freeze
(SIGSTOP) to the next acquisition by another client, p50 and p99. *verdict*: `ok`, or the
properties violated; notes in parentheses.

Properties asserted on every run (the test fails otherwise): accepted tokens never decrease in store
order; no false rejection; every accepted token was issued to its writer; with `claim()` before the
read, no acknowledged increment is lost (final value = initial + accepted increments); refusals
agree across history, log and metric; tokens unique and increasing per lock (all but Redlock);
overlaps where the scenario injects no fault that could explain them: 0; the overlap canaries below
(a paused holder, a Redis or Redlock master restarted empty) detected in every run.

## Scenarios

{scenarios}

## Long randomized runs (`make soak`)

{soak}

## When a token source goes back (scenario 14)

Two layers catch a token source that goes back. **The process**: every backend with safe tokens
grants each token above every token of the alias granted before the request was sent, whatever the
name, so a process refuses the alias for good once a grant breaks that (and, on etcd, once any KV
reply shows a revision below one it saw or another cluster id): every later grant and every fenced
write with one of its leases raise `TokenRegression` (a `BackendUnavailable`), the error is logged,
`distlock_token_regressions` counts it and `token_regression` is sent. **The row**: a fenced row
refuses any token below its own (`StaleFencingToken`). A process started after the fault has seen
nothing higher and takes the low tokens without complaint; only rows written with a higher token
refuse them, and a token reissued equal to one already used passes both layers. The operator
action, whatever the backend, after restoring, wiping or resetting a token source: raise the alias's
`TOKEN_EPOCH` by one (every later token is then above every earlier one), then restart every
process that uses the alias (that also clears a refusal).

- **etcd** (token: the revision of the granting write). A cluster restored from an older snapshot
  reissues revisions already used. A process that saw a higher revision, or another cluster id (a
  restore with a new `--initial-cluster-token`), refuses every later grant and fenced write until
  it restarts; processes started after the restore are caught per row only: raise `TOKEN_EPOCH`.
- **ZooKeeper** (token: a zxid). A wiped ensemble starts its zxids again (epoch 1) and reissues
  zxids already used. A client that saw higher zxids is refused by the ensemble itself until the
  ensemble passes them (its session expires meanwhile, its locks are lost), and then gets higher
  tokens: tokens never go back within a process. Processes started after the wipe are caught per
  row only: raise `TOKEN_EPOCH`.
- **Redis** (token: max(counter + 1, server time in µs)). A clock stepped back with the counter
  intact: tokens never go back. Restarted empty (no persistence, or a restore) while its clock is
  behind the tokens issued: tokens go back; a process that saw higher ones refuses the alias, later
  processes are caught per row only: raise `TOKEN_EPOCH`.
- **database, SQLite** (token: max(row + 1, the clock of the process that opens the file in µs)). A
  clock stepped back with the token row intact: tokens never go back. The row deleted (a restore, a
  test-suite flush) while that clock is behind the tokens issued: as for Redis.
- **database, PostgreSQL** (token: `nextval()` of `distlock_token_seq`, no clock). Never goes back
  unless the sequence is reset (`setval`, `RESTART`, a restore of the database): then as for Redis.
- **Redlock**: its tokens may go back by design; `FencedModel` refuses them unless
  `allow_unsafe_tokens`, and nothing is watched.

## Where this differs from FAULTS.md, and why

- **Short ttls and sessions.** Paused and killed holders hold with a ttl of 2 s, and ZooKeeper sessions
  and etcd session leases last 3 s (the ensemble's tickTime of 250 ms allows 0.5–5 s; etcd grants at
  least 2 s), so a frozen or dead holder is freed within seconds on every backend; a pause lasts
  2 x max(ttl, session timeout) + 1 s. Where expiry is not the point (contention, restarts of a
  server, session expiry) locks are held with a ttl of 10–30 s, so only the fault can take them away.
- **Recovery bound**: the lock must be free again within its expiry (ttl, or session timeout) + 3 s,
  the slack covering detection ticks, a waiter's back-off and a machine shared by other test runs.
- **Histories come from long-lived client processes driven over stdin** (`distlock.conformance.client`),
  so one process serves all runs of a scenario; the store's commit order comes from a commit-log table
  written in the same transaction as each accepted write (`distlock/conformance/store.py`).
- **Wall clock faked in Python, not with libfaketime.** libfaketime 0.9.10 with
  `FAKETIME_DONT_FAKE_MONOTONIC=1` (needed to keep the monotonic clock real) makes Python's
  `time.sleep` fail with EINVAL, so the client patches `time.time`, `time.time_ns` and
  `datetime.datetime` before importing Django (`tests/faults/fakeclock.py`). C extensions' own clock
  reads (grpc, psycopg) are not faked.
- **Slow network:** the proxy holds every packet 0.25 s each way, then black-holes; FAULTS.md's
  0.5 x and 1.5 x TTL delays would make the etcd and ZooKeeper sessions themselves expire. Redlock's
  `REQUEST_TIMEOUT` is raised to 1 s there, since a master slower than it counts as down by design. A
  black-holed acquire may take its timeout plus one round trip (1 s) plus the 3 s slack above. Healing
  cuts the proxied connections, because the proxy drops bytes while black-holing, which TCP never does.
- **Redlock** takes no fenced writes (`n/a`), since its tokens may go backwards and `FencedModel`
  refuses them; the scenarios judge its critical sections and token order only, and its
  "restarted empty" canary expects the double grant the Redis documentation warns about.
- **Interrupts mid-call** (S26) make 200 calls per backend by default, to keep `make test` within its budget;
  `--long` makes the 1,000 of FAULTS.md. The interrupt is a `BaseException` subclass raised from a SIGALRM
  handler (as `gevent.Timeout` and `KeyboardInterrupt` are; Celery's `SoftTimeLimitExceeded` is an
  `Exception`, so it is the easier case). "Freed within its ttl" is judged once the client process has
  exited: every name free within ttl + 1 s (+ the session timeout on ZooKeeper and etcd); names this client
  still held ttl + 1 s after the storm while it lived are reported in the notes.
- **Token-source regression** (S20) is judged per process and per row, in one run each (the
  scenarios are deterministic), outside the client processes of the other scenarios: the restored,
  wiped or reset server and the clients on both sides of the fault are driven by the test itself. The
  metric it asserts is the process's Prometheus counter. libfaketime runs redis-server only with
  glibc's `libc_malloc_debug.so.0` preloaded before it (Debian's redis-server allocates with jemalloc,
  which reads the clock while libfaketime 0.9.10 initialises, and the start aborts).
- **Not run here:** P4 (linearizability of the lock history against a mutex model), server clock jumps
  (S12; scenario 14 only steps Redis's clock back), the Celery single-execution canary (S25) and the
  10-minute random nemesis of `--long` in FAULTS.md: `--long` repeats the scenarios above instead (20
  runs of each canary, 5 of the pause, crash, restart and session scenarios, 100 acquisitions per
  contending process; the clock, network, quorum-loss, suspended-connection and token-source scenarios
  run once either way).

## Bugs these scenarios found, now fixed

- A token source that went back went unseen: after an etcd restore from an older snapshot, a Redis
  restart without its counter behind its clock, a lost SQLite token row or a restarted PostgreSQL
  sequence, the very process that had been granted higher tokens took the lower ones, and its leases
  granted before kept writing to fenced rows. Such a process now refuses the alias
  (`distlock/backends/token_order.py`; etcd also checks every KV reply's revision and cluster id).
- `ttl`, `timeout` and `max_hold` had no upper bound: a ttl of 1e12 s failed on SQLite, Redis and
  Redlock with misleading errors, and a timeout of 1e12 s raised `OverflowError` on ZooKeeper. They
  now raise `ValueError` above 1e9 s (about 31 years) on every backend (`distlock/validation.py`).
- `Lease.extend(ttl)` passed any ttl to the server (`extend(0)` dropped a Redis or database lock and
  returned True), and a shorter ttl shortened the server's expiry but not the lease's validity, so
  another process could take the lock while `check()` still passed. `extend()` now validates its ttl
  and the validity follows the latest extension (`distlock/lease.py`).

## Run it yourself

Against your own deployment (non-destructive: contention, a paused and a killed client process, bad
input): `python manage.py distlock verify --using ALIAS`. The whole suite: `make test`
(`DISTLOCK_FAULTS_LONG=1 make test` for the long runs), or
`python -m tests.servers -- python -m pytest tests/faults [--long]`; this file:
`python -m tests.faults.report [--long]`. The soak: `make soak MINUTES=120 RUNS=300 JOBS=2`, which
writes docs/SOAK.md; this file includes it.
"""

#: The soak's report (``make soak`` writes it), included in this file's section of long randomized runs.
SOAK_REPORT = ROOT / "docs" / "SOAK.md"


def soak_section(path=SOAK_REPORT):
    """The soak report at ``path`` without its title, or how to make one if there is none."""
    if not path.exists():
        return "No soak report yet (docs/SOAK.md): `make soak MINUTES=120 RUNS=300 JOBS=2` writes one."
    lines = path.read_text(encoding="utf-8").splitlines()
    body = lines[1:] if lines and lines[0].startswith("# ") else lines
    return "\n".join(body).strip()


def _machine():
    cores = os.cpu_count()
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    return (f"{platform.system()} {platform.release()}, {cores} cores, load average {load}, "
            f"Python {platform.python_version()}")


def write(path, results, *, failed, started, long):
    """Write the document with ``results`` (and the ids of ``failed`` tests) to ``path``."""
    minutes = (time.time() - started) / 60
    scenarios = "\n".join(f"- **{number + '. ' if number else ''}{name}**: {description}."
                          for number, name, description in SCENARIOS)
    text = HEADER.format(
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), mode=" --long" if long else "",
        machine=_machine(), minutes=f"{minutes:.1f} min", table=table(results), rates=rates(results),
        interrupts=interrupt_table(results),
        scenarios=scenarios, soak=soak_section(),
        failed="none." if not failed else "\n\n" + "\n".join(f"- `{test}`" for test in failed),
    )
    Path(path).write_text(text, encoding="utf-8")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tests.faults.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--long", action="store_true", help="bigger runs (see tests/faults/conftest.py)")
    parser.add_argument("--output", default=str(ROOT / "docs" / "SAFETY.md"), help="default: docs/SAFETY.md")
    args, pytest_args = parser.parse_known_args(argv)
    os.chdir(ROOT)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    from tests.servers.__main__ import main as with_servers  # noqa: PLC0415 - only when run as a program

    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", str(ROOT / "tests" / "faults"),
               "--safety-report", str(Path(args.output).resolve()), *(["--long"] if args.long else []), *pytest_args]
    return with_servers(["--", *command])


if __name__ == "__main__":
    sys.exit(main())
