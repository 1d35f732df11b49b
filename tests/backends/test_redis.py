"""What the Redis backend promises beyond the contract: tokens across restarts, fair hand-off, the queue, options."""

import importlib.metadata
import json
import os
import re
import signal
import threading
import time
import tomllib
from collections import Counter
from pathlib import Path

import pytest
import redis
from django.core.cache import caches
from django.core.exceptions import ImproperlyConfigured
from django_redis import get_redis_connection
from packaging.requirements import Requirement

import distlock
from distlock.backends import redis as redis_backend
from distlock.backends.redis import WAITER_TTL, RedisBackend
from distlock.checks import check_distlock_setting
from distlock.handler import locks
from distlock.holder import current_task_id
from tests.conftest import require_alias
from tests.servers import wait_until
from tests.servers.redis import RedisServer
from tests.workers import spawn

#: The default database alone (the metrics recorder's and the worker processes'): the locks live in Redis,
#: and emptying PostgreSQL and the locks database after each test took 0.1–0.2 s a test.
pytestmark = pytest.mark.django_db(transaction=True, databases=["default"])

PREFIX = "distlock-own"


@pytest.fixture(scope="module")
def own_server():
    """A private redis-server without persistence, for tests that restart, pause or inspect it."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def own_alias(own_server, settings):
    """The alias 'own' on the private server, emptied before the test."""
    redis.Redis.from_url(own_server.url).flushall()
    settings.DISTLOCK = {**settings.DISTLOCK, "own": {
        "BACKEND": "distlock.backends.redis.RedisBackend",
        "OPTIONS": {"URL": own_server.url, "KEY_PREFIX": PREFIX, "REQUEST_TIMEOUT": 1}}}
    return "own"


@pytest.fixture
def own_client(own_server):
    client = redis.Redis.from_url(own_server.url)
    yield client
    client.close()
    client.connection_pool.disconnect()  # redis-py before 5 leaves the pool open


def queue_length(client, name):
    return client.zcard(f"{PREFIX}:queue:{name}")


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout}s"
        time.sleep(0.01)


# -- fencing tokens ---------------------------------------------------------------------------------

def test_token_never_goes_backwards_after_a_restart_without_persistence(own_server, own_alias, own_client):
    tokens = []
    for _ in range(3):
        with distlock.lock("restart", ttl=10, using=own_alias) as lease:
            tokens.append(lease.token)
    assert own_client.get(f"{PREFIX}:token") is not None

    own_server.restart()
    fresh = redis.Redis.from_url(own_server.url)
    assert fresh.dbsize() == 0, "the server must come back empty: counter and locks forgotten"
    fresh.close()
    fresh.connection_pool.disconnect()  # redis-py before 5 leaves the pool open

    # The backend's pooled connections died with the server, and the server forgot the scripts:
    # the next acquire reconnects and reloads them without reporting the server down.
    with distlock.lock("restart", ttl=10, using=own_alias) as lease:
        assert lease.token > max(tokens)
        assert lease.token_is_safe
    with distlock.lock("another-name", ttl=10, using=own_alias) as later:
        assert later.token > lease.token


def test_token_follows_the_counter_when_it_runs_ahead_of_the_clock(own_alias, own_client):
    ahead = int(time.time() * 1e6) + 10**12  # an alias that issued more tokens than microseconds passed
    own_client.set(f"{PREFIX}:token", ahead)
    with distlock.lock("ahead", ttl=10, using=own_alias) as lease:
        assert lease.token == ahead + 1


# -- fair hand-off ----------------------------------------------------------------------------------

def test_a_releaser_that_comes_straight_back_queues_behind_the_waiter(settings):
    alias = require_alias("redis")  # the child process knows only the aliases of tests/settings.py
    options = settings.DISTLOCK[alias]["OPTIONS"]
    client = redis.Redis.from_url(options["URL"])
    name = f"handoff:{time.monotonic_ns()}"
    first = distlock.acquire(name, ttl=30, using=alias)
    child = spawn("hold", alias=alias, name=name, ttl=1)  # takes the lock when it can, holds it until its ttl
    try:
        wait_for(lambda: client.zcard(f"{options['KEY_PREFIX']}:queue:{name}") == 1 or child.poll() is not None,
                 30, "the child process queueing")
        # Freeze the waiter so that no race decides the outcome: it cannot take the lock before we try.
        child.send_signal(signal.SIGSTOP)
        first.release()
        with pytest.raises(distlock.LockNotAcquired):
            distlock.acquire(name, ttl=10, blocking=False, using=alias)  # the free lock is kept for the waiter
        child.send_signal(signal.SIGCONT)
        with distlock.lock(name, ttl=10, timeout=15, using=alias) as again:  # queues behind the waiter
            pass
        child_token = json.loads(child.stdout.readline())["token"]
        assert first.token < child_token < again.token, "the waiter must get the lock before the releaser"
    finally:
        child.send_signal(signal.SIGCONT)
        if child.poll() is None:
            child.kill()
        child.communicate()
        client.close()
        client.connection_pool.disconnect()  # redis-py before 5 leaves the pool open


def test_four_contenders_take_turns(own_alias):
    """No starvation: four threads hammering one key share it equally and hand it on nearly every time."""
    count, events, barrier = 100, [], threading.Barrier(4)

    def contender(index):
        barrier.wait()
        for _ in range(count):
            with distlock.lock("turns", ttl=30, timeout=60, using=own_alias):
                events.append((time.monotonic_ns(), index))
                time.sleep(0.001)

    threads = [threading.Thread(target=contender, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    events.sort()
    # Only the stretch in which all four compete says anything about fairness: up to the first one's last turn.
    end = min(max(at for at, who in events if who == index) for index in range(4))
    window = [who for at, who in events if at <= end]
    counts = Counter(window)
    jain = sum(counts.values()) ** 2 / (4 * sum(n * n for n in counts.values()))
    handoffs = sum(1 for before, after in zip(window, window[1:]) if before != after)
    assert len(window) >= 3 * count, f"one contender finished after {len(window)} of {4 * count} turns"
    assert jain >= 0.95, counts
    assert handoffs >= 0.9 * (len(window) - 1), f"{handoffs} hand-offs in {len(window)} turns"


# -- waking ------------------------------------------------------------------------------------------

def test_waiter_is_woken_by_the_release_at_once(own_alias, own_client):
    holder = distlock.acquire("wake", ttl=30, using=own_alias)
    released_at = []
    timer = threading.Timer(0.5, lambda: (released_at.append(time.monotonic()), holder.release()))
    own_client.config_resetstat()
    timer.start()
    with distlock.lock("wake", ttl=10, timeout=10, using=own_alias):
        woke_at = time.monotonic()
    timer.join()
    (released,) = released_at
    # Timed from the release, not from the timer's start: a timer thread that runs late is no slow wake-up.
    assert released <= woke_at < released + 0.3
    attempts = own_client.info("commandstats")["cmdstat_evalsha"]["calls"]
    assert attempts <= 6, f"{attempts} scripts ran while waiting half a second: the waiter is polling"


def test_waiter_is_woken_when_the_holder_ttl_runs_out(own_alias, own_client):
    holder = distlock.acquire("expire", ttl=1.2, using=own_alias)  # never released: its owner "died"
    own_client.config_resetstat()
    started = time.monotonic()
    with distlock.lock("expire", ttl=10, timeout=10, using=own_alias) as lease:
        waited = time.monotonic() - started
        assert holder.lost, "the waiter got the lock before the holder's ttl ran out"
        assert lease.token > holder.token
    assert waited < 1.2 + 0.3
    attempts = own_client.info("commandstats")["cmdstat_evalsha"]["calls"]
    assert attempts <= 6, f"{attempts} attempts while waiting 1.2s: the waiter is polling"


def test_waiter_wakes_within_the_holder_ttl_not_its_refresh_period(own_alias):
    holder = distlock.acquire("expire-soon", ttl=0.3, using=own_alias)
    started = time.monotonic()
    with distlock.lock("expire-soon", ttl=10, timeout=10, using=own_alias):
        waited = time.monotonic() - started
    assert waited < 0.3 + 0.25, f"woke {waited:.3f}s after a 0.3s holder"
    assert holder.lost


# -- the queue ----------------------------------------------------------------------------------------

def test_a_waiter_that_times_out_leaves_the_queue_at_once(own_alias, own_client):
    holder = distlock.acquire("timeout", ttl=30, using=own_alias)
    with pytest.raises(distlock.LockNotAcquired):
        distlock.acquire("timeout", ttl=10, timeout=0.3, using=own_alias)
    assert queue_length(own_client, "timeout") == 0
    holder.release()
    distlock.acquire("timeout", ttl=10, blocking=False, using=own_alias).release()


def test_queue_entry_of_a_dead_waiter_stops_blocking_after_it_expires(settings):
    alias = require_alias("redis")  # the child process knows only the aliases of tests/settings.py
    options = settings.DISTLOCK[alias]["OPTIONS"]
    client = redis.Redis.from_url(options["URL"])
    name = f"dead-waiter:{time.monotonic_ns()}"
    queue = f"{options['KEY_PREFIX']}:queue:{name}"
    holder = distlock.acquire(name, ttl=30, using=alias)
    child = spawn("hold", alias=alias, name=name, ttl=30)
    try:
        wait_for(lambda: client.zcard(queue) == 1 or child.poll() is not None, 30, "the child process queueing")
        assert child.poll() is None, child.communicate()[1][-2000:]
        child.send_signal(signal.SIGKILL)
        child.wait()
        killed_at = time.monotonic()
        holder.release()
        # The dead waiter heads the queue: the free lock is kept for it until its entry expires ...
        with pytest.raises(distlock.LockNotAcquired):
            distlock.acquire(name, ttl=10, blocking=False, using=alias)
        # ... within WAITER_TTL of its last refresh; then a blocking waiter gets the lock.
        with distlock.lock(name, ttl=10, timeout=WAITER_TTL + 5, using=alias):
            waited = time.monotonic() - killed_at
        assert waited < WAITER_TTL + 1.0
        assert client.exists(queue) == 0
    finally:
        if child.poll() is None:
            child.kill()
        child.communicate()
        client.close()
        client.connection_pool.disconnect()  # redis-py before 5 leaves the pool open


# -- listing ------------------------------------------------------------------------------------------

def test_held_locks_scans_and_matches_the_prefix_literally(own_alias, own_client):
    backend = locks[own_alias]
    names = [f"many:{i}" for i in range(1200)]  # more than one SCAN page
    odd = ["glob*:a", "glob?:b", "glob[x]:c", "glob\\:d", "日本:e"]
    token = current_task_id.set("task-42")
    try:
        leases = [distlock.acquire(name, ttl=30, using=own_alias) for name in names + odd]
    finally:
        current_task_id.reset(token)
    own_client.config_resetstat()
    try:
        listed = backend.held_locks("many:")
        assert sorted(info.name for info in listed) == sorted(names)
        assert sorted(info.name for info in backend.held_locks("glob")) == sorted(odd[:4])
        assert [info.name for info in backend.held_locks("glob*")] == ["glob*:a"]
        assert [info.name for info in backend.held_locks("glob?")] == ["glob?:b"]
        assert [info.name for info in backend.held_locks("glob[x]")] == ["glob[x]:c"]
        assert [info.name for info in backend.held_locks("glob\\")] == ["glob\\:d"]
        (info,) = backend.held_locks("日本")
        lease = leases[-1]
        assert (info.owner, info.token, info.pid, info.task_id) == (lease.owner, lease.token, os.getpid(), "task-42")
        assert info.expires_at > info.acquired_at
        stats = own_client.info("commandstats")
        assert "cmdstat_keys" not in stats and stats["cmdstat_scan"]["calls"] >= 3
    finally:
        for lease in leases:
            lease.release()
    assert backend.held_locks("many:") == []


def test_a_cursor_no_scan_gave_is_refused_before_any_io(own_alias, own_client):
    own_client.config_resetstat()
    for cursor in ("next", "-1", "+5", " 5", "５", str(2**64)):
        with pytest.raises(ValueError, match="no page's"):
            locks[own_alias].held_locks("", limit=5, cursor=cursor)
    assert "cmdstat_scan" not in own_client.info("commandstats")
    assert locks[own_alias].held_locks("", cursor=str(2**64 - 1)).cursor is None, "the largest is SCAN's to judge"


# -- connections and errors -------------------------------------------------------------------------

def test_cache_option_reuses_the_django_redis_pool(lock_name, monkeypatch):
    alias = require_alias("redis_cache")
    backend = locks[alias]
    cache_client = get_redis_connection(backend.settings["CACHE"])
    pool = cache_client.connection_pool
    assert backend.pool is pool
    returned = []
    release = pool.release
    monkeypatch.setattr(pool, "release", lambda connection: (returned.append(connection), release(connection)))
    with distlock.lock(lock_name, ttl=10, using=alias):
        key = f"{backend.settings['KEY_PREFIX']}:lock:{lock_name}"
        assert cache_client.exists(key) == 1, "the lock must live on the cache's server, under KEY_PREFIX"
    assert returned, "the backend's connections come from the cache's pool, and go back to it"
    backend.close()
    assert cache_client.ping(), "closing the backend must leave the cache's pool usable"


def test_a_cache_alias_gives_every_connection_back_to_the_cache_pool(own_server, settings):
    """The cache's pool is shared: a connection distlock keeps is one the cache can no longer have."""
    url = own_server.url.rsplit("/", 1)[0] + "/7"  # django-redis keeps one pool per URL per process: this test's own
    settings.CACHES = {**settings.CACHES, "small": {
        "BACKEND": "django_redis.cache.RedisCache", "LOCATION": url,
        "OPTIONS": {"CONNECTION_POOL_KWARGS": {"max_connections": 1}}}}
    settings.DISTLOCK = {**settings.DISTLOCK, "small": {
        "BACKEND": "distlock.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "small", "KEY_PREFIX": PREFIX}}}
    try:
        with distlock.lock("shared-pool", ttl=10, using="small"):
            caches["small"].set("during", 1)  # the call is over: its connection is back in the pool
        caches["small"].set("after", 1)
        assert caches["small"].get("after") == 1
        assert not get_redis_connection("small").connection_pool._in_use_connections
    finally:
        locks["small"].close()
        get_redis_connection("small").connection_pool.disconnect()


def test_the_idle_connections_of_an_alias_are_bounded(own_alias, own_client):
    """A burst of waiters, each blocked on a connection of its own, leaves at most MAX_IDLE connections idle."""
    backend = locks[own_alias]
    holder = distlock.acquire("burst", ttl=30, using=own_alias)
    waiters = redis_backend.MAX_IDLE + 8

    def wait_for_a_turn():
        with distlock.lock("burst", ttl=10, timeout=30, using=own_alias):
            pass

    threads = [threading.Thread(target=wait_for_a_turn) for _ in range(waiters)]
    for thread in threads:
        thread.start()
    wait_for(lambda: queue_length(own_client, "burst") == waiters, 10, "every waiter queueing")
    holder.release()
    for thread in threads:
        thread.join()
    connections = backend._get_connections()
    assert len(connections._idle) <= redis_backend.MAX_IDLE
    assert len(connections.pool._in_use_connections) <= redis_backend.MAX_IDLE, "the others went back to the pool"
    distlock.acquire("burst", ttl=10, blocking=False, using=own_alias).release()


def test_frozen_server_gives_backend_unavailable_within_the_timeout(own_server, own_alias):
    distlock.acquire("frozen", ttl=1, using=own_alias).release()  # a pooled connection exists
    own_server.pause()
    try:
        for timeout in (0.5, 1.5):
            started = time.monotonic()
            with pytest.raises(distlock.BackendUnavailable, match="own"):
                distlock.acquire("frozen", ttl=1, timeout=timeout, using=own_alias)
            assert time.monotonic() - started < timeout + 0.5
        started = time.monotonic()
        with pytest.raises(distlock.BackendUnavailable):
            distlock.acquire("frozen", ttl=1, blocking=False, using=own_alias)
        assert time.monotonic() - started < 1 + 0.5, "a non-blocking try waits at most REQUEST_TIMEOUT"
    finally:
        own_server.resume()
    # The requests that timed out still run when the server resumes: their grants, which nobody
    # holds, free the lock when their ttl runs out.
    distlock.acquire("frozen", ttl=1, timeout=1 + WAITER_TTL + 2, using=own_alias).release()


def test_a_waiting_acquire_reports_a_server_frozen_meanwhile(own_server, own_alias, own_client):
    holder = distlock.acquire("frozen-wait", ttl=30, using=own_alias)

    def pause_once_queued():
        wait_until(lambda: queue_length(own_client, "frozen-wait") == 1, 10, "the waiter queueing")
        own_server.pause()

    pauser = threading.Thread(target=pause_once_queued)
    pauser.start()
    try:
        started = time.monotonic()
        with pytest.raises(distlock.BackendUnavailable):
            distlock.acquire("frozen-wait", ttl=10, timeout=2, using=own_alias)
        assert time.monotonic() - started < 2 + 0.5
    finally:
        pauser.join()
        own_server.resume()
    holder.release()


def test_a_grant_that_answers_after_its_ttl_is_dropped_not_returned(own_server, own_alias, own_client):
    distlock.acquire("late", ttl=1, using=own_alias).release()  # a pooled connection exists
    own_client.config_resetstat()
    own_server.pause()
    timer = threading.Timer(0.6, own_server.resume)
    timer.start()
    try:
        # The request reaches a frozen server; its grant comes back after the 0.3 s ttl ran out, when
        # the server may already have handed the lock on. It must not come back as a valid lease.
        lease = distlock.acquire("late", ttl=0.3, timeout=5, using=own_alias)
    finally:
        timer.join()
    assert not lease.lost and lease.remaining() > 0.1
    stats = own_client.info("commandstats")["cmdstat_evalsha"]["calls"]
    assert stats >= 3, "expected the late grant to be released and the lock taken again"
    lease.release()


def test_server_errors_that_make_it_unusable_are_backend_unavailable(own_alias, own_client):
    own_client.config_set("maxmemory", "1")  # every write is refused with OOM
    try:
        with pytest.raises(distlock.BackendUnavailable, match="OOM"):
            distlock.acquire("oom", ttl=10, blocking=False, using=own_alias)
    finally:
        own_client.config_set("maxmemory", "0")


def test_a_foreign_key_under_the_prefix_is_a_clear_runtime_error(own_alias, own_client):
    own_client.hset(f"{PREFIX}:lock:foreign", "field", "value")
    with pytest.raises(RuntimeError, match="KEY_PREFIX"):
        distlock.acquire("foreign", ttl=10, blocking=False, using=own_alias)


def test_held_locks_skips_a_foreign_key_and_later_calls_read_their_own_replies(own_alias, own_client):
    """A Redlock alias on the same server and prefix keeps hashes under <prefix>:lock: (WRONGTYPE for GET)."""
    own_client.hset(f"{PREFIX}:lock:redlock-hash", "owner", "someone")
    assert distlock.locks[own_alias].held_locks() == []
    holder = distlock.acquire("a", ttl=10, blocking=False, using=own_alias)
    with pytest.raises(distlock.LockNotAcquired):
        distlock.acquire("a", ttl=10, blocking=False, using=own_alias)
    assert [info.name for info in distlock.locks[own_alias].held_locks()] == ["a"]
    assert holder.release() is True


class Interrupt(BaseException):
    """What a signal handler raises between two lines (Celery's soft time limit, KeyboardInterrupt)."""


def test_an_interrupt_between_send_and_read_never_hands_a_reply_to_the_next_call(own_alias, monkeypatch):
    held = distlock.acquire("held", ttl=10, blocking=False, using=own_alias)
    read_response = redis.connection.Connection.read_response
    interrupts = iter([True])

    def interrupted_once(connection, *args, **kwargs):
        if next(interrupts, False):
            raise Interrupt  # the request was sent; its reply (a grant of "free") stays unread
        return read_response(connection, *args, **kwargs)

    monkeypatch.setattr(redis.connection.Connection, "read_response", interrupted_once)
    with pytest.raises(Interrupt):
        distlock.acquire("free", ttl=10, blocking=False, using=own_alias)
    # "held" is held by another owner: the server refuses, whatever reply was left on the connection.
    with pytest.raises(distlock.LockNotAcquired):
        distlock.acquire("held", ttl=10, blocking=False, using=own_alias)
    assert held.release() is True


# -- redis-py release lines (scripts/redis-py-lines runs this file under each) -----------------------

def test_the_installed_redis_py_is_one_the_package_accepts():
    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (requirement,) = [Requirement(spec) for spec in extras["redis"] if Requirement(spec).name == "redis"]
    assert requirement.specifier.contains(importlib.metadata.version("redis"), prereleases=True)


def test_a_read_is_bounded_by_the_request_bound_below_the_socket_timeout(own_server, own_alias):
    connections = locks[own_alias]._get_connections()  # REQUEST_TIMEOUT 1: the sockets' timeout
    assert connections.exchange([("PING",)], 0.5) in ([b"PONG"], ["PONG"], [True])
    (idle,) = connections._idle
    assert idle._sock.gettimeout() == 1, "the socket's own timeout is put back after a shorter read"
    own_server.pause()
    try:
        started = time.monotonic()
        with pytest.raises(redis.TimeoutError):
            connections.exchange([("PING",)], 0.2)
        assert time.monotonic() - started < 0.7
    finally:
        own_server.resume()
    assert connections.exchange([("PING",)], 0.5) in ([b"PONG"], ["PONG"], [True])


# -- TLS and ACL users ----------------------------------------------------------------------------------

TLS_PREFIX = "distlock-tls"
TLS_PASSWORD = "tls-Secret-4711"


@pytest.fixture(scope="module")
def tls_server():
    """A private TLS-only redis-server that requires client certificates, with an ACL user for the locks."""
    with RedisServer(tls=True, password="admin-Secret-1",
                     users={"locks": (TLS_PASSWORD, f"~{TLS_PREFIX}:* +@all")}) as server:
        yield server


def tls_alias(settings, url, name="tls"):
    settings.DISTLOCK = {**settings.DISTLOCK, name: {
        "BACKEND": "distlock.backends.redis.RedisBackend",
        "OPTIONS": {"URL": url, "KEY_PREFIX": TLS_PREFIX, "REQUEST_TIMEOUT": 1, "SOCKET_CONNECT_TIMEOUT": 1}}}
    return name


def test_tls_with_an_acl_user_round_trip(tls_server, settings):
    alias = tls_alias(settings, tls_server.url_for("locks", TLS_PASSWORD))
    assert RedisBackend.security_warnings(alias, RedisBackend.clean_options(alias, settings.DISTLOCK[alias]["OPTIONS"])) == []
    lease = distlock.acquire("tls", ttl=10, using=alias)
    with pytest.raises(distlock.LockNotAcquired):
        distlock.acquire("tls", ttl=10, timeout=0.2, using=alias)  # waits (BLPOP) over TLS, then leaves the queue
    assert [info.name for info in locks[alias].held_locks()] == ["tls"]
    admin = redis.Redis.from_url(tls_server.url)
    try:
        clients = admin.client_list()
        assert any(client["user"] == "locks" for client in clients), "the backend connects as the ACL user"
        assert admin.get(f"{TLS_PREFIX}:lock:tls") is not None
    finally:
        admin.close()
        admin.connection_pool.disconnect()  # redis-py before 5 leaves the pool open
    assert lease.release() is True
    distlock.acquire("tls", ttl=10, blocking=False, using=alias).release()


def test_a_wrong_password_is_backend_unavailable_without_the_password(tls_server, settings):
    alias = tls_alias(settings, tls_server.url_for("locks", "Wrong-Pass-0815"), name="tls-wrong")
    with pytest.raises(distlock.BackendUnavailable, match="tls-wrong") as excinfo:
        distlock.acquire("tls", ttl=10, blocking=False, using=alias)
    message = str(excinfo.value)
    assert "Wrong-Pass-0815" not in message and "invalid username-password" in message
    assert "Wrong-Pass-0815" not in repr(excinfo.value.__cause__ or "")


def test_plain_tcp_against_the_tls_port_fails_clearly(tls_server, settings):
    url = tls_server.url_for("locks", TLS_PASSWORD, tls_parameters=False).replace("rediss://", "redis://")
    alias = tls_alias(settings, url, name="tls-plain")
    started = time.monotonic()
    with pytest.raises(distlock.BackendUnavailable, match="use a rediss:// URL") as excinfo:
        distlock.acquire("tls", ttl=10, blocking=False, using=alias)
    assert time.monotonic() - started < 2.5
    assert TLS_PASSWORD not in str(excinfo.value)


@pytest.mark.parametrize(("url", "message"), [
    ("redis://127.0.0.1:1/0?ssl_ca_certs=/ca.crt", "ssl_ca_certs but is not a rediss:// URL"),
    ("rediss://127.0.0.1:1/0?ssl_cert_reqs=yes", "ssl_cert_reqs='yes'"),
])
def test_tls_parameters_that_cannot_work_are_refused_without_io(url, message):
    with pytest.raises(ImproperlyConfigured, match=message):
        RedisBackend.clean_options("mine", {"URL": url})


@pytest.mark.parametrize(("url", "warned"), [
    ("redis://127.0.0.1:6379/0", True),
    ("redis://user@127.0.0.1:6379/0", True),  # a user name alone is no password
    ("redis://:secret@127.0.0.1:6379/0", False),
    ("redis://locks:secret@127.0.0.1:6379/0", False),
    ("redis://127.0.0.1:6379/0?password=secret", False),
    ("rediss://127.0.0.1:6379/0?ssl_ca_certs=/ca.crt", False),
    ("unix:///run/redis.sock", False),
])
def test_security_warnings_name_a_server_reached_without_tls_or_password(url, warned):
    warnings = RedisBackend.security_warnings("mine", RedisBackend.clean_options("mine", {"URL": url}))
    assert len(warnings) == warned
    for warning in warnings:
        assert "neither TLS nor a password" in warning and "rediss://" in warning
        assert "secret" not in warning


def test_security_warnings_read_the_cache_of_a_cache_alias(settings):
    settings.CACHES = {**settings.CACHES,
                       "open": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": "redis://10.0.0.1:6379/1"},
                       "closed": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": "redis://10.0.0.1:6379/2",
                                  "OPTIONS": {"PASSWORD": "secret"}}}
    (warning,) = RedisBackend.security_warnings("mine", RedisBackend.clean_options("mine", {"CACHE": "open"}))
    assert "10.0.0.1:6379, db 1" in warning
    assert RedisBackend.security_warnings("mine", RedisBackend.clean_options("mine", {"CACHE": "closed"})) == []


def test_the_system_check_warns_about_an_open_alias_with_debug_off(settings):
    settings.DEBUG = False
    settings.DISTLOCK = {**settings.DISTLOCK,
                         "open": {"BACKEND": "distlock.backends.redis.RedisBackend",
                                  "OPTIONS": {"URL": "redis://10.0.0.1:6379/0", "KEY_PREFIX": "open"}},
                         "closed": {"BACKEND": "distlock.backends.redis.RedisBackend",
                                    "OPTIONS": {"URL": "rediss://u:p@10.0.0.1:6379/0", "KEY_PREFIX": "closed"}}}
    warnings = [error for error in check_distlock_setting() if error.id == "distlock.W001"]
    assert [re.match(r"DISTLOCK\['(\w+)'\]", warning.msg)[1] for warning in warnings if "10.0.0.1" in warning.msg] == ["open"]


# -- options --------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("options", "message"), [
    ({}, "exactly one of 'URL'"),
    ({"URL": "redis://127.0.0.1:1/0", "CACHE": "redis"}, "exactly one of 'URL'"),
    ({"URL": "http://127.0.0.1:1/"}, r"\['URL'\] is not a redis://"),
    ({"URL": "redis://127.0.0.1:1/0", "REQUEST_TIMEOUT": 0}, r"\['REQUEST_TIMEOUT'\] must be a finite"),
    ({"URL": "redis://127.0.0.1:1/0", "SOCKET_CONNECT_TIMEOUT": "2"}, r"\['SOCKET_CONNECT_TIMEOUT'\] must be"),
    ({"URL": "redis://127.0.0.1:1/0", "KEY_PREFIX": ""}, r"\['KEY_PREFIX'\] must not be empty"),
    ({"CACHE": "nope"}, "cache 'nope', which is not in settings.CACHES"),
    ({"CACHE": "default", "REQUEST_TIMEOUT": 1}, r"CACHES\['default'\]\['OPTIONS'\]\['SOCKET_TIMEOUT'\]"),
    ({"URL": "redis://127.0.0.1:1/0", "SOCKET_TIMEOUT": 1, "REQUEST_TIMEOUT": 1}, "both 'REQUEST_TIMEOUT' and its old name"),
])
def test_bad_options_name_the_alias_and_option(options, message):
    with pytest.raises(ImproperlyConfigured, match=message) as excinfo:
        RedisBackend("mine", options)
    assert "DISTLOCK['mine']" in str(excinfo.value)


