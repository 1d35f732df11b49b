"""Scenario 14 (FAULTS.md S20): token sources that go back, on real servers of this module's own.

Each backend's token source is broken the way an operator or a machine breaks it: an etcd cluster
restored from an older snapshot (``etcdctl snapshot save`` / ``snapshot restore``, with the old and
with a new ``--initial-cluster-token``); a ZooKeeper ensemble whose data dirs are wiped; a Redis
server whose wall clock steps back an hour (libfaketime on the redis-server process), first with its
token counter intact, then restarted empty; SQLite under a client clock a day behind (libfaketime on
the client process: SQLite reads the clock in the process that opens the file), first with its token
row intact, then with it deleted; the PostgreSQL token sequence restarted.

Two layers catch what follows (``distlock.backends.token_order``): a process that saw a higher token
of the alias refuses the server from then on (``TokenRegression``: every grant and every fenced write
with one of its leases, a log line, ``distlock_token_regressions``, ``token_regression``); a process
started after the fault knows nothing higher and gets the low tokens, which a fenced row written with
a higher one refuses (``StaleFencingToken``). Where the token survives (a clock stepped back with the
counter intact, the ZooKeeper client that saw the old zxids) the tests show that it never goes back.

Each scenario is deterministic (no timing decides it), so ``--long`` runs it once too.
"""

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis
from django.db import connections
from prometheus_client import REGISTRY

import distlock
from distlock import metrics
from distlock.backends.database import DatabaseBackend
from distlock.backends.etcd import EtcdBackend
from distlock.backends.redis import RedisBackend
from distlock.backends.zookeeper import ZooKeeperBackend
from distlock.conformance.report import Result
from distlock.models import FencingRejection
from distlock.signals import token_regression
from tests.conftest import require_alias
from tests.faults.conftest import DATABASES
from tests.faults.targets import SESSION_TIMEOUT
from tests.fencing_app.models import Account
from tests.servers import wait_until
from tests.servers.etcd import EtcdCluster
from tests.servers.redis import RedisServer
from tests.servers.zookeeper import ZooKeeperEnsemble

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = "token source went back"
CLOCK_SCENARIO = "server clock stepped back"
TTL = 30.0
HOUR = 3600

ETCDCTL = "/usr/bin/etcdctl"
FAKETIME_LIBRARY = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"
#: glibc's own malloc, preloaded before libfaketime: Debian's redis-server allocates with jemalloc, which
#: reads the clock while libfaketime 0.9.10 initialises, and libfaketime then aborts the start
#: ("Cannot recover from unexpected recursive calls to clock_gettime()").
GLIBC_MALLOC = "/lib/x86_64-linux-gnu/libc_malloc_debug.so.0"


def require_files(*paths):
    missing = [path for path in paths if not os.path.exists(path)]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (scripts/bootstrap installs etcd-client and faketime)")


# -- what every scenario shares ---------------------------------------------------------------------------------


class Backends:
    """Backend instances built outside ``locks``: each stands for one process of the deployment."""

    def __init__(self):
        self.built = []

    def make(self, backend_class, alias, options):
        backend = backend_class(alias, options)
        self.built.append(backend)
        return backend

    def close(self):
        for backend in self.built:
            try:
                backend.close()
            except distlock.LockError:
                pass  # a server the test broke for good


@pytest.fixture
def backends():
    made = Backends()
    yield made
    made.close()


@pytest.fixture
def regressions():
    """The ``token_regression`` signals sent during the test: (alias, reason)."""
    seen = []

    def receiver(sender, alias, reason, **kwargs):
        seen.append((alias, reason))

    token_regression.connect(receiver)
    yield seen
    token_regression.disconnect(receiver)


def regression_metric(alias):
    return REGISTRY.get_sample_value("distlock_token_regressions_total", {"alias": alias}) or 0


