"""What only the database backend promises: its own connection, the SQLite write slot, the server's clock."""

import contextlib
import glob
import json
import logging
import os
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import types
import uuid

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connections, transaction

import distlock
from distlock.backends._sql import DIALECTS
from distlock.backends._sql_pool import ConnectionPool
from distlock.backends.database import DatabaseBackend
from distlock.checks import W002, check_distlock_setting
from distlock.exceptions import BackendUnavailable
from distlock.handler import locks
from distlock.holder import current_task_id
from distlock.models import FencingRejection, Lock
from tests.conftest import LONG, require_alias
from tests.faults.proxy import FaultProxy
from tests.interrupted_waits import lines_that_break
from tests.servers import wait_until
from tests.workers import ROOT, child_env, read_events, spawn

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

#: Move a lock's expiry to ``seconds`` from now by the database's own clock (PostgreSQL, SQLite).
MOVE_EXPIRY = {
    "postgresql": "UPDATE distlock_lock SET expires_at = clock_timestamp() + make_interval(secs => %s) "
                  "WHERE name = %s",
    "sqlite": "UPDATE distlock_lock SET expires_at = strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', %s) WHERE name = %s",
}


@pytest.fixture(params=["default", "postgres"])
def db_alias(request):
    """The database backend on SQLite (``default``) and on PostgreSQL (``postgres``)."""
    return require_alias(request.param)


def database_of(alias):
    return locks[alias].database


def move_expiry(alias, name, seconds):
    """Set lock ``name``'s expiry ``seconds`` from now as the database server counts time."""
    connection = connections[database_of(alias)]
    argument = seconds if connection.vendor == "postgresql" else f"{seconds:+} seconds"
    with connection.cursor() as cursor:
        cursor.execute(MOVE_EXPIRY[connection.vendor], [argument, name])
        assert cursor.rowcount == 1


#: The operation of a statement a test runs on the backend's own connections, for messages.
TEST_STATEMENT = "run a test statement"


def add_alias(settings, alias, **options):
    settings.DISTLOCK = {**settings.DISTLOCK,
                         alias: {"BACKEND": "distlock.backends.database.DatabaseBackend", "OPTIONS": options}}


# -- the backend's own connection ------------------------------------------------------------------

def test_a_lock_taken_inside_atomic_is_seen_by_other_processes_at_once(lock_name):
    alias = require_alias("postgres")
    with transaction.atomic(using="postgres"):
        FencingRejection.objects.using("postgres").create(model_label="uncommitted", offered_token=1)
        lease = distlock.acquire(lock_name, ttl=30, using=alias)
        # Another connection (another thread gets its own) sees the row while our transaction is open.
        seen = []

        def read_owner():
            seen.extend(Lock.objects.using("postgres").filter(name=lock_name).values_list("owner", flat=True))
            connections.close_all()

        reader = threading.Thread(target=read_owner)
        reader.start()
        reader.join()
        assert seen == [lease.owner]
        # Another process cannot take it...
        waiter = spawn("hammer", alias=alias, name=lock_name, count=1, ttl=10)
        time.sleep(1.5)
        assert waiter.poll() is None, "the other process got a lock we hold"
        # ...and gets it once we release, although our transaction is still open.
        released_at = time.monotonic_ns()
        assert lease.release() is True
        (event,) = read_events(waiter, timeout=60)
        assert event["enter"] > released_at and event["token"] > lease.token


def test_a_lock_outlives_the_rollback_of_the_transaction_it_was_taken_in(lock_name):
    alias = require_alias("postgres")
    with pytest.raises(RuntimeError), transaction.atomic(using="postgres"):
        lease = distlock.acquire(lock_name, ttl=30, using=alias)
        raise RuntimeError("roll the caller's transaction back")
    with pytest.raises(distlock.LockNotAcquired):
        distlock.acquire(lock_name, blocking=False, using=alias)
    assert lease.release() is True


# -- SQLite: one write slot ------------------------------------------------------------------------

def test_sqlite_lock_inside_a_writing_transaction_raises_lock_would_deadlock(lock_name):
    lease = distlock.acquire(f"{lock_name}:held", ttl=30, using="default")
    with transaction.atomic():
        FencingRejection.objects.create(model_label="written", offered_token=1)
        started = time.monotonic()
        with pytest.raises(distlock.LockWouldDeadlock, match=r"transaction\.atomic\(\)"):
            distlock.acquire(lock_name, ttl=30, timeout=30, using="default")
        with pytest.raises(distlock.LockWouldDeadlock):
            lease.extend()
        with pytest.raises(distlock.LockWouldDeadlock):
            locks["default"].release_owned(lease.name, lease.owner)
        assert time.monotonic() - started < 1, "detected up front, not after the busy timeout"
    assert lease.release() is True
    distlock.acquire(lock_name, ttl=30, blocking=False, using="default").release()


