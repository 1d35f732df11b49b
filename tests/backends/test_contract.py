"""The behaviour every backend promises, run against each configured alias on its real server."""

import json
import os
import re
import threading
import time
import traceback

import pytest
from django.conf import settings as settings_module
from django.db import connections

import distlock
from distlock.backends.base import READ_WRITE
from distlock.handler import locks
from distlock.signals import lock_acquired, lock_lost, lock_released
from tests.conftest import CONTRACT_ALIASES, CONTRACT_SHARED_ALIASES, LOCK_APPS, LONG, alias_params, require_alias
from tests.servers import wait_until
from tests.workers import read_events, spawn

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__", available_apps=LOCK_APPS)


@pytest.fixture(params=alias_params(CONTRACT_ALIASES, locks_only=True))
def backend_alias(request):
    """Each backend alias in turn (``tests.conftest.backend_alias``), with only the databases it needs."""
    return require_alias(request.param)


@pytest.fixture(params=alias_params(CONTRACT_SHARED_ALIASES, locks_only=True))
def shared_alias(request):
    """Each alias whose locks exclude other processes (``tests.conftest.shared_alias``), with only its databases."""
    return require_alias(request.param)


#: Aliases of a backend another alias already runs on the same server, which differ from it only in where
#: their client comes from or where their keys live: redis_cache is the Redis backend on django-redis's
#: connection, zookeeper_buckets the ZooKeeper backend with LAYOUT "buckets". Every test runs on
#: them, except those of several processes (a killed holder, four processes): those run on them with
#: DISTLOCK_FAULTS_LONG=1 (make test's time budget), and on the alias of the same backend ("redis",
#: "zookeeper") always. The tests that wait seconds in one process run on every alias at once
#: (``on_every_alias_at_once``).
SAME_BACKEND_AS = {"redis_cache": "redis", "zookeeper_buckets": "zookeeper"}
#: Aliases whose tests of seconds with several processes (four processes hammering, a killed holder) run with
#: DISTLOCK_FAULTS_LONG=1 only: redis_cluster runs the Redis scripts of "redis", one slot at a time, and its
#: own processes' tests (tests/backends/test_redis_cluster.py, the fencing timelines) cover it in make test.
PROCESSES_LONG_ONLY = {**SAME_BACKEND_AS, "redis_cluster": "redis"}


@pytest.fixture(params=alias_params(CONTRACT_SHARED_ALIASES, long_only_aliases=PROCESSES_LONG_ONLY, locks_only=True))
def shared_lease_alias(request):
    """``shared_alias`` for the tests that take seconds: every backend once (``PROCESSES_LONG_ONLY``)."""
    return require_alias(request.param)


def on_every_alias_at_once(scenario):
    """Run ``scenario(alias)`` on every configured contract alias at the same time, a thread each.

    For the scenarios whose length is the server's or the renewal thread's time (a lease held past
    three ttls, ``max_hold`` running out): run together they take the time of one, so they cover every
    alias, ``SAME_BACKEND_AS`` included, within ``make test``'s budget. A failure names its alias.
    """
    aliases = [alias for alias in CONTRACT_ALIASES if alias in settings_module.DISTLOCK]
    for alias in CONTRACT_ALIASES:
        if alias not in aliases and CONTRACT_ALIASES[alias] in os.environ.get("DISTLOCK_TEST_REQUIRE", "").split(","):
            require_alias(alias)  # fails: its server was started
    failures = {}

    def run(alias):
        try:
            scenario(alias)
        except BaseException as exc:  # noqa: BLE001 - reported below, with its alias
            failures[alias] = "".join(traceback.format_exception(exc))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(alias,), name=f"contract-{alias}") for alias in aliases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    stuck = [thread.name for thread in threads if thread.is_alive()]
    assert not stuck, f"still running after 60 s: {stuck}"
    assert not failures, "\n".join(f"--- on alias {alias!r}:\n{text}" for alias, text in failures.items())


