"""Behind real servers and pools (issue 25): gunicorn workers, Celery's green pools, forks, time-limit storms.

``make test`` runs a representative slice (each scenario on the backends it broke on), with shorter loads
than the bars the issue set (make test's time budget); ``DISTLOCK_FAULTS_LONG=1 make test`` runs the slice
at the issue's bars, and the full worker/server matrix is ``make matrix`` (``DISTLOCK_MATRIX=1``), which
also writes the table of docs/DEPLOYMENT.md from the figures these tests record. The scenarios live in
``tests/deployment/harness.py``; the checks are its ``*_failures`` functions.
"""

import json
import os
import subprocess
import sys
import uuid

import pytest

from tests.celery_app.deployment_tasks import ALIASES
from tests.conftest import LONG, require_alias
from tests.deployment import harness
from tests.workers import ROOT, child_env

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

MATRIX = os.environ.get("DISTLOCK_MATRIX") == "1"
matrix_only = pytest.mark.skipif(not MATRIX, reason="part of `make matrix`, not of `make test`")
#: Slices that `make test` leaves to `make matrix` to stay within its time budget.
matrix_slice = pytest.mark.skipif(not MATRIX, reason="left to `make matrix` (make test's time budget)")

#: Seconds of load per gunicorn run: ≥ 20 s for the regression tests with DISTLOCK_FAULTS_LONG=1 and in
#: ``make matrix``, 8 s in ``make test`` (its time budget); less per cell of the matrix.
SITE_SECONDS = 20 if LONG or MATRIX else 8
#: Runs of the green pool on PostgreSQL: the issue's 300 (15–20 of them failed) with DISTLOCK_FAULTS_LONG=1
#: and in ``make matrix``, 150 in ``make test``: still three times the concurrency, every run over again.
GREEN_POSTGRES_RUNS = 300 if LONG or MATRIX else 150
#: Runs per backend of the soft time-limit storm: 80 in ``make matrix``, 40 with DISTLOCK_FAULTS_LONG=1,
#: 20 in ``make test`` (five interrupted runs on each of the 4 keys of every backend).
STORM_RUNS = 80 if MATRIX else 40 if LONG else 20
MATRIX_SITE_SECONDS = float(os.environ.get("DISTLOCK_MATRIX_SITE_SECONDS", "10"))
#: Celery pool -> concurrency (the issue's ``-c 50`` for the green pools).
POOLS = {"prefork": 4, "threads": 16, "solo": 1, "gevent": 50, "eventlet": 50}
#: The database backend on PostgreSQL may open at most this many connections beyond the concurrency.
CONNECTION_SLACK = 5


@pytest.fixture
def record(request):
    """``record(figures)``: keep a run's figures for ``make matrix``'s table (a JSON line per run)."""
    def record(section, figures):
        path = os.environ.get("DISTLOCK_MATRIX_OUT")
        if path:
            with open(path, "a") as out:
                out.write(json.dumps({"section": section, "test": request.node.name, **figures}, default=str) + "\n")
        return figures
    return record


def require(*aliases):
    for alias in aliases:
        require_alias(alias)


def site(record, kind, alias, seconds):
    if not harness.gunicorn_has_worker(kind):
        pytest.skip(f"this gunicorn has no {kind} worker")
    figures = harness.run_site(kind, alias, "postgres", seconds)
    record("gunicorn", {**figures, "failures": harness.site_failures(figures), "log_tail": ""})
    return figures


def describe(figures):
    return json.dumps({key: value for key, value in figures.items() if key != "log_tail"}, default=str, indent=1)


# -- gunicorn ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_gunicorn_gevent_database_backend_on_postgresql(record):
    """``-k gevent -w 2``, 32 clients on 4 hot names for ``SITE_SECONDS`` (20 s in long mode): no worker death,
    no 5xx, every update counted once under a token newer than the last (was: workers aborted by libev, 500s,
    a borrowed token 1)."""
    require("postgres")
    figures = site(record, "gevent", "postgres", SITE_SECONDS)
    assert not harness.site_failures(figures), describe(figures) + figures["log_tail"]