def test_sqlite_deferred_transactions_are_refused_too(lock_name, monkeypatch):
    # Django's default transaction_mode: a DEFERRED transaction takes the write slot at its first write,
    # which Python cannot observe, so every open transaction on the database is refused.
    connections["default"].ensure_connection()
    monkeypatch.setattr(connections["default"], "transaction_mode", None)
    with transaction.atomic():
        FencingRejection.objects.create(model_label="written", offered_token=1)
        with pytest.raises(distlock.LockWouldDeadlock):
            distlock.acquire(lock_name, ttl=5, using="default")
    with transaction.atomic():
        assert not Lock.objects.filter(name=lock_name).exists()
        with pytest.raises(distlock.LockWouldDeadlock):
            distlock.acquire(lock_name, ttl=5, using="default")
        # Refused although this read-only transaction leaves the write slot free, as another thread shows.
        other = []
        thread = threading.Thread(target=lambda: other.append(
            distlock.acquire(lock_name, ttl=5, blocking=False, using="default").release()))
        thread.start()
        thread.join(30)
        assert other == [True]


def test_sqlite_self_deadlock_is_real_without_the_check(lock_name, settings):
    """The write slot really is held: another thread, not in the transaction, waits for it and gives up."""
    add_alias(settings, "sqlite_short", DATABASE="default", REQUEST_TIMEOUT=1)
    outcome = []

    def contender():
        started = time.monotonic()
        try:
            distlock.acquire(lock_name, ttl=5, blocking=False, using="sqlite_short")
        except distlock.BackendUnavailable as exc:
            outcome.append((exc, time.monotonic() - started))

    with transaction.atomic():  # transaction_mode IMMEDIATE in tests.settings: holds the slot from BEGIN
        thread = threading.Thread(target=contender)
        thread.start()
        thread.join(30)
    ((error, waited),) = outcome
    assert "stayed locked by another writer" in str(error)
    assert 0.9 <= waited < 3


@pytest.mark.django_db(transaction=False)
def test_sqlite_locks_inside_a_transactional_test_case_raise_lock_would_deadlock(lock_name):
    # pytest-django and TestCase wrap each test in a transaction; use transaction=True for lock tests.
    with pytest.raises(distlock.LockWouldDeadlock):
        distlock.acquire(lock_name, ttl=5, using="default")