#: Acquisitions per process in the multi-process test; backends with sessions do one round trip more per lock.
#: Half as many in ``make test`` (its time budget: still 4 processes contending for 200–400 grants), all of
#: them with DISTLOCK_FAULTS_LONG=1.
HAMMER_COUNT, SESSION_HAMMER_COUNT = (200, 100) if LONG else (100, 50)
#: The environment of a holder the test kills: ZooKeeper and etcd free its lock when its session expires,
#: so its session lasts 3 s (as in the fault suite) instead of the default 10 s.
SHORT_SESSIONS = {"DISTLOCK_TEST_SESSION_TIMEOUT": "3"}


def note_waits(backend_alias, monkeypatch):
    """Return an event set once an acquire on the alias was refused and starts waiting (every backend's
    one acquire loop calls ``_wait_for_release`` then), so a test releases behind a waiter, not before it."""
    backend = locks[backend_alias]
    waiting = threading.Event()
    wait_for_release = backend._wait_for_release

    def noted(attempt, remaining):
        waiting.set()
        return wait_for_release(attempt, remaining)

    monkeypatch.setattr(backend, "_wait_for_release", noted)
    return waiting


def test_acquire_and_release(backend_alias, lock_name):
    lease = distlock.acquire(lock_name, ttl=10, using=backend_alias)
    assert isinstance(lease.token, int) and lease.token > 0
    assert len(lease.owner) >= 32
    assert lease.name == lock_name and not lease.lost
    assert 9 < lease.remaining() <= 10
    assert lease.acquired_at.tzinfo is not None and lease.expires_at > lease.acquired_at
    lease.check()
    assert lease.release() is True
    assert lease.release() is False, "a second release must be a no-op"
    again = distlock.acquire(lock_name, ttl=10, blocking=False, using=backend_alias)
    assert again.token > lease.token
    again.release()


def test_context_manager_and_decorator(backend_alias, lock_name):
    with distlock.lock(lock_name, ttl=10, using=backend_alias) as lease:
        with pytest.raises(distlock.LockNotAcquired):
            distlock.acquire(lock_name, blocking=False, using=backend_alias)
    assert lease.released

    @distlock.lock(lock_name, ttl=10, using=backend_alias)
    def critical():
        with pytest.raises(distlock.LockNotAcquired):
            distlock.acquire(lock_name, timeout=0, using=backend_alias)
        return "done"

    assert critical() == "done"
    assert critical() == "done"
    distlock.acquire(lock_name, blocking=False, using=backend_alias).release()


def test_non_blocking_miss_is_immediate(backend_alias, lock_name):
    with distlock.lock(lock_name, ttl=10, using=backend_alias):
        started = time.monotonic()
        with pytest.raises(distlock.LockNotAcquired):
            distlock.acquire(lock_name, blocking=False, timeout=30, using=backend_alias)
        assert time.monotonic() - started < 2


def test_timeout(backend_alias, lock_name):
    with distlock.lock(lock_name, ttl=10, using=backend_alias):
        started = time.monotonic()
        with pytest.raises(distlock.LockNotAcquired):
            distlock.acquire(lock_name, timeout=0.5, using=backend_alias)
        waited = time.monotonic() - started
    assert 0.5 <= waited < 2.0


def test_blocking_acquire_wakes_on_release(backend_alias, lock_name, monkeypatch):
    holder = distlock.acquire(lock_name, ttl=30, using=backend_alias)
    waiting = note_waits(backend_alias, monkeypatch)
    woken = []
    thread = threading.Thread(target=lambda: woken.append(
        (distlock.acquire(lock_name, ttl=10, timeout=10, using=backend_alias), time.monotonic())))
    thread.start()
    wait_until(waiting.is_set, 10, "the waiter waiting for the release")
    released_at = time.monotonic()
    holder.release()
    thread.join(15)
    ((waiter, woke_at),) = woken
    assert woke_at >= released_at
    assert woke_at - released_at < 0.5, "the waiter must wake soon after the release, well before the ttl"
    assert waiter.token > holder.token
    waiter.release()