@matrix_slice
@pytest.mark.slow
def test_gunicorn_gevent_etcd_keeps_up_with_gthread(record):
    """etcd under ``-k gevent``: none hangs, no lease lost, and it serves ≥ 0.7× the successful requests per
    second of the same site under ``-k gthread`` in the same run (was: 0–3 requests in 20 s, 14–16 hung)."""
    require("postgres", "etcd")
    threaded = site(record, "gthread", "etcd", SITE_SECONDS / 2)
    assert not harness.site_failures(threaded), describe(threaded) + threaded["log_tail"]
    green = site(record, "gevent", "etcd", SITE_SECONDS)
    assert not harness.site_failures(green), describe(green) + green["log_tail"]
    assert green["rate"] >= 0.7 * threaded["rate"], \
        f"gevent {green['rate']}/s against gthread {threaded['rate']}/s\n{describe(green)}"


@matrix_only
@pytest.mark.slow
@pytest.mark.parametrize("alias", ["postgres", "redis", "zookeeper", "etcd"])
@pytest.mark.parametrize("kind", harness.GUNICORN_WORKERS)
def test_gunicorn_matrix(record, kind, alias):
    require("postgres", alias)
    figures = site(record, kind, alias, MATRIX_SITE_SECONDS)
    assert not harness.site_failures(figures), describe(figures) + figures["log_tail"]


# -- Celery's green pools ---------------------------------------------------------------------------

def green(record, pool, alias, runs, concurrency, **options):
    """Run a Celery pool; return its figures and what went wrong (for a refused pair: what was not refused)."""
    require(alias)
    figures = harness.run_green_pool(pool, alias, runs, concurrency, **options)
    refused = (pool, alias) in harness.REFUSED
    if refused:
        failures = harness.refusal_failures(figures)
    else:
        limit = concurrency + CONNECTION_SLACK if alias == "postgres" else None
        failures = harness.green_failures(figures, max_connections=limit)
    record("celery", {**figures, "refused": refused, "failures": failures})
    return figures, failures


@pytest.mark.slow
@pytest.mark.parametrize("pool", [pytest.param("eventlet", marks=matrix_slice), "gevent"])
def test_green_pool_database_backend_on_postgresql(record, pool):
    """``GREEN_POSTGRES_RUNS`` runs (300 in long mode) at concurrency 50: no error, no overlap, connections ≤
    concurrency + 5 (was: ``'NoneType' object has no attribute 'cursor'`` in 15–20 runs of 300, 141–152
    connections)."""
    figures, failures = green(record, pool, "postgres", GREEN_POSTGRES_RUNS, 50)
    assert figures["runs"] >= GREEN_POSTGRES_RUNS and not failures, describe(figures)


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["eventlet", pytest.param("gevent", marks=matrix_slice)])
def test_green_pool_zookeeper(record, pool):
    """60 runs: no ``BackendUnavailable``, nothing left held, warm shutdown completes (was: 7–58 of 60
    failed, a record left, the shutdown hung)."""
    figures, failures = green(record, pool, "zookeeper", 60, 16)
    assert figures["backend_unavailable"] == 0 and not failures, describe(figures)


@pytest.mark.slow
def test_green_pool_etcd_run_four_ttls_keeps_its_lease(record):
    """Under gevent a run of 8 s with ttl 2 and auto-renew keeps its lease while 40 short runs go on (was:
    ``LockLost``)."""
    figures, failures = green(record, "gevent", "etcd", 40, 8, long_run=(2, 8.0))
    assert figures.get("long_run", {}).get("lost") is False and not failures, describe(figures)


@pytest.mark.slow
def test_eventlet_pool_refuses_etcd_naming_the_fix(record):
    """gRPC has no eventlet support: every run under ``--pool eventlet`` fails with ``ImproperlyConfigured``
    naming eventlet, and nothing is held (was: leases lost, another run took the key 7–13 times)."""
    figures, failures = green(record, "eventlet", "etcd", 40, 8, long_run=(2, 8.0))
    assert not failures, describe(figures)