def test_sqlite_write_slot_held_by_another_connection_raises_backend_unavailable_within_the_timeout(lock_name):
    other = sqlite3.connect(connections["default"].settings_dict["NAME"], isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        for timeout in (0, 1.5):
            started = time.monotonic()
            with pytest.raises(distlock.BackendUnavailable, match="stayed locked"):
                distlock.acquire(lock_name, ttl=5, timeout=timeout, using="default")
            assert time.monotonic() - started < max(timeout, 1) + 1.5
        other.execute("ROLLBACK")
        distlock.acquire(lock_name, ttl=5, blocking=False, using="default").release()
    finally:
        other.close()


def test_sqlite_busy_timeout_is_each_call_s_own_bound_on_a_reused_connection(lock_name):
    # The PRAGMA is skipped when the connection has the value already: it must still follow each call.
    backend = locks["default"]

    def busy_timeout():
        (connection,) = backend._pool._idle  # one thread: every call reused this one connection
        return connection.connection.execute("PRAGMA busy_timeout").fetchone()[0]

    backend._pool.close()
    backend.release(backend.acquire(lock_name, ttl=5, timeout=None, blocking=True))
    assert 4900 <= busy_timeout() <= 5000  # REQUEST_TIMEOUT
    lease = backend.acquire(lock_name, ttl=5, timeout=2, blocking=True)
    assert 1900 <= busy_timeout() <= 2000  # the caller's timeout, shorter
    assert backend.release(lease) is True
    assert 4900 <= busy_timeout() <= 5000


@contextlib.contextmanager
def write_slot_held(until, what):
    """Hold the write slot of SQLite database ``default`` from another connection until ``until()`` or the block ends.

    The connection lives on a thread of its own, which polls ``until`` (``what`` names it) and then
    rolls back.
    """
    held, done, failures = threading.Event(), threading.Event(), []

    def hold():
        other = sqlite3.connect(connections["default"].settings_dict["NAME"], isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            held.set()
            wait_until(lambda: done.is_set() or until(), 60, what)
            other.execute("ROLLBACK")
        except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
            failures.append(exc)
        finally:
            other.close()
            held.set()

    thread = threading.Thread(target=hold, name="write-slot-holder", daemon=True)
    thread.start()
    try:
        assert held.wait(30) and not failures, failures
        yield
    finally:
        done.set()
        thread.join(30)
    assert not thread.is_alive() and not failures, failures


def busy_tries(caplog):
    """The tries of blocking acquires that found the write slot busy and will try again, as logged."""
    return sum("trying again within the caller's timeout" in record.getMessage() for record in caplog.records)


def test_sqlite_blocking_acquire_waits_out_a_busy_write_slot_within_its_timeout(lock_name, settings, caplog):
    # Issue 16: another writer keeping the slot past one request's bound (REQUEST_TIMEOUT 0.5 s) is
    # contention, not an outage: the call tries again, as for a held lock, and gets the lock once the
    # slot is free, well within its own timeout.
    add_alias(settings, "sqlite_short", DATABASE="default", REQUEST_TIMEOUT=0.5)
    caplog.set_level(logging.INFO, logger="distlock.backends.database")
    with write_slot_held(until=lambda: busy_tries(caplog) >= 2, what="two tries finding the write slot busy"):
        lease = distlock.acquire(lock_name, ttl=30, timeout=30, using="sqlite_short")
    try:
        assert busy_tries(caplog) >= 2
        assert lease.attempts >= 3
        assert lease.remaining() > 20
    finally:
        assert lease.release() is True


def test_sqlite_blocking_acquire_raises_backend_unavailable_once_the_write_slot_outlives_its_timeout(
        lock_name, settings, caplog):
    add_alias(settings, "sqlite_short", DATABASE="default", REQUEST_TIMEOUT=0.5)
    caplog.set_level(logging.INFO, logger="distlock.backends.database")
    timeout = 1.5
    with write_slot_held(until=lambda: False, what="the end of the acquire"):
        started = time.monotonic()
        with pytest.raises(distlock.BackendUnavailable, match="stayed locked by another writer"):
            distlock.acquire(lock_name, ttl=5, timeout=timeout, using="sqlite_short")
        waited = time.monotonic() - started
    # Tried until its timeout ran out, then no longer than one more request (REQUEST_TIMEOUT) past it.
    assert busy_tries(caplog) >= 1
    assert timeout <= waited < timeout + 0.5 + 1.5
    distlock.acquire(lock_name, ttl=5, blocking=False, using="sqlite_short").release()


# -- the database's clock decides ------------------------------------------------------------------

def test_expiry_is_judged_by_the_database_clock(db_alias, lock_name):
    # The server says expired while the client's lease has 29 s left: the lock is free.
    first = distlock.acquire(lock_name, ttl=30, using=db_alias)
    move_expiry(db_alias, lock_name, -1)
    assert first.remaining() > 25
    second = distlock.acquire(lock_name, ttl=1, blocking=False, using=db_alias)
    assert second.token > first.token
    assert first.release() is False
    # The client's lease has run out while the server says held: the lock is not free.
    move_expiry(db_alias, lock_name, 3600)
    time.sleep(1.2)
    with pytest.raises(distlock.LockLost):
        second.check()
    with pytest.raises(distlock.LockNotAcquired):
        distlock.acquire(lock_name, blocking=False, using=db_alias)
    assert locks[db_alias].release_owned(lock_name, second.owner) is True


def _faketime_library():
    found = glob.glob("/usr/lib/*/faketime/libfaketime.so.1")
    if not found:
        pytest.skip("libfaketime is not installed (Debian package 'faketime')")
    return found[0]


def skewed_client(alias, name, ttl):
    """In a child process: try ``name`` once, print the outcome as JSON, hold it until stdin closes.

    It never sleeps: libfaketime 0.9.10 breaks ``time.sleep`` (EINVAL from clock_nanosleep).
    """
    try:
        lease = distlock.acquire(name, ttl=ttl, blocking=False, using=alias)
    except distlock.LockNotAcquired:
        print(json.dumps({"acquired": False}), flush=True)
        return
    print(json.dumps({"acquired": True, "token": lease.token, "owner": lease.owner}), flush=True)
    sys.stdin.read()


def start_skewed_client(offset, alias, name, ttl):
    """Start ``skewed_client`` in a process whose wall clock is shifted by ``offset``; return it and its report."""
    code = ("import django, sys; django.setup(); from tests.backends.test_database import skewed_client; "
            f"skewed_client({alias!r}, {name!r}, {ttl!r})")
    env = child_env(LD_PRELOAD=_faketime_library(), FAKETIME=offset, DONT_FAKE_MONOTONIC="1")
    process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    line = process.stdout.readline()
    if not line:
        raise AssertionError(f"skewed client failed: {process.communicate()[1][-4000:]}")
    return process, json.loads(line)


def test_client_wall_clocks_do_not_matter_on_postgresql(lock_name):
    alias = require_alias("postgres")
    # A holder whose clock is an hour behind: by its clock, its row would be expired on arrival.
    holder, held = start_skewed_client("-1h", alias, lock_name, ttl=30)
    try:
        assert held["acquired"]
        with pytest.raises(distlock.LockNotAcquired):
            distlock.acquire(lock_name, blocking=False, using=alias)
        (info,) = locks[alias].held_locks(lock_name)
        assert info.owner == held["owner"]
        assert 29 <= (info.expires_at - info.acquired_at).total_seconds() <= 31
    finally:
        holder.communicate("")
    assert locks[alias].release_owned(lock_name, held["owner"]) is True
    # A contender whose clock is an hour ahead: by its clock, our lock would have expired long ago.
    with distlock.lock(lock_name, ttl=30, using=alias):
        contender, outcome = start_skewed_client("+1h", alias, lock_name, ttl=30)
        contender.communicate("")
        assert outcome == {"acquired": False}


def test_sqlite_time_is_each_process_own_clock(lock_name):
    """Documented limit: SQLite computes 'now' in the calling process, so a process whose clock is off misjudges."""
    lease = distlock.acquire(lock_name, ttl=30, using="default")
    intruder, outcome = start_skewed_client("+1h", "default", lock_name, ttl=30)
    intruder.communicate("")
    assert outcome["acquired"] and outcome["token"] > lease.token
    assert lease.release() is False


# -- rows, listing, expiry ---------------------------------------------------------------------------

def test_releasing_an_expired_lock_reports_false_and_leaves_no_row(db_alias, lock_name):
    lease = distlock.acquire(lock_name, ttl=0.5, using=db_alias)
    time.sleep(1)
    assert lease.extend() is False
    assert lease.release() is False
    assert not Lock.objects.using(database_of(db_alias)).filter(name=lock_name).exists()


def test_held_locks_matches_the_prefix_exactly(db_alias, lock_name):
    names = [f"{lock_name}:Abc", f"{lock_name}:abc", f"{lock_name}:a_c", f"{lock_name}:a%c"]
    token = current_task_id.set("task-42")
    try:
        leases = [distlock.acquire(name, ttl=30, using=db_alias) for name in names]
    finally:
        current_task_id.reset(token)
    try:
        backend = locks[db_alias]
        # Not LIKE: '_' and '%' are plain characters, and case matters (SQLite's LIKE ignores it).
        assert {info.name for info in backend.held_locks(f"{lock_name}:a")} == set(names[1:])
        assert [info.name for info in backend.held_locks(f"{lock_name}:a_")] == [f"{lock_name}:a_c"]
        assert [info.name for info in backend.held_locks(f"{lock_name}:A")] == [f"{lock_name}:Abc"]
        info = backend.held_locks(names[0])[0]
        assert (info.token, info.owner, info.task_id) == (leases[0].token, leases[0].owner, "task-42")
        assert info.acquired_at.tzinfo is not None and info.expires_at.tzinfo is not None
        assert 29 <= (info.expires_at - info.acquired_at).total_seconds() <= 30.01
    finally:
        for lease in leases:
            lease.release()


def test_sqlite_tokens_do_not_go_backwards_when_the_sequence_row_is_lost(lock_name):
    with distlock.lock(lock_name, ttl=5, using="default") as before:
        pass
    with connections["default"].cursor() as cursor:
        cursor.execute("DELETE FROM distlock_tokensequence")
    with distlock.lock(lock_name, ttl=5, using="default") as after:
        assert after.token > before.token


# -- connections and failures ------------------------------------------------------------------------

def _other_connections_to(database):
    with connections[database].cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                       "AND pid <> pg_backend_pid()")
        return cursor.fetchone()[0]


def _wait_for(predicate, timeout=10):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def test_a_connection_cut_by_the_server_is_replaced_on_the_next_call(lock_name):
    alias = require_alias("postgres")
    distlock.acquire(lock_name, ttl=5, using=alias).release()
    with connections["postgres"].cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                       "WHERE datname = current_database() AND pid <> pg_backend_pid()")
    assert _wait_for(lambda: _other_connections_to("postgres") == 0)
    lease = distlock.acquire(lock_name, ttl=5, blocking=False, using=alias)
    assert lease.release() is True