def rejections_counted():
    """``distlock_fencing_rejections`` of this process, every alias summed (buffered events folded first)."""
    metrics.this_process.drain()
    return sum(sample.value for family in REGISTRY.collect() if family.name == "distlock_fencing_rejections"
               for sample in family.samples if sample.name.endswith("_total"))


@pytest.fixture
def safety_row(safety):
    """``record(backend, notes, ...)``: put one row in the safety table; no stale write was accepted."""
    counted = rejections_counted()

    def record(backend, notes, *, acquisitions, rejections, scenario=SCENARIO):
        logged = FencingRejection.objects.filter(model_label=Account._meta.label).count()
        return safety.record(Result(
            scenario=scenario, backend=backend, runs=1, acquisitions=acquisitions, stale_accepted=0,
            false_rejections=0, rejections=rejections, rejection_rows=logged,
            rejection_metric=int(rejections_counted() - counted), notes=notes,
        ))

    return record


def take(backend, name, ttl=TTL, timeout=10):
    return backend.acquire(name, ttl=ttl, timeout=timeout, blocking=True)


def tokens_of(backend, name, count):
    """Acquire and release ``name`` ``count`` times; return the tokens."""
    tokens = []
    for _ in range(count):
        lease = take(backend, name)
        tokens.append(lease.token)
        lease.release()
    return tokens


def write(row, lease_or_token):
    """Claim ``row`` with a lease or a token: "accepted", or "stale" when the row refused it."""
    try:
        Account.objects.claim(lease_or_token, pk=row.pk)
    except distlock.StaleFencingToken:
        return "stale"
    return "accepted"


def assert_refused_for_good(backend, regressions, *, went_back, held=None, row=None):
    """``backend``'s process saw its server go back: a grant, any later grant and a fenced write are refused."""
    alias = backend.alias
    metric = regression_metric(alias)
    with pytest.raises(distlock.TokenRegression, match=went_back) as refused:
        take(backend, "after-the-fault")
    message = str(refused.value)
    assert f"Lock alias '{alias}'" in message and "TOKEN_EPOCH" in message and "restart" in message, message
    with pytest.raises(distlock.TokenRegression):
        take(backend, "any-other-name")  # refused before any request
    if held is not None:
        with pytest.raises(distlock.TokenRegression):
            write(row, held)  # a lease granted before the fault, valid as far as its lease knows
    assert [found for found, _ in regressions] == [alias], "token_regression is sent once per alias and process"
    assert regression_metric(alias) == metric + 1, "counted once, when it was first seen"
    return message


@pytest.fixture
def row():
    return Account.objects.create(name=f"fenced-{uuid.uuid4().hex[:8]}")


# -- etcd: restored from a snapshot -------------------------------------------------------------------------


@pytest.fixture
def etcd(tmp_path):
    require_files(ETCDCTL)
    cluster = EtcdCluster(tmp_path / "etcd", size=1).start()
    yield cluster
    cluster.cleanup()


def etcd_options(cluster, prefix):
    return {"ENDPOINTS": cluster.endpoints, "KEY_PREFIX": prefix, "LEASE_TTL": SESSION_TIMEOUT}


def save_snapshot(cluster, path):
    subprocess.run([ETCDCTL, "--endpoints", cluster.endpoints, "snapshot", "save", str(path)], check=True,
                   capture_output=True, timeout=30, env={**os.environ, "ETCDCTL_API": "3"})


def restore_snapshot(cluster, path, cluster_token):
    """Stop the member, replace its data dir by ``path`` restored (``etcdctl snapshot restore``), start it."""
    (member,) = cluster.members
    member.stop()
    shutil.rmtree(member.data_dir)
    subprocess.run([
        ETCDCTL, "snapshot", "restore", str(path), "--name", member.member_name, "--data-dir", str(member.data_dir),
        "--initial-cluster", member.initial_cluster, "--initial-cluster-token", cluster_token,
        "--initial-advertise-peer-urls", f"http://{member.ip}:{member.peer_port}",
    ], check=True, capture_output=True, timeout=30, env={**os.environ, "ETCDCTL_API": "3"})
    member.start()
    cluster.wait_healthy(30)