def test_expired_lock_is_taken_over_with_a_higher_token(lock_name):
    def take_over_at_expiry(alias):
        name = f"{lock_name}:{alias}"
        first = distlock.acquire(name, ttl=1, using=alias)
        second = distlock.acquire(name, ttl=10, timeout=15, using=alias)
        assert second.token > first.token
        with pytest.raises(distlock.LockLost):
            first.check()
        assert first.release() is False, "releasing an expired lease must not delete the new holder's lock"
        with pytest.raises(distlock.LockNotAcquired):
            distlock.acquire(name, blocking=False, using=alias)
        assert second.release() is True

    on_every_alias_at_once(take_over_at_expiry)


def test_tokens_increase_across_names(backend_alias, lock_name):
    """Alias-wide where the backend says so (``tokens_grow_alias_wide``), else per name (Redis Cluster)."""
    tokens = []
    suffixes = ["a", "b", "a", "c", "b"]
    for suffix in suffixes:
        with distlock.lock(f"{lock_name}:{suffix}", ttl=10, using=backend_alias) as lease:
            tokens.append(lease.token)
    if not locks[backend_alias].tokens_grow_alias_wide:
        tokens = [[token for token, of in zip(tokens, suffixes) if of == suffix] for suffix in sorted(set(suffixes))]
        assert all(per_name == sorted(per_name) and len(set(per_name)) == len(per_name) for per_name in tokens)
        return
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)


def test_a_waiter_gets_a_token_above_every_token_granted_while_it_waited(backend_alias, lock_name, monkeypatch):
    """Tokens order grants alias-wide: a waiter's token is not from when it queued but from its grant."""
    holder = distlock.acquire(f"{lock_name}:x", ttl=30, using=backend_alias)
    waiting = note_waits(backend_alias, monkeypatch)
    granted = []
    waiter = threading.Thread(target=lambda: granted.append(
        distlock.acquire(f"{lock_name}:x", ttl=30, timeout=20, using=backend_alias)))
    waiter.start()
    wait_until(waiting.is_set, 10, "the waiter queueing")
    with distlock.lock(f"{lock_name}:y", ttl=30, using=backend_alias) as other:
        pass
    holder.release()
    waiter.join()
    (lease,) = granted
    if locks[backend_alias].tokens_grow_alias_wide:
        assert holder.token < other.token < lease.token
    assert holder.token < lease.token
    (info,) = locks[backend_alias].held_locks(f"{lock_name}:x")
    assert info.token == lease.token
    lease.release()


def test_release_of_a_lock_owned_by_someone_else_is_refused(lock_name):
    def release_after_a_takeover(alias):
        name = f"{lock_name}:{alias}"
        stale = distlock.acquire(name, ttl=1, using=alias)
        current = distlock.acquire(name, ttl=30, timeout=15, using=alias)
        assert stale.release() is False
        backend = locks[alias]
        assert backend.release_owned(name, stale.owner) is False
        assert [info.owner for info in backend.held_locks(name)] == [current.owner]
        with pytest.raises(distlock.LockNotAcquired):
            distlock.acquire(name, blocking=False, using=alias)
        assert current.release() is True

    on_every_alias_at_once(release_after_a_takeover)


def test_held_locks_pages_through_every_lock_of_a_prefix_once(backend_alias, lock_name):
    backend = locks[backend_alias]
    names = [f"{lock_name}:{index:02}" for index in range(7)]
    leases = [distlock.acquire(name, ttl=30, using=backend_alias) for name in names]
    elsewhere = distlock.acquire(f"{lock_name}-other", ttl=30, using=backend_alias)
    try:
        pages, cursor = [], None
        while True:
            page = backend.held_locks(f"{lock_name}:", limit=3, cursor=cursor)
            pages.append([info.name for info in page])
            cursor = page.cursor
            if cursor is None:
                break
            assert len(pages) < 10, "the cursors never end"
        listed = [name for page in pages for name in page]
        assert sorted(listed) == names, "every lock of the prefix once, nothing else"
        assert all(page == sorted(page) for page in pages)
        assert all(len(page) <= 3 for page in pages[:-1]) or backend_alias in ("redis", "redis_cache", "redis_cluster"), \
            "a page of at most limit locks (Redis: what the SCAN calls brought)"
        everything = backend.held_locks(f"{lock_name}:")
        assert everything.cursor is None and sorted(info.name for info in everything) == names
    finally:
        for lease in [*leases, elsewhere]:
            lease.release()