def _backend_pid_after(barrier):
    """A step that reports its connection's server process once ``barrier`` lets every caller through."""
    def step(cursor, params):
        cursor.execute("SELECT pg_backend_pid()")
        (pid,) = cursor.fetchone()
        barrier.wait(10)
        return pid
    return step


def test_calls_at_once_use_connections_of_their_own_and_close_ends_them_all():
    alias = require_alias("postgres")
    assert _wait_for(lambda: _other_connections_to("postgres") == 0), "connections of earlier tests linger"
    backend = locks[alias]
    all_inside = threading.Barrier(3)
    pids = []
    step = _backend_pid_after(all_inside)
    threads = [threading.Thread(target=lambda: pids.append(backend._run(step, {}, operation=TEST_STATEMENT)))
               for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(pids)) == 3
    assert _other_connections_to("postgres") == 3  # given back to the pool, still open
    backend.close()
    assert _wait_for(lambda: _other_connections_to("postgres") == 0)


def test_connections_outlive_the_threads_that_used_them_and_serve_later_threads(lock_name):
    alias = require_alias("postgres")
    assert _wait_for(lambda: _other_connections_to("postgres") == 0), "connections of earlier tests linger"
    for i in range(20):
        thread = threading.Thread(target=lambda: distlock.acquire(f"{lock_name}:{i}", ttl=5, using=alias).release())
        thread.start()
        thread.join()
    assert _other_connections_to("postgres") == 1


