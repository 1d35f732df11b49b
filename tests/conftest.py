"""Fixtures shared by the whole suite: the backend aliases under test and unique lock names."""

import os
import threading
import uuid

import pytest
from django.conf import settings
from django.db import connections

import distlock
from distlock.exceptions import LockNotAcquired
from distlock.handler import locks

#: Every alias the contract suite runs on -> the server kind ``python -m tests.servers`` starts for it
#: (None: needs no server).
BACKEND_ALIASES = {
    "locmem": None,
    "default": None,  # the database backend on SQLite
    "postgres": "postgres",
    "redis": "redis",
    "redis_cache": "redis",
    "redlock": "redlock",
    "zookeeper": "zookeeper",
    "etcd": "etcd",
}

#: Aliases whose locks other processes can see (locmem is per process).
SHARED_ALIASES = [alias for alias in BACKEND_ALIASES if alias != "locmem"]

#: ``BACKEND_ALIASES`` and the aliases only the contract suite, the fencing timelines and their own module run
#: on: a Redis Cluster alias is the Redis backend, whose behaviour above the server the "redis" alias covers;
#: zookeeper_buckets is the ZooKeeper backend with LAYOUT "buckets", whose znode layout only the contract suite
#: and tests/backends/test_zookeeper.py need.
CONTRACT_ALIASES = {**BACKEND_ALIASES, "redis_cluster": "rediscluster", "zookeeper_buckets": "zookeeper"}
CONTRACT_SHARED_ALIASES = [alias for alias in CONTRACT_ALIASES if alias != "locmem"]


def require_alias(alias):
    """Skip the test if ``alias`` is not configured, or fail it when ``make test`` started its server."""
    if alias in settings.DISTLOCK:
        return alias
    kind = CONTRACT_ALIASES.get(alias)
    required = os.environ.get("DISTLOCK_TEST_REQUIRE", "").split(",")
    if kind in required:
        pytest.fail(f"alias {alias!r} is missing although its server {kind!r} was started")
    pytest.skip(f"alias {alias!r} needs a {kind} server; run the suite with `make test`")
    return None


#: Aliases whose locks live in a test database -> that database: the database backend on SQLite, on PostgreSQL.
LOCKS_IN_A_DATABASE = {"default": "default", "postgres": "postgres"}


#: The apps whose tables a test of locks alone writes (``alias_params(..., locks_only=True)``).
LOCK_APPS = ["distlock", "tests.fencing_app"]


def alias_params(aliases, long_only_aliases=(), *, locks_only=False):
    """``aliases`` as fixture parameters for a module whose tests touch no database but their alias's: each
    alias's tests get the default database (the metrics recorder's and the worker processes') and the one its
    locks live in, if any, still transactional. Emptying every test database after each test, the others
    untouched, took 0.1–0.2 s a test. ``long_only_aliases`` are left to DISTLOCK_FAULTS_LONG=1.

    ``locks_only``: the module's tests use no other app's models (no users, no admin), so after each test
    only ``LOCK_APPS``' tables are emptied and Django does not make the other apps' content types and
    permissions again (``available_apps``): 0.08 s down to 0.02 s a test with PostgreSQL."""
    params = []
    extra = {"available_apps": LOCK_APPS} if locks_only else {}
    for alias in aliases:
        databases = sorted({"default", LOCKS_IN_A_DATABASE.get(alias, "default")})
        marks = [pytest.mark.django_db(transaction=True, databases=databases, **extra)]
        if alias in long_only_aliases:
            marks.append(long_only)
        params.append(pytest.param(alias, marks=marks))
    return params


def record_tries(backend, monkeypatch):
    """Return a list that gets the owner of each try reaching ``backend`` (each try still goes to the server)."""
    seen = []
    real = backend._try_acquire

    def try_acquire(attempt):
        seen.append(attempt.owner)
        return real(attempt)

    monkeypatch.setattr(backend, "_try_acquire", try_acquire)
    return seen


@pytest.fixture(params=alias_params(BACKEND_ALIASES))
def backend_alias(request):
    """Each backend alias in turn, with the default database and the one its locks live in."""
    return require_alias(request.param)


#: ``make test`` runs a slice of some parametrized soaks, to stay within its 20 minutes;
#: ``DISTLOCK_FAULTS_LONG=1 make test`` runs them all (and the fault suite's long runs).
LONG = os.environ.get("DISTLOCK_FAULTS_LONG") == "1"
long_only = pytest.mark.skipif(not LONG, reason="left to DISTLOCK_FAULTS_LONG=1 make test (make test's time budget)")


@pytest.fixture(params=alias_params(SHARED_ALIASES))
def shared_alias(request):
    """Each alias whose locks exclude other processes, with the default database and the one they live in."""
    return require_alias(request.param)


def free(alias, name):
    """Return True if another holder, on another thread, gets ``name`` at once (and gives it back)."""
    found = []

    def try_once():
        try:
            distlock.acquire(name, ttl=5, blocking=False, using=alias).release()
            found.append(True)
        except LockNotAcquired:
            found.append(False)
        finally:
            connections.close_all()

    thread = threading.Thread(target=try_once)
    thread.start()
    thread.join(30)
    assert found, f"the non-blocking acquire of {name!r} did not finish"
    return found[0]


@pytest.fixture
def lock_name():
    """A lock name no other test uses, so tests sharing a server never meet."""
    return f"test:{uuid.uuid4().hex}"


@pytest.fixture(autouse=True)
def _close_backends_after_test():
    yield
    locks.close_all()