def test_a_page_no_backend_could_serve_is_refused_before_any_io(backend_alias):
    for limit, cursor, error in [(0, None, ValueError), (-1, None, ValueError), (1.5, None, TypeError),
                                 (True, None, TypeError), (None, 3, TypeError)]:
        with pytest.raises(error):
            locks[backend_alias].held_locks("", limit=limit, cursor=cursor)


def test_held_locks_lists_the_holder(backend_alias, lock_name):
    with distlock.lock(lock_name, ttl=10, using=backend_alias) as lease:
        (info,) = locks[backend_alias].held_locks(lock_name)
        assert (info.alias, info.name, info.owner, info.token) == (backend_alias, lock_name, lease.owner, lease.token)
        assert info.pid is not None and info.host
    assert locks[backend_alias].held_locks(lock_name) == []


def test_signals(backend_alias, lock_name):
    seen = []

    def receiver(signal, **kwargs):
        seen.append((signal, kwargs["lease"].name))

    for signal in (lock_acquired, lock_released):
        signal.connect(receiver)
    try:
        with distlock.lock(lock_name, ttl=10, using=backend_alias):
            pass
    finally:
        for signal in (lock_acquired, lock_released):
            signal.disconnect(receiver)
    assert seen == [(lock_acquired, lock_name), (lock_released, lock_name)]


def test_auto_renew_keeps_the_lock_past_three_ttls(lock_name):
    ttl = 1.5

    def hold_past_three_ttls(alias):
        name = f"{lock_name}:{alias}"
        with distlock.lock(name, ttl=ttl, auto_renew=True, using=alias) as lease:
            time.sleep(3 * ttl + 0.5)  # the hold itself
            lease.check()
            assert lease.remaining() > 0
            with pytest.raises(distlock.LockNotAcquired):
                distlock.acquire(name, blocking=False, using=alias)
        assert lease.released

    on_every_alias_at_once(hold_past_three_ttls)


def test_auto_renew_marks_the_lease_lost_when_the_lock_disappears(backend_alias, lock_name):
    lost = []

    def receiver(**kwargs):
        lost.append(kwargs["lease"])

    lock_lost.connect(receiver)
    try:
        lease = distlock.acquire(lock_name, ttl=1.5, auto_renew=True, using=backend_alias)
        assert locks[backend_alias].release_owned(lock_name, lease.owner) is True
        # Wait for the signal, not for ``lease.lost``: that turns true by itself once the validity
        # runs out, which a loaded machine can make happen before the renewal thread finds out.
        wait_until(lambda: lost, 10, "lock_lost from the renewal thread")
        assert lease.lost
        with pytest.raises(distlock.LockLost):
            lease.check()
        assert lost == [lease]
        assert lease.release() is False
    finally:
        lock_lost.disconnect(receiver)


def test_max_hold_stops_renewal_and_releases(lock_name):
    def hold_until_max_hold(alias):
        name = f"{lock_name}:{alias}"
        lease = distlock.acquire(name, ttl=1.5, auto_renew=True, max_hold=2, using=alias)
        # The renewal thread releases, then marks the lease lost; by then the validity ran out anyway, so
        # wait for the mark (the reason), not for ``lease.lost``.
        wait_until(lambda: lease.lost_reason is not None, 10, f"the renewal thread stopping at max_hold on {alias}")
        assert lease.lost
        with pytest.raises(distlock.LockLost, match="max_hold"):
            lease.check()
        distlock.acquire(name, blocking=False, using=alias).release()

    on_every_alias_at_once(hold_until_max_hold)


def test_four_processes_never_overlap_and_tokens_strictly_increase(shared_lease_alias, lock_name):
    with distlock.lock(lock_name, ttl=10, using=shared_lease_alias) as probe:
        count = HAMMER_COUNT if probe.session_timeout is None else SESSION_HAMMER_COUNT
    workers = [spawn("hammer", alias=shared_lease_alias, name=lock_name, count=count, ttl=30) for _ in range(4)]
    events = [event for worker in workers for event in read_events(worker, timeout=600)]
    assert len(events) == 4 * count
    events.sort(key=lambda event: event["enter"])
    overlaps = sum(1 for before, after in zip(events, events[1:]) if after["enter"] < before["exit"])
    assert overlaps == 0
    tokens = [event["token"] for event in events]
    assert all(a < b for a, b in zip(tokens, tokens[1:])), "tokens must strictly increase in lock order"
    assert len({event["pid"] for event in events}) == 4