def test_etcd_restored_from_a_snapshot_is_refused(etcd, tmp_path, backends, regressions, row, safety_row):
    """Restored with its cluster token: same cluster id, revisions reissued below those already used."""
    options = etcd_options(etcd, f"/restore-{uuid.uuid4().hex[:8]}/")
    survivor = backends.make(EtcdBackend, "etcd-restored", options)
    tokens_of(survivor, "orders", 1)
    save_snapshot(etcd, tmp_path / "snapshot.db")
    held = take(survivor, "held")  # its key is newer than the snapshot: gone after the restore
    highest = tokens_of(survivor, "orders", 3)[-1]
    assert write(row, highest) == "accepted"

    restore_snapshot(etcd, tmp_path / "snapshot.db", etcd.members[0].cluster_token)

    message = assert_refused_for_good(survivor, regressions, went_back="etcd cluster went back to revision",
                                      held=held, row=row)
    # A process started after the restore knows no higher revision: its tokens go back unseen, and the
    # fenced row, written with a higher token, refuses them.
    newcomer = backends.make(EtcdBackend, "etcd-newcomer", options)
    reissued = take(newcomer, "orders")
    assert reissued.token <= highest, "the restored cluster reissues revisions already used"
    assert write(row, reissued) == "stale"
    reissued.release()
    safety_row("etcd", [f"restored snapshot: revisions went back from {highest} to {reissued.token}; the process "
                        "that saw them refused (TokenRegression), a process started after refused per row"],
               acquisitions=7, rejections=1)
    assert "restored from a snapshot" in message


def test_etcd_restored_with_a_new_cluster_token_is_refused(etcd, tmp_path, backends, regressions, row, safety_row):
    """Restored with a new cluster token: a new cluster id, even once its revisions passed those seen before."""
    options = etcd_options(etcd, f"/new-token-{uuid.uuid4().hex[:8]}/")
    survivor = backends.make(EtcdBackend, "etcd-new-id", options)
    save_snapshot(etcd, tmp_path / "snapshot.db")
    seen = tokens_of(survivor, "orders", 2)[-1]

    restore_snapshot(etcd, tmp_path / "snapshot.db", f"restored-{uuid.uuid4().hex[:8]}")
    newcomer = backends.make(EtcdBackend, "etcd-newcomer", options)
    newer = []
    while not newer or newer[-1] <= seen:  # bounded: each grant and release adds 2 revisions
        newer += tokens_of(newcomer, "orders", 1)
        assert len(newer) < 10

    assert_refused_for_good(survivor, regressions, went_back="etcd cluster id changed")
    safety_row("etcd", [f"restored with a new cluster token: cluster id changed while revisions went on from "
                        f"{seen} to {newer[-1]}; the process that saw the old id refused (TokenRegression)"],
               acquisitions=2 + len(newer), rejections=0)


# -- ZooKeeper: data dirs wiped --------------------------------------------------------------------------------


@pytest.fixture
def zookeeper(tmp_path):
    ensemble = ZooKeeperEnsemble(tmp_path / "zookeeper").start()
    yield ensemble
    ensemble.cleanup()