def test_max_connections_bounds_the_calls_at_once_and_a_call_waits_within_its_bound(settings, lock_name):
    require_alias("postgres")
    add_alias(settings, "two_connections", DATABASE="postgres", MAX_CONNECTIONS=2)
    backend = locks["two_connections"]
    inside, leave = threading.Barrier(3), threading.Event()

    def hold_a_connection(cursor, params):
        cursor.execute("SELECT 1")
        inside.wait(10)
        leave.wait(10)

    holders = [threading.Thread(target=backend._run, args=(hold_a_connection, {}),
                                kwargs={"operation": TEST_STATEMENT}) for _ in range(2)]
    for holder in holders:
        holder.start()
    inside.wait(10)
    started = time.monotonic()
    with pytest.raises(BackendUnavailable, match=r"all 2 of this process's lock connections stayed busy .*"
                                                 r"\['two_connections'\]\['OPTIONS'\]\['MAX_CONNECTIONS'\]"):
        distlock.acquire(lock_name, ttl=5, timeout=1, using="two_connections")
    assert 1 <= time.monotonic() - started < 3
    # A call waiting for a connection gets the first one given back.
    waiter = threading.Thread(target=lambda: distlock.acquire(lock_name, ttl=5, timeout=10,
                                                             using="two_connections").release())
    waiter.start()
    leave.set()
    waiter.join()
    for holder in holders:
        holder.join()
    assert _other_connections_to("postgres") <= 2