def test_holder_killed_frees_the_lock_within_ttl(shared_lease_alias, lock_name):
    ttl = 2
    holder = spawn("hold", env=SHORT_SESSIONS, alias=shared_lease_alias, name=lock_name, ttl=ttl)
    try:
        held = json.loads(holder.stdout.readline())
        with pytest.raises(distlock.LockNotAcquired):
            distlock.acquire(lock_name, blocking=False, using=shared_lease_alias)
        holder.kill()
        killed_at = time.monotonic()
        holder.wait()
        backend = locks[shared_lease_alias]
        # Session backends free the lock when the holder's session expires rather than at the ttl.
        bound = ttl + 1.5
        session_timeout = held["session_timeout"] or 0
        lease = distlock.acquire(lock_name, ttl=10, timeout=max(bound, session_timeout) + 10, using=shared_lease_alias)
        freed_after = time.monotonic() - killed_at
        assert lease.token > held["token"]
        lease.release()
        assert freed_after < max(bound, session_timeout + 1.5), (backend, freed_after, session_timeout)
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.communicate()


@pytest.mark.parametrize(("arguments", "error"), [
    ({"name": ""}, ValueError),
    ({"name": 7}, TypeError),
    ({"name": None}, TypeError),
    ({"name": "x" * 256}, ValueError),
    ({"name": "bad\x00name"}, ValueError),
    ({"name": "bad\nname"}, ValueError),
    ({"ttl": 0}, ValueError),
    ({"ttl": -1}, ValueError),
    ({"ttl": float("nan")}, ValueError),
    ({"ttl": float("inf")}, ValueError),
    ({"ttl": "10"}, TypeError),
    ({"ttl": True}, TypeError),
    ({"timeout": -1}, ValueError),
    ({"timeout": "1"}, TypeError),
    ({"max_hold": 0}, ValueError),
    ({"blocking": "yes"}, TypeError),
    ({"auto_renew": 1}, TypeError),
])
def test_bad_input_is_refused_before_any_io(backend_alias, arguments, error):
    kwargs = {"name": "valid", "ttl": 5, **arguments}
    with pytest.raises(error) as excinfo:
        distlock.acquire(using=backend_alias, **kwargs)
    argument = next(iter(arguments))
    assert argument in str(excinfo.value) or "Lock name" in str(excinfo.value)


def test_a_ttl_shorter_than_a_round_trip_is_refused_not_retried_forever(backend_alias, lock_name):
    """Every grant of a 1 µs ttl comes back expired: never hand one out, and give up after a few."""
    # A backend that trusts less than the whole ttl (Redlock's clock-drift allowance) refuses such a
    # ttl before any request: nothing of it would be left to trust.
    untrusted = locks[backend_alias].trusted_validity(1e-6) <= 0
    expected = ValueError if untrusted else distlock.LockNotAcquired
    started = time.monotonic()
    with pytest.raises(expected, match="ttl"):
        distlock.acquire(lock_name, ttl=1e-6, using=backend_alias)
    assert time.monotonic() - started < 10
    with distlock.lock(lock_name, ttl=5, timeout=5, using=backend_alias) as lease:
        assert not lease.lost, "no late grant was left holding the lock"


@pytest.mark.parametrize("name", ["a/b/c", "orders:42", "with space", "naïve-ünïcödé", "日本語", "x" * 255, ".."])
def test_unusual_but_valid_names(backend_alias, name):
    with distlock.lock(name, ttl=5, using=backend_alias) as lease:
        assert [info.name for info in locks[backend_alias].held_locks(name) if info.name == name] == [name]
    assert lease.released


def test_unknown_alias():
    with pytest.raises(distlock.InvalidLockBackendError, match="nope"):
        distlock.acquire("x", using="nope")