def test_zookeeper_wiped_ensemble_reissues_zxids_but_never_to_a_client_that_saw_them(
        zookeeper, backends, regressions, row, safety_row):
    """A wiped ensemble starts its zxids again; ZooKeeper itself refuses a client that saw higher ones."""
    options = {"HOSTS": zookeeper.hosts, "KEY_PREFIX": f"/wiped-{uuid.uuid4().hex[:8]}",
               "SESSION_TIMEOUT": SESSION_TIMEOUT}
    survivor = backends.make(ZooKeeperBackend, "zk-survivor", options)
    before = tokens_of(survivor, "orders", 3)
    held = take(survivor, "held")
    assert write(row, before[-1]) == "accepted"

    for member in zookeeper.members:
        member.kill()
    wiped_at = time.monotonic()
    for member in zookeeper.members:
        shutil.rmtree(member.data_dir)
    zookeeper.start()

    newcomer = backends.make(ZooKeeperBackend, "zk-newcomer", options)
    reissued = take(newcomer, "orders")
    assert reissued.token < before[-1], "a wiped ensemble starts its zxids again"
    assert write(row, reissued) == "stale"
    reissued.release()
    # The survivor's client sent the zxid it saw with every reconnection: the ensemble refuses it ("client
    # must try another server") until its own zxid passes that one, and the session expired meanwhile.
    with pytest.raises(distlock.BackendUnavailable):
        take(survivor, "orders", timeout=1)
    wait_until(lambda: any("Refusing session request" in member.new_logs() for member in zookeeper.members), 10,
               "the ensemble refusing the survivor's client")
    wait_until(lambda: held.lost_reason is not None, SESSION_TIMEOUT + 5, "the survivor's held lease marked lost")
    assert time.monotonic() - wiped_at < SESSION_TIMEOUT + 10
    newer = [reissued.token]
    while newer[-1] <= max(before[-1], held.token):  # bounded: a few writes carry the ensemble past them
        newer += tokens_of(newcomer, "orders", 1)
        assert len(newer) < 20
    after = take(survivor, "orders", timeout=15)
    assert after.token > max(before[-1], held.token), "tokens never go back in the process that saw the old zxids"
    after.release()
    assert regressions == []
    safety_row("ZooKeeper", [f"data dirs wiped: zxids went back from {before[-1]:#x} to {reissued.token:#x}; "
                             "a client started after refused per row; the client that saw them was refused "
                             "by the ensemble until its zxid passed, then got higher tokens"],
               acquisitions=len(before) + len(newer) + 2, rejections=1)


# -- Redis: the server clock stepped back ---------------------------------------------------------------------------


class SteppedClockRedis(RedisServer):
    """A redis-server whose wall clock the test steps (libfaketime, re-read on every call); its monotonic
    clock, which its timers run on, is left alone."""

    def __init__(self, workdir):
        super().__init__(workdir=workdir)
        self.clock_file = self.workdir / "faketime"
        self.step_clock(0)

    def step_clock(self, seconds):
        """Set the server's wall clock ``seconds`` away from the machine's (negative: behind)."""
        self.clock_file.write_text(f"{seconds:+d}\n")

    def env(self):
        return {**os.environ, "LD_PRELOAD": f"{GLIBC_MALLOC} {FAKETIME_LIBRARY}",
                "FAKETIME_TIMESTAMP_FILE": str(self.clock_file), "FAKETIME_NO_CACHE": "1",
                "FAKETIME_DONT_FAKE_MONOTONIC": "1"}

    def behind(self):
        """Seconds the server's clock (``TIME``) is behind the machine's."""
        with redis.Redis.from_url(self.url) as client:
            seconds, microseconds = client.time()
        return time.time() - (seconds + microseconds / 1e6)


@pytest.fixture
def stepped_redis(tmp_path):
    require_files(FAKETIME_LIBRARY, GLIBC_MALLOC)
    server = SteppedClockRedis(tmp_path / "redis").start()
    yield server
    server.cleanup()


def step_back_an_hour(server):
    server.step_clock(-HOUR)
    wait_until(lambda: server.behind() > HOUR - 60, 5, "the Redis clock stepping back")


def test_redis_clock_stepped_back_keeps_tokens_rising(stepped_redis, backends, regressions, safety_row):
    options = {"URL": stepped_redis.url, "KEY_PREFIX": f"clock-{uuid.uuid4().hex[:8]}"}
    backend = backends.make(RedisBackend, "redis-clock", options)
    before = tokens_of(backend, "orders", 2)
    step_back_an_hour(stepped_redis)
    after = tokens_of(backend, "orders", 2) + tokens_of(backends.make(RedisBackend, "redis-later", options), "x", 1)
    assert before[-1] < after[0] < after[1] < after[2], "the counter carries the tokens on, not the clock"
    assert regressions == []
    safety_row("Redis", [f"server clock 1 h back, counter intact: tokens went on from {before[-1]} to "
                         f"{after[0]} (the counter + 1)"], acquisitions=5, rejections=0, scenario=CLOCK_SCENARIO)