def test_a_forked_child_never_touches_the_parent_s_connections():
    alias = require_alias("postgres")
    backend = locks[alias]
    backend_pid = lambda cursor, params: cursor.execute("SELECT pg_backend_pid()").fetchone()[0]  # noqa: E731
    parent_pid = backend._run(backend_pid, {}, operation=TEST_STATEMENT)
    pid = os.fork()
    if pid == 0:  # the child, with the parent's backend object and its idle connection
        try:
            child_pid = backend._run(backend_pid, {}, operation=TEST_STATEMENT)
            backend.close()
            os._exit(0 if child_pid != parent_pid else 3)
        finally:
            os._exit(1)
    deadline = time.monotonic() + 20
    while not (done := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert done[0] and os.waitstatus_to_exitcode(done[1]) == 0, "the child used the parent's connection"
    assert backend._run(backend_pid, {}, operation=TEST_STATEMENT) == parent_pid, \
        "the child closed the parent's connection"


@pytest.mark.slow
def test_tries_from_many_threads_neither_fail_with_errors_nor_starve_the_holder(db_alias, lock_name):
    """20 threads trying one name back to back: a failing try must not hold up the holder's release.

    Tries that queued for the write slot (SQLite) or for the name's guard (PostgreSQL) held their
    connection meanwhile, so a release could wait past its bound for a connection or the slot.
    """
    ends = time.monotonic() + 4
    grants, errors = [], []

    def try_back_to_back():
        while time.monotonic() < ends:
            try:
                lease = distlock.acquire(lock_name, ttl=10, blocking=False, using=db_alias)
            except distlock.LockNotAcquired:
                continue
            except distlock.BackendUnavailable as exc:
                errors.append(exc)
                continue
            time.sleep(0.003)  # the critical section
            grants.append(lease.token)
            if not lease.release():
                errors.append(f"release of token {lease.token} failed")

    threads = [threading.Thread(target=try_back_to_back) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, f"{len(errors)} errors, first: {errors[0]}"
    assert len(grants) >= 20, f"only {len(grants)} grants in 4 s"


@pytest.mark.slow
@pytest.mark.parametrize("library", ["gevent", "eventlet"])
def test_green_threads_each_get_a_connection_none_closed_under_another_and_the_count_stays_bounded(
        db_alias, library):
    """Green threads (gunicorn -k gevent, Celery --pool=gevent/eventlet): idents reused, not in enumerate()."""
    process = subprocess.run(
        [sys.executable, "-m", "tests.green_churn", library, db_alias, f"green:{uuid.uuid4().hex}"],
        capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=180,
    )
    assert process.returncode == 0, process.stderr[-4000:]
    report = json.loads(process.stdout.splitlines()[-1])
    assert report["errors"] == 0, "\n".join(report["first_errors"])
    assert report["overlaps"] == 0
    assert report["operations"] == 1 + 50 * 20
    # The backend's connections, its release listener (PostgreSQL), the parent test's own and this process's
    # Django connection.
    assert report["most_connections"] <= report["max_connections"] + 3


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_a_black_holed_postgresql_raises_backend_unavailable_within_the_timeout(lock_name, settings):
    require_alias("postgres")
    target = settings.DATABASES["postgres"]
    with FaultProxy(int(target["PORT"])) as proxy:
        settings.DATABASES = {**settings.DATABASES,
                              "postgres_proxied": {**target, "HOST": "127.0.0.1", "PORT": str(proxy.port)}}
        add_alias(settings, "proxied", DATABASE="postgres_proxied", REQUEST_TIMEOUT=2)
        lease = distlock.acquire(lock_name, ttl=30, using="proxied")
        proxy.blackhole()
        # A statement on an open connection: cut at REQUEST_TIMEOUT...
        started = time.monotonic()
        with pytest.raises(distlock.BackendUnavailable, match="did not answer within 2s"):
            lease.extend()
        assert 2 <= time.monotonic() - started < 3.5
        # ...a new connection: cut at the connect timeout (libpq's minimum is 2 s)...
        started = time.monotonic()
        with pytest.raises(distlock.BackendUnavailable, match="timeout"):
            distlock.acquire(f"{lock_name}:2", ttl=5, timeout=0.5, using="proxied")
        assert time.monotonic() - started < 4
        # ...and a statement on an open connection with a shorter caller's timeout: cut at that timeout.
        proxy.heal()
        locks["proxied"].ping()
        proxy.blackhole()
        started = time.monotonic()
        with pytest.raises(distlock.BackendUnavailable, match="did not answer within 1.5s"):
            distlock.acquire(f"{lock_name}:2", ttl=5, timeout=1.5, using="proxied")
        assert 1.5 <= time.monotonic() - started < 3
        proxy.heal()
        assert lease.release() is True


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_a_database_without_the_tables_says_to_migrate(settings, tmp_path):
    settings.DATABASES = {**settings.DATABASES, "empty": {"ENGINE": "django.db.backends.sqlite3",
                                                          "NAME": str(tmp_path / "empty.sqlite3")}}
    add_alias(settings, "unmigrated", DATABASE="empty")
    with pytest.raises(distlock.BackendUnavailable, match="run `manage.py migrate distlock --database empty`"):
        distlock.acquire("anything", ttl=5, using="unmigrated")


# -- configuration -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("options", "message"), [
    ({"DATABASE": "nope"}, r"'DATABASE'\] is 'nope', which is not in settings.DATABASES"),
    ({"DATABASE": 3}, r"'DATABASE'\] must be the alias of a database"),
    ({"REQUEST_TIMEOUT": 0}, r"'REQUEST_TIMEOUT'\] must be a finite number of seconds above zero"),
    ({"STATEMENT_TIMEOUT": 1, "REQUEST_TIMEOUT": 1},
     r"sets both 'REQUEST_TIMEOUT' and its old name 'STATEMENT_TIMEOUT'"),
    ({"DATABASE": "dummy"}, r"whose vendor is 'unknown'; the database backend supports PostgreSQL and SQLite"),
    ({"DATABASE": "memory"}, r"an in-memory SQLite database"),
])
@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_bad_options_are_refused_without_io(options, message, settings):
    settings.DATABASES = {**settings.DATABASES, "dummy": {"ENGINE": "django.db.backends.dummy"},
                          "memory": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
    with pytest.raises(ImproperlyConfigured, match=message):
        DatabaseBackend.clean_options("locks", options)


def test_an_sqlite_without_returning_is_refused(monkeypatch):
    monkeypatch.setattr(sqlite3, "sqlite_version_info", (3, 34, 1))
    with pytest.raises(ImproperlyConfigured, match="needs SQLite 3.35 or later"):
        DatabaseBackend.clean_options("locks", {})


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_options_of_a_server_that_is_down_are_accepted(settings):
    settings.DATABASES = {**settings.DATABASES, "down": {
        "ENGINE": "django.db.backends.postgresql", "HOST": "127.0.0.1", "PORT": "1", "NAME": "x"}}
    assert DatabaseBackend.clean_options("locks", {"DATABASE": "down"})["REQUEST_TIMEOUT"] == 5


def test_statement_timeout_the_old_name_of_request_timeout_still_works_and_warns(settings, lock_name):
    add_alias(settings, "old_name", DATABASE="default", STATEMENT_TIMEOUT=2)
    assert locks["old_name"].settings["REQUEST_TIMEOUT"] == 2
    distlock.acquire(lock_name, ttl=5, blocking=False, using="old_name").release()
    (warning,) = [message for message in check_distlock_setting() if "'old_name'" in message.msg]
    assert warning.id == W002
    assert "['STATEMENT_TIMEOUT'] is the old name of 'REQUEST_TIMEOUT'" in warning.msg


# -- interrupts (a time limit, gevent.Timeout) landing in the pool's and the statement timer's waits -----

class _FakeWrapper:
    """A connection wrapper as the pool sees it (pure logic: the pool never looks inside)."""

    def close(self):
        pass


class _SocketConnection:
    """A psycopg connection as the statement timer sees it: a socket, open or closed."""

    def __init__(self, sock):
        self.sock = sock

    @property
    def closed(self):
        return self.sock.fileno() == -1

    def fileno(self):
        return self.sock.fileno()


class _SocketWrapper:
    """A PostgreSQL connection wrapper as the statement timer and ``disconnect`` see it."""

    Database = types.SimpleNamespace(Error=ConnectionError)

    def __init__(self, sock):
        self.connection = _SocketConnection(sock)

    def close(self):
        self.connection.sock.close()


def _cut_off(sock, timeout):
    """True once the other end of ``sock``'s pair was shut down (reads end of file) within ``timeout``."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False


def _unavailable(waited):
    return BackendUnavailable(f"busy after {waited:.2f}s")


def test_a_call_interrupted_while_it_waits_for_a_connection_leaves_the_pool_whole():
    # Before: a turn of an interrupted call stayed queued and took the next connection given back,
    # so the pool shrank by one connection for good per interrupt, and Condition.wait could raise
    # RuntimeError in place of the interrupt.
    def make():
        pool = ConnectionPool(_FakeWrapper, _FakeWrapper.close, 1)
        held = pool._check_out(time.monotonic() + 1, _unavailable, False)

        def notify():
            pool._give_back(held)
            again = pool._check_out(time.monotonic() + 1, _unavailable, False)  # the connection is not lost
            pool._give_back(again)

        return (lambda: pool._check_out(time.monotonic() + 0.05, _unavailable, False)), notify

    assert lines_that_break(make) == []


def test_a_call_interrupted_in_the_statement_timer_never_stalls_the_others():
    # Before: the watchdog's Condition could be left held by an interrupted call, and then every later
    # call of the alias (and the watchdog's thread) waited for it forever.
    reader, writer = socket.socketpair()
    dialects = []
    try:
        def make():
            dialect = DIALECTS["postgresql"]()
            dialects.append(dialect)
            with dialect.watch(_SocketWrapper(reader), time.monotonic() + 30):
                pass  # its thread runs: starting a thread is not what is tested here

            def wait():
                with dialect.watch(_SocketWrapper(reader), time.monotonic() + 30):
                    pass

            def notify():
                ours, theirs = socket.socketpair()
                try:
                    with dialect.watch(_SocketWrapper(ours), time.monotonic() + 0.05) as watch:
                        assert _cut_off(theirs, 1), "the timer did not cut off a statement past its bound"
                    assert watch.severed
                finally:
                    ours.close()
                    theirs.close()

            return wait, notify

        assert lines_that_break(make) == []
    finally:
        for dialect in dialects:
            dialect.close()
        reader.close()
        writer.close()


def test_the_statement_timer_never_cuts_off_a_connection_after_its_statement_ended():
    dialect = DIALECTS["postgresql"]()
    ours, theirs = socket.socketpair()
    armed, armed_peer = socket.socketpair()
    try:
        with dialect.watch(_SocketWrapper(ours), time.monotonic() + 0.05) as watch:
            pass
        # An interrupt that skipped a watch's exit leaves its deadline set; the call then closes the
        # connection, and disconnect() disarms it first: the descriptor, reused, is another call's.
        left_armed = _SocketWrapper(armed)
        dialect.watch(left_armed, time.monotonic() + 0.05).__enter__()
        dialect.disconnect(left_armed)
        assert len(dialect.timer) == 0
        reused, reused_peer = socket.socketpair()
        try:
            assert not _cut_off(theirs, 0.3) and not _cut_off(reused_peer, 0.1)
            assert not watch.severed
            ours.sendall(b"x")
            assert theirs.recv(1) == b"x"
        finally:
            reused.close()
            reused_peer.close()
    finally:
        dialect.close()
        for sock in (ours, theirs, armed, armed_peer):
            sock.close()


@pytest.mark.parametrize("call", ["acquire", "release", "extend"])
def test_an_sqlite_call_interrupted_anywhere_leaves_the_write_slot_free(lock_name, call):
    # Before: an interrupt between a release's or an extend's execute() and its fetchone() left the
    # DELETE/UPDATE ... RETURNING unfinished, holding the write slot even after the pool closed the
    # connection, for as long as the interrupt's traceback kept the cursor (a time-limit storm, scenario 12).
    backend = locks["default"]
    names = (f"{lock_name}:{n}" for n in range(100_000))

    def make():
        name = next(names)
        lease = None if call == "acquire" else backend.acquire(name, ttl=5, timeout=0, blocking=False)
        interrupted = {
            "acquire": lambda: backend.acquire(name, ttl=5, timeout=0, blocking=False),
            "release": lambda: backend.release(lease),
            "extend": lambda: backend.extend(lease, 5),
        }[call]

        def notify():
            after = backend.acquire(f"{name}:after", ttl=5, timeout=0, blocking=False)
            assert after is not None and backend.release(after)

        return interrupted, notify

    assert lines_that_break(make, most=3000) == []


def test_auto_renewed_leases_on_django_s_in_memory_sqlite_test_database_lose_nothing():
    """Django's SQLite test database without a NAME is in memory with a shared cache, whose table locks do not
    wait in busy_timeout (was: hundreds of "database table is locked" errors, renewals failing and leases
    lost within seconds, and the test's own ORM writes failing the same way). Leases with ttl 1 s and
    auto_renew beside 4 threads of other locks and one of ORM writes, then a lock inside atomic() (was:
    LockWouldDeadlock), past a metrics flush interval (a background flush made the ORM writes fail too): 20 s,
    past the default FLUSH_INTERVAL (10 s), with DISTLOCK_FAULTS_LONG=1; 5 s in ``make test``, its time budget,
    with FLUSH_INTERVAL set to 1 s in the child: past four intervals (a thread that flushed there failed the ORM
    writes in every run tried, more surely than the one interval of 12 s did)."""
    arguments = ["20"] if LONG else ["5", "1"]  # SECONDS [FLUSH_INTERVAL]
    process = subprocess.run([sys.executable, "-m", "tests.shared_cache_sqlite", *arguments], capture_output=True,
                             text=True, cwd=ROOT, timeout=float(arguments[0]) + 120, check=False)
    report = f"exit {process.returncode}\n{process.stdout[-3000:]}\n{process.stderr[-3000:]}"
    assert process.returncode == 0, report
    outcome = json.loads(process.stdout.splitlines()[-1])
    assert outcome["lost"] == [] and outcome["error_count"] == 0 and outcome["turns"] > 0, report
    assert outcome["orm_error_count"] == 0 and outcome["rows"] > 0, report


@pytest.mark.parametrize("library", ["gevent", "eventlet"])
def test_sqlite_lock_calls_in_a_loop_let_other_green_threads_run(library):
    """SQLite's calls never yield to the hub: a green thread try-locking in a loop starved every other one, a
    time limit's timer and renewals included (was: no tick of the other green thread until the loop ended)."""
    process = subprocess.run([sys.executable, "-m", "tests.green_sqlite_loop", library], capture_output=True,
                             text=True, env=child_env(), cwd=ROOT, timeout=120, check=False)
    assert process.returncode == 0, process.stderr[-4000:]
    report = json.loads(process.stdout.splitlines()[-1])
    assert report["calls"] > 0 and report["ticks_while_looping"] >= 20, report