def _pointed_at(value, port):
    """``value`` (an option) with every loopback ``host:port`` in it moved to ``port``, where nothing listens."""
    if isinstance(value, str):
        return re.sub(r"(127\.0\.0\.1|localhost):\d+", lambda match: f"{match[1]}:{port}", value)
    if isinstance(value, (list, tuple)):
        return type(value)(_pointed_at(item, port + index) for index, item in enumerate(value))
    return value


def _down_config(alias, port, databases):
    """This alias's backend and options, pointed at closed loopback ports; None if its server is in-process.

    Derived from the alias's own options, for whatever backend it names: its addresses move to closed
    ports, and a database it names is replaced by a copy of that database on a closed port.
    """
    entry = settings_module.DISTLOCK[alias]
    options = {name: _pointed_at(value, port) for name, value in entry.get("OPTIONS", {}).items()}
    database = options.get("DATABASE") or ("default" if entry["BACKEND"].endswith("DatabaseBackend") else None)
    if database is not None:
        if not databases[database].get("PORT"):
            return None  # SQLite: no server
        databases["down"] = {**databases[database], "PORT": str(port), "OPTIONS": {"connect_timeout": 2}}
        options["DATABASE"] = "down"
    if options == entry.get("OPTIONS", {}):
        return None  # nothing to point elsewhere: locmem
    return entry["BACKEND"], options


#: The message every backend gives when its server does not answer (``BaseLockBackend.unavailable``).
UNAVAILABLE = re.compile(r"^Lock alias 'down' \((?P<label>[^)]+)\) could not acquire lock 'anything': .+\.$", re.S)


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_backend_down_raises_backend_unavailable_within_the_timeout(backend_alias, settings):
    from tests.servers import free_port  # noqa: PLC0415

    port = free_port()
    databases = dict(settings.DATABASES)
    config = _down_config(backend_alias, port, databases)
    if config is None:
        pytest.skip(f"alias {backend_alias!r} has no server to be down")
    backend_path, options = config
    settings.DATABASES = databases
    settings.DISTLOCK = {**settings.DISTLOCK, "down": {"BACKEND": backend_path, "OPTIONS": options}}
    for timeout in (0, 1.5):
        started = time.monotonic()
        with pytest.raises(distlock.BackendUnavailable) as failed:
            distlock.acquire("anything", ttl=5, timeout=timeout, using="down")
        assert time.monotonic() - started < timeout + 3
        shape = UNAVAILABLE.match(str(failed.value))
        assert shape, f"not the common message shape: {failed.value}"
        assert shape["label"] == locks["down"].label


def test_unsupported_lock_shapes_say_so_the_same_way_on_every_backend(backend_alias, lock_name):
    backend = locks[backend_alias]
    if READ_WRITE in backend.capabilities:
        with distlock.read_lock(lock_name, ttl=5, using=backend_alias), \
                distlock.read_lock(lock_name, ttl=5, using=backend_alias, blocking=False):
            pass
        return
    expected = (rf"^Lock alias '{backend_alias}' \({re.escape(backend.label)}\) does not support read/write locks "
                r"\(read_lock\(\), write_lock\(\)\); use an alias whose backend does: ZooKeeper\.$")
    for shape in (distlock.read_lock, distlock.write_lock):
        with pytest.raises(distlock.NotSupported, match=expected):
            with shape(lock_name, ttl=5, using=backend_alias):
                pass
    assert backend.held_locks(lock_name) == []


def test_the_backends_named_for_each_capability_are_those_that_declare_it():
    from django.utils.module_loading import import_string  # noqa: PLC0415

    from distlock.backends.base import SUPPORTED_BY  # noqa: PLC0415

    named = {"database": "distlock.backends.database.DatabaseBackend", "locmem": "distlock.backends.locmem.LocMemBackend",
             "Redis": "distlock.backends.redis.RedisBackend", "Redlock": "distlock.backends.redlock.RedlockBackend",
             "ZooKeeper": "distlock.backends.zookeeper.ZooKeeperBackend", "etcd": "distlock.backends.etcd.EtcdBackend"}
    for capability, names in SUPPORTED_BY.items():
        declaring = {name for name, path in named.items() if capability in import_string(path).capabilities}
        assert set(names) == declaring, capability