def test_redis_restarted_empty_behind_its_clock_is_refused(stepped_redis, backends, regressions, row, safety_row):
    """Restarted without its counter while its clock is an hour behind: tokens go back to the clock."""
    options = {"URL": stepped_redis.url, "KEY_PREFIX": f"restart-{uuid.uuid4().hex[:8]}"}
    survivor = backends.make(RedisBackend, "redis-survivor", options)
    highest = tokens_of(survivor, "orders", 2)[-1]
    held = take(survivor, "held")
    assert write(row, held) == "accepted"
    step_back_an_hour(stepped_redis)
    stepped_redis.kill()
    stepped_redis.start()
    assert stepped_redis.behind() > HOUR - 60

    assert_refused_for_good(survivor, regressions, went_back="went back", held=held, row=row)
    newcomer = backends.make(RedisBackend, "redis-newcomer", options)
    low = take(newcomer, "orders")
    assert low.token < highest, "the counter is gone and the clock is behind: the token goes back"
    assert write(row, low) == "stale"
    low.release()
    safety_row("Redis", [f"restarted empty with its clock 1 h back: tokens went back from {held.token} to "
                         f"{low.token}; the process that saw them refused (TokenRegression), a process "
                         "started after refused per row"], acquisitions=5, rejections=1)


# -- the database backend: SQLite under a client clock stepped back, the PostgreSQL sequence restarted -------------

#: Run in a client process under libfaketime (the clock SQLite reads is that process's): steps from argv,
#: one JSON line out. libfaketime 0.9.10 with the monotonic clock left alone makes ``time.sleep`` fail
#: with EINVAL, so sleeping waits on an Event instead (``threading`` waits work).
SQLITE_CLIENT = """
import json, sys, threading, time
time.sleep = lambda seconds: threading.Event().wait(seconds)
import django
django.setup()
from django.conf import settings
settings.DISTLOCK_METRICS = {"ENABLED": False}
from django.core.management import call_command
from django.db import connections
import distlock
alias, database, steps, out = sys.argv[1], sys.argv[2], sys.argv[3:], []
for step in steps:
    if step == "migrate":
        call_command("migrate", "distlock", database=database, verbosity=0)
    elif step == "clock":
        with connections[database].cursor() as cursor:
            cursor.execute("SELECT (julianday('now') - 2440587.5) * 86400")
            out.append({"clock": cursor.fetchone()[0]})
    elif step == "wipe":
        with connections[database].cursor() as cursor:
            cursor.execute("DELETE FROM distlock_tokensequence")
        out.append({"wiped": True})
    else:
        try:
            lease = distlock.acquire("orders", ttl=10, timeout=5, using=alias)
        except distlock.LockError as exc:
            out.append({"error": type(exc).__name__, "message": str(exc)})
        else:
            out.append({"token": lease.token})
            lease.release()
print(json.dumps(out))
"""