@matrix_only
@pytest.mark.slow
@pytest.mark.parametrize("alias", ALIASES)
@pytest.mark.parametrize("pool", list(POOLS))
def test_celery_pool_matrix(record, pool, alias):
    runs = 100 if pool != "solo" else 40
    figures, failures = green(record, pool, alias, runs, POOLS[pool], long_run=(2, 8.0))
    assert not failures, describe(figures)


# -- fork in a gevent-patched process ---------------------------------------------------------------

@pytest.mark.slow
def test_fork_after_zookeeper_and_etcd_locks_in_a_gevent_process():
    """Children forked after locks on both aliases work, and so does the parent, with the lease it held across
    the forks; no child renews or holds the parent's leases (was: the parent's kazoo loop read its socket in
    each child, the parent's next lock failed; a child hung in its first etcd channel)."""
    require("zookeeper", "etcd")
    process = subprocess.run([sys.executable, "-m", "tests.deployment.fork_gevent", f"fork:{uuid.uuid4().hex[:8]}"],
                             capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=180, check=False)
    lines = [json.loads(line) for line in process.stdout.splitlines() if line.startswith("{")]
    report = f"exit {process.returncode}\nstdout:\n{process.stdout[-3000:]}\nstderr:\n{process.stderr[-4000:]}"
    children = [line for line in lines if "child" in line]
    parent = [line for line in lines if "parent" in line]
    assert process.returncode == 0 and len(children) == 3 and len(parent) == 1, report
    assert all(not child["errors"] for child in children), report
    inherited = {"renewing": False, "check": "LockLost"}
    assert all(child["inherited"] == {"zookeeper": inherited, "etcd": inherited} for child in children), report
    assert not any("parent_round" in line for line in lines), report
    assert parent[0]["exits"] == [0, 0, 0] and parent[0]["unfinished"] == 0, report
    assert parent[0]["held_checks"] == {"zookeeper": "ok", "etcd": "ok"} and not parent[0]["errors"], report
    assert "Traceback" not in process.stderr, report


# -- time-limit storms ------------------------------------------------------------------------------

def storm(record, pool, aliases, runs, concurrency, limit):
    require(*aliases)
    figures = harness.run_storm(pool, aliases, runs, concurrency, limit=limit)
    failures = {alias: harness.storm_failures(figures[alias]) for alias in aliases}
    for alias in aliases:
        record("storm", {"alias": alias, **figures[alias], "failures": failures[alias]})
    if not figures["worker_alive"]:
        failures["worker"] = ["the worker died during the storm"]
    return figures, {alias: problems for alias, problems in failures.items() if problems}


@pytest.mark.slow
def test_soft_time_limit_storm_on_prefork(record):
    """``STORM_RUNS`` runs per backend (40 in long mode), each ended by a soft time limit drawn from 0.02–0.6 s
    while it makes lock calls: afterwards no key is held past ttl + 1 s and every key's next run gets its lock
    (was: keys held 27–32 s with ttl 4 on every backend, znodes left for the life of the pool process)."""
    # SQLite was: the write slot stayed taken after a release or an extend interrupted before its last row;
    # etcd: a key held past its ttl, before its calls ran out of an interrupt's reach (backends/offload.py).
    figures, failures = storm(record, "prefork", ALIASES, STORM_RUNS, 4, "soft")
    assert not failures, json.dumps(figures, indent=1, default=str)


@matrix_slice
@pytest.mark.slow
def test_hard_time_limit_storm_on_gevent(record):
    """Under ``--pool gevent`` the hard limit is a ``gevent.Timeout`` raised inside the lock's own calls, and the
    process lives on: afterwards no key is held past ttl + 1 s (was: 3–4 keys of 60 held 22 s later)."""
    aliases = ALIASES if MATRIX else ("postgres", "redis", "zookeeper", "etcd")
    figures, failures = storm(record, "gevent", aliases, 40, 20, "hard")
    assert not failures, json.dumps(figures, indent=1, default=str)

