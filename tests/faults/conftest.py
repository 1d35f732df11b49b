"""Fixtures of the fault suite: run sizes (``--long``), the fenced store, scenario runs, private servers, results.

Every scenario test hands its ``Result`` to ``safety.record()``; the table of all of them is printed
at the end of the session and, with ``--safety-report PATH``, written as ``docs/SAFETY.md`` (see
``tests/faults/report.py``). Servers a scenario breaks are private to this suite (session-scoped
fixtures below, on ports of their own); the shared servers of ``python -m tests.servers`` are
only used by scenarios that disturb client processes, never servers.
"""

import json
import os
import time
from dataclasses import dataclass

import pytest
from django.conf import settings

from distlock.conformance.run import Run
from distlock.conformance.store import FencedStore
from tests.faults import report
from tests.faults.proxy import ReplicationProxy
from tests.servers.etcd import EtcdCluster
from tests.servers.redis import RedisServer, SentinelDeployment
from tests.servers.zookeeper import ZooKeeperEnsemble

RESULTS = pytest.StashKey[list]()
FAILED = pytest.StashKey[list]()
STARTED = pytest.StashKey[float]()


def pytest_addoption(parser):
    group = parser.getgroup("faults", "fault-injection suite")
    group.addoption("--long", action="store_true", default=False,
                    help="bigger fault runs: 20 runs of each canary, 5 of the others, longer soaks "
                         "(or DISTLOCK_FAULTS_LONG=1)")
    group.addoption("--safety-report", metavar="PATH", default=None,
                    help="write the fault suite's results table to PATH (docs/SAFETY.md)")


def pytest_configure(config):
    config.stash[RESULTS] = []
    config.stash[FAILED] = []
    config.stash[STARTED] = time.time()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Remember failed fault tests: a scenario that fails before recording its result has no row."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        item.config.stash[FAILED].append(f"{item.nodeid} ({report.when})")


def long_mode(config):
    return bool(config.getoption("--long", default=False)) or os.environ.get("DISTLOCK_FAULTS_LONG") == "1"


@dataclass(frozen=True)
class Scale:
    """How big the runs are: small by default (part of ``make test``), bigger with ``--long``."""

    long: bool

    @property
    def canary_runs(self):
        """Runs of a scenario whose violation must show every time (the paused holder's overlap)."""
        return 20 if self.long else 1

    @property
    def runs(self):
        return 5 if self.long else 1

    @property
    def failover_runs(self):
        """Runs of a scenario that fails a replicated server over (a few seconds each): the Sentinel failover."""
        return 30 if self.long else 5

    @property
    def clients(self):
        return 8

    @property
    def iterations(self):
        """Acquisitions per contending process."""
        return 100 if self.long else 15


@pytest.fixture(scope="session")
def scale(request):
    return Scale(long_mode(request.config))


class Safety:
    """Where tests put their results for the table."""

    def __init__(self, results):
        self._results = results

    def record(self, result):
        self._results.append(result)
        return result


@pytest.fixture
def safety(request):
    return Safety(request.config.stash[RESULTS])


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    results = config.stash.get(RESULTS, [])
    if results:
        terminalreporter.write_sep("=", "safety under faults")
        terminalreporter.write_line(report.table(results))


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--safety-report", default=None)
    results = session.config.stash.get(RESULTS, [])
    if path and results:
        report.write(path, results, failed=session.config.stash[FAILED], started=session.config.stash[STARTED],
                     long=long_mode(session.config))


# -- the fenced store and scenario runs -----------------------------------------------------------------

#: The databases the fault tests touch: the store lives on PostgreSQL when it runs, else on SQLite.
DATABASES = [alias for alias in ("default", "postgres") if alias in settings.DATABASES]


@pytest.fixture
def store_database():
    return "postgres" if "postgres" in settings.DATABASES else "default"


@pytest.fixture
def fenced_store(store_database):
    store = FencedStore(store_database).create()
    yield store
    store.drop()


@pytest.fixture
def fault_run(tmp_path, fenced_store):
    """Return ``make(aliases, ...)``: a ``Run`` whose clients see the ``DISTLOCK`` entries ``aliases``.

    The first alias is the one under test. ``databases`` adds ``DATABASES`` entries to the clients
    (PostgreSQL behind a proxy); ``fenced=False`` gives a run without store.
    """
    runs = []

    def make(aliases, *, databases=None, fenced=True, module="distlock.conformance.client"):
        env = {"DJANGO_SETTINGS_MODULE": "tests.faults.settings", "DISTLOCK_TEST_CHILD": "1",
               "DISTLOCK_FAULTS_ALIASES": json.dumps(aliases), "DISTLOCK_FAULTS_DATABASES": json.dumps(databases or {})}
        run = Run(next(iter(aliases)), tmp_path / f"run-{len(runs)}", store=fenced_store if fenced else None,
                  env=env, module=module)
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.close()


# -- private servers, for the scenarios that break them -------------------------------------------------------

@pytest.fixture(scope="session")
def private_redis(tmp_path_factory):
    """A Redis without persistence that only the fault suite uses (and restarts)."""
    server = RedisServer(workdir=tmp_path_factory.mktemp("redis-volatile")).start()
    yield server
    server.cleanup()


@pytest.fixture(scope="session")
def private_persistent_redis(tmp_path_factory):
    """A Redis with ``appendonly yes`` + ``appendfsync always``."""
    server = RedisServer(workdir=tmp_path_factory.mktemp("redis-persistent"), persistent=True).start()
    yield server
    server.cleanup()


@pytest.fixture(scope="session")
def private_redlock(tmp_path_factory):
    """Five independent Redis masters for the Redlock scenarios."""
    servers = [RedisServer(workdir=tmp_path_factory.mktemp(f"redlock-{i}")).start() for i in range(5)]
    yield servers
    for server in servers:
        server.cleanup()


@pytest.fixture(scope="session")
def private_zookeeper(tmp_path_factory):
    ensemble = ZooKeeperEnsemble(tmp_path_factory.mktemp("zookeeper")).start()
    yield ensemble
    ensemble.cleanup()


@pytest.fixture(scope="session")
def private_etcd(tmp_path_factory):
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd")).start()
    yield cluster
    cluster.cleanup()


@pytest.fixture(scope="session")
def private_sentinel(tmp_path_factory):
    """A Redis master, its replica and three Sentinels; each node behind a proxy that can stall its replication."""
    deployment = SentinelDeployment(tmp_path_factory.mktemp("sentinel"), down_after_ms=500,
                                    front=lambda port: ReplicationProxy(port).start()).start()
    yield deployment
    deployment.cleanup()