def sqlite_client(database_file, *steps, behind=None):
    """Run ``steps`` in a new client process, its clock ``behind`` seconds back (libfaketime); return its output."""
    entry = {"BACKEND": "distlock.backends.database.DatabaseBackend", "OPTIONS": {"DATABASE": "clockdb"}}
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.faults.settings", "DISTLOCK_TEST_CHILD": "1",
           "DISTLOCK_FAULTS_ALIASES": json.dumps({"sqlite-clock": entry}),
           "DISTLOCK_FAULTS_DATABASES": json.dumps({"clockdb": {"ENGINE": "django.db.backends.sqlite3",
                                                                "NAME": str(database_file)}})}
    if behind is not None:
        env.update(LD_PRELOAD=FAKETIME_LIBRARY, FAKETIME=f"-{behind}", FAKETIME_DONT_FAKE_MONOTONIC="1")
    done = subprocess.run([sys.executable, "-c", SQLITE_CLIENT, "sqlite-clock", "clockdb", *steps], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def sqlite_file(tmp_path):
    require_files(FAKETIME_LIBRARY)
    path = tmp_path / "locks.sqlite3"
    sqlite_client(path, "migrate")
    return path


DAY = 24 * HOUR


def test_sqlite_client_clock_stepped_back_keeps_tokens_rising(sqlite_file, safety_row):
    (before,) = sqlite_client(sqlite_file, "acquire")
    clock, *after = sqlite_client(sqlite_file, "clock", "acquire", "acquire", behind=DAY)
    assert time.time() - clock["clock"] > DAY - 60, "SQLite read the client's stepped clock"
    assert before["token"] < after[0]["token"] < after[1]["token"], "the counter carries the tokens on"
    safety_row("database (SQLite)", [f"client clock 1 day back, token row intact: tokens went on from "
                                     f"{before['token']} to {after[0]['token']} (the counter + 1)"],
               acquisitions=3, rejections=0, scenario=CLOCK_SCENARIO)


def test_sqlite_token_row_lost_behind_the_clock_is_refused(sqlite_file, row, safety_row):
    """The token row deleted (a restore, a flush) while the clock is behind: tokens go back to the clock."""
    (before,) = sqlite_client(sqlite_file, "acquire")
    assert write(row, before["token"]) == "accepted"
    seen, wiped, refused = sqlite_client(sqlite_file, "acquire", "wipe", "acquire", behind=DAY)
    assert seen["token"] > before["token"] and wiped == {"wiped": True}
    assert refused.get("error") == "TokenRegression", f"the process that saw {seen['token']} got {refused}"
    assert "Lock alias 'sqlite-clock'" in refused["message"] and "TOKEN_EPOCH" in refused["message"]
    # A process started after it knows nothing higher: its token goes back unseen; the fenced row refuses it.
    (low,) = sqlite_client(sqlite_file, "acquire", behind=DAY)
    assert low["token"] < before["token"]
    assert write(row, low["token"]) == "stale"
    safety_row("database (SQLite)", [f"token row deleted under a clock 1 day back: tokens went back from "
                                     f"{seen['token']} to {low['token']}; the process that saw them refused "
                                     "(TokenRegression), a process started after refused per row"],
               acquisitions=3, rejections=1)


def test_postgres_token_sequence_restarted_is_refused(backends, regressions, row, safety_row):
    """An operator restarts the sequence (or restores the database without it): nextval() starts again."""
    require_alias("postgres")
    survivor = backends.make(DatabaseBackend, "pg-survivor", {"DATABASE": "postgres"})
    tokens_of(survivor, "orders", 2)
    held = take(survivor, "held")
    assert write(row, held) == "accepted"
    with connections["postgres"].cursor() as cursor:
        cursor.execute("ALTER SEQUENCE distlock_token_seq RESTART WITH 1")
    try:
        assert_refused_for_good(survivor, regressions, went_back="went back", held=held, row=row)
        newcomer = backends.make(DatabaseBackend, "pg-newcomer", {"DATABASE": "postgres"})
        low = take(newcomer, "orders")
        assert low.token < held.token
        assert write(row, low) == "stale"
        low.release()
    finally:
        held.release()
        with connections["postgres"].cursor() as cursor:  # the suite's later tests expect tokens above this test's
            cursor.execute("SELECT setval('distlock_token_seq', %s)", [held.token + 1000])
    safety_row("database (PostgreSQL)", [f"token sequence restarted: tokens went back from {held.token} to "
                                         f"{low.token}; the process that saw them refused (TokenRegression), "
                                         "a process started after refused per row"],
               acquisitions=5, rejections=1)