def test_the_old_name_of_request_timeout_still_works_and_warns(settings):
    settings.DISTLOCK = {**settings.DISTLOCK, "old": {
        "BACKEND": "distlock.backends.redis.RedisBackend",
        "OPTIONS": {"URL": "redis://127.0.0.1:1/0", "KEY_PREFIX": "old", "SOCKET_TIMEOUT": 0.5}}}
    backend = RedisBackend("old", settings.DISTLOCK["old"]["OPTIONS"])
    assert backend.settings["REQUEST_TIMEOUT"] == 0.5
    assert backend.pool.connection_kwargs["socket_timeout"] == 0.5, "building the pool connects to nothing"
    (warning,) = [error for error in check_distlock_setting() if error.id == "distlock.W002"]
    assert "DISTLOCK['old']['OPTIONS']['SOCKET_TIMEOUT']" in warning.msg and "'REQUEST_TIMEOUT'" in warning.msg
    backend.close()


def test_options_are_checked_without_io(settings):
    settings.DISTLOCK = {**settings.DISTLOCK, "nowhere": {
        "BACKEND": "distlock.backends.redis.RedisBackend", "OPTIONS": {"URL": "redis://127.0.0.1:1/0"}},
        "bad": {"BACKEND": "distlock.backends.redis.RedisBackend", "OPTIONS": {"URL": "redis://x", "CACHE": "y"}}}
    errors = [error for error in check_distlock_setting()
              if error.is_serious() and ("'bad'" in error.msg or "'nowhere'" in error.msg)]
    assert [(error.id, "DISTLOCK['bad']" in error.msg) for error in errors] == [("distlock.E004", True)]
    RedisBackend("nowhere", {"URL": "redis://127.0.0.1:1/0"})  # building the backend connects to nothing


def test_cache_that_is_not_django_redis_is_refused_on_first_use(settings):
    backend = RedisBackend("locmem-cache", {"CACHE": "default"})  # CACHES['default'] is LocMemCache
    with pytest.raises(ImproperlyConfigured, match="not a django-redis cache"):
        backend.ping()
