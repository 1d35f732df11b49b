"""etcd-specific behaviour: options, key encoding, session lease, faults on a private 3-member cluster.

The destructive tests (pause, stop, kill members) run on a cluster of this module's own, never on
the shared one of the contract suite; each restores every member before it ends.
"""

import importlib.util
import json
import logging
import math
import os
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from urllib.parse import quote

import pytest
from django.core.exceptions import ImproperlyConfigured
from hypothesis import given
from etcd3 import etcdrpc
from hypothesis import strategies as st

import distlock
from distlock.backends.etcd import EtcdBackend
from distlock.backends.etcd.transactions import Queue, acquire_txn, lock_queues, range_end, release_txn
from distlock.handler import locks
from distlock.signals import lock_lost
from tests.conftest import require_alias
from tests.servers import free_port, wait_until
from tests.servers.etcd import ELECTION_TIMEOUT_MS, EtcdCluster
from tests.workers import ROOT, child_env, spawn


def require_module(name):
    """Skip unless ``name`` is installed, without importing it: importing eventlet alone makes every
    later fork() in this process warn (an at-fork hook of its own), which the suite treats as an error."""
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed")


#: The default database alone (the metrics recorder's and the worker processes'): the locks live in etcd,
#: and emptying PostgreSQL and the locks database after each test took 0.1–0.2 s a test.
pytestmark = pytest.mark.django_db(transaction=True, databases=["default"])

BACKEND = "distlock.backends.etcd.EtcdBackend"
#: The shortest lease etcd grants with the cluster's flags: 1.5 x election timeout, rounded up.
ETCD_MIN_TTL = math.ceil(1.5 * ELECTION_TIMEOUT_MS / 1000)


# -- options and key layout: pure logic, no server ------------------------------------------------------


@pytest.mark.parametrize(("options", "endpoints"), [
    ({}, ["127.0.0.1:2379"]),
    ({"HOST": "etcd.internal"}, ["etcd.internal:2379"]),
    ({"HOST": "10.0.0.5", "PORT": 23790}, ["10.0.0.5:23790"]),
    ({"ENDPOINTS": "a:1,b:2, c:3"}, ["a:1", "b:2", "c:3"]),
    ({"ENDPOINTS": ["a:1", "http://b:2"]}, ["a:1", "b:2"]),
])
def test_endpoint_options(options, endpoints):
    assert EtcdBackend("e", options)._connection.addresses == endpoints


@pytest.mark.parametrize(("options", "message"), [
    ({"ENDPOINTS": "a:1", "HOST": "b"}, "both ENDPOINTS and HOST/PORT"),
    ({"ENDPOINTS": ["a:1"], "PORT": 2}, "both ENDPOINTS and HOST/PORT"),
    ({"ENDPOINTS": "a"}, "'host:port'"),
    ({"ENDPOINTS": "a:0"}, "port from 1 to 65535"),
    ({"ENDPOINTS": ["a:1", 7]}, "'host:port' string"),
    ({"ENDPOINTS": []}, "at least one endpoint"),
    ({"ENDPOINTS": "https://a:1,http://b:2"}, "mix http:// and https://"),
    ({"ENDPOINTS": "ftp://a:1"}, "http:// or https://"),
    ({"CERT_CERT": "/c.pem"}, "only one of CERT_KEY and CERT_CERT"),
    ({"CERT_CERT": "/c.pem", "CERT_KEY": "/k.pem"}, "without TLS"),
    ({"USER": "root"}, "only one of USER and PASSWORD"),
    ({"CA_CERT": ""}, "CA_CERT"),
    ({"ENDPOINTS": 2379}, "ENDPOINTS"),
    ({"PORT": "2379"}, "PORT"),
    ({"LEASE_TTL": 2.5}, "whole number of seconds"),
    ({"LEASE_TTL": 0}, "from 1 to"),
    ({"REQUEST_TIMEOUT": 0}, "REQUEST_TIMEOUT"),
    ({"KEY_PREFIX": ""}, "KEY_PREFIX"),
    ({"PREFIX": "/a/", "KEY_PREFIX": "/b/"}, "sets both 'KEY_PREFIX' and its old name 'PREFIX'"),
    ({"HOSTS": "a:1"}, "unknown option"),
])
def test_bad_options_name_the_option(options, message):
    with pytest.raises(ImproperlyConfigured, match=message) as excinfo:
        EtcdBackend("e", options)
    assert "DISTLOCK['e']" in str(excinfo.value)


def test_the_old_option_names_still_work_and_warn(settings):
    from distlock.checks import W002, check_distlock_setting  # noqa: PLC0415

    backend = EtcdBackend("e", {"PREFIX": "/old-name/", "TIMEOUT": 2})
    assert (backend._prefix, backend._connection.timeout) == (b"/old-name/", 2)
    settings.DISTLOCK = {**settings.DISTLOCK, "etcd_old_names": {
        "BACKEND": BACKEND, "OPTIONS": {"PREFIX": "/old-name/", "TIMEOUT": 2, "CA_CERT": "/etc/etcd/ca.pem"}}}
    warnings = [message for message in check_distlock_setting() if "'etcd_old_names'" in message.msg]
    assert [message.id for message in warnings] == [W002, W002]
    assert ["'KEY_PREFIX'" in warnings[0].msg, "'REQUEST_TIMEOUT'" in warnings[1].msg] == [True, True]


def test_building_the_backend_does_no_io():
    backend = EtcdBackend("e", {"ENDPOINTS": f"127.0.0.1:{free_port()}"})
    assert backend._connection._channels is None and backend._keeper._daemon is None
    backend.close()


@given(st.text(min_size=1), st.text(min_size=1))
def test_a_lock_s_key_range_holds_only_its_own_keys(name, other):
    backend = EtcdBackend("e", {})
    mine, theirs = backend._lock_prefix(name), backend._lock_prefix(other)
    assert (theirs.startswith(mine)) == (name == other)
    assert mine.count(b"/") == backend._prefix.count(b"/") + 1, "the name part must hold no '/'"


@given(st.text(min_size=1), st.text())
def test_held_locks_prefix_matches_exactly_the_names_that_start_with_it(name, prefix):
    encoded_name, encoded_prefix = quote(name, safe="").encode(), quote(prefix, safe="").encode()
    assert encoded_name.startswith(encoded_prefix) == name.startswith(prefix)


def test_requests_copied_from_one_template_keep_their_own_value_and_revision():
    first, second = (acquire_txn(b"/p/n/", b"/p/n/1-0", value, 7, True) for value in (b"one", b"two"))
    assert first.success[0].request_put.value == first.failure[2].request_put.value == b"one"
    assert second.success[0].request_put.value == second.failure[2].request_put.value == b"two"
    second.success[0].request_put.value = b"one"
    second.failure[2].request_put.value = b"one"
    assert second == first and second.success[0].request_put.lease == 7
    assert len(acquire_txn(b"/p/n/", b"/p/n/1-0", b"one", 7, False).failure) == 2, "no enqueue: no put, no tail read"
    releases = [release_txn(b"/p/n/1-0", revision) for revision in (5, 6)]
    assert [release.compare[0].create_revision for release in releases] == [5, 6]


def test_a_listing_range_splits_into_one_queue_per_lock_in_key_order():
    keys = [b"/p/a/1-0", b"/p/a/2-0", b"/p/a%20b/1-0", b"/p/stray", b"/p/b/1-1"]
    kvs = [etcdrpc.kv_pb2.KeyValue(key=key, create_revision=index) for index, key in enumerate(keys)]
    queues = lock_queues(b"/p/", kvs)
    assert [(queue.start, queue.end, [kv.key for kv in queue.kvs]) for queue in queues] == [
        (b"/p/a/", b"/p/a0", keys[:2]), (b"/p/a%20b/", b"/p/a%20b0", keys[2:3]),
        (b"/p/stray", b"/p/stray\0", []), (b"/p/b/", b"/p/b0", keys[4:]),
    ]
    assert all(isinstance(queue, Queue) for queue in queues)


def test_range_end():
    assert range_end(b"/a/") == b"/a0"
    assert range_end(b"a\xff") == b"b"
    assert range_end(b"\xff\xff") == b"\0"


# -- a private cluster ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with EtcdCluster(tmp_path_factory.mktemp("etcd")) as running:
        yield running


@pytest.fixture
def restore(cluster):
    """Resume, restart and wait for every member after a test that disturbed them."""
    yield
    cluster.restore()


@pytest.fixture
def prefix():
    return f"/distlock-etcd-test-{uuid.uuid4().hex[:8]}/"


@pytest.fixture
def configure(settings, cluster, prefix):
    """Point DISTLOCK aliases at the private cluster: ``configure(alias=options, ...)``, once per test.

    Every alias is its own backend, hence its own session lease, like a separate process.
    """
    def configure_aliases(**aliases):
        settings.DISTLOCK = {**settings.DISTLOCK, **{
            alias: {"BACKEND": BACKEND, "OPTIONS": {"ENDPOINTS": cluster.endpoints, "KEY_PREFIX": prefix, **options}}
            for alias, options in aliases.items()
        }}
        return list(aliases)

    return configure_aliases


@pytest.fixture
def lost_leases():
    seen = []

    def receiver(lease, reason, **kwargs):
        seen.append((lease, reason))

    lock_lost.connect(receiver)
    yield seen
    lock_lost.disconnect(receiver)


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout}s")
        time.sleep(0.02)


def acquire_in_thread(name, **kwargs):
    """Start ``distlock.acquire(name, **kwargs)`` in a thread; return (thread, result dict)."""
    result = {}

    def run():
        try:
            result["lease"] = distlock.acquire(name, **kwargs)
            result["at"] = time.monotonic()
        except Exception as exc:  # noqa: BLE001 - handed to the test
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def queue_length(cluster, prefix, name):
    return len(cluster.keys(f"{prefix}{quote(name, safe='')}/".encode()))


@pytest.mark.parametrize(("lease_ttl", "effective"), [(1, ETCD_MIN_TTL), (ETCD_MIN_TTL + 1, ETCD_MIN_TTL + 1)])
def test_session_timeout_reports_the_ttl_etcd_granted(configure, lock_name, lease_ttl, effective):
    (alias,) = configure(etcd_own={"LEASE_TTL": lease_ttl})
    with distlock.lock(lock_name, ttl=30, using=alias) as lease:
        assert lease.session_timeout == effective
        assert lease.remaining() > 29, "the per-call ttl keeps its meaning"


def test_no_lease_or_key_is_left_behind_after_100_cycles(configure, cluster, prefix, lock_name):
    holder_alias, other_alias = configure(etcd_own={}, etcd_other={})
    warm_up = distlock.acquire(f"{lock_name}:warm-up", ttl=10, using=holder_alias)
    warm_up.release()
    session_id = warm_up.handle.session.id
    blocker = distlock.acquire(f"{lock_name}:busy", ttl=60, using=other_alias)
    before = set(cluster.leases())
    assert {session_id, blocker.handle.session.id} <= before
    for i in range(100):
        with distlock.lock(f"{lock_name}:{i % 7}", ttl=10, using=holder_alias) as lease:
            assert lease.handle.session.id == session_id, "every lock shares the one session lease"
        if i % 20 == 0:  # misses and timed-out waits leave nothing behind either
            with pytest.raises(distlock.LockNotAcquired):
                distlock.acquire(f"{lock_name}:busy", blocking=False, using=holder_alias)
            with pytest.raises(distlock.LockNotAcquired):
                distlock.acquire(f"{lock_name}:busy", timeout=0.2, using=holder_alias)
    assert set(cluster.leases()) - before == set(), "no lease was granted on the way"
    blocker.release()
    assert cluster.keys(prefix.encode()) == []
    locks.close_all()  # close() revokes each backend's session lease
    assert not {session_id, blocker.handle.session.id} & set(cluster.leases())


def test_a_process_reuses_its_keys_of_a_lock_but_never_shares_one(configure, cluster, prefix, lock_name):
    """etcd keeps deleted keys in its index until compaction and ACQUIRE's range compare visits them,
    so a key per acquisition would slow a hot lock down the more it is used."""
    (alias,) = configure(etcd_own={})
    keys = set()
    for _ in range(20):
        with distlock.lock(lock_name, ttl=10, using=alias) as lease:
            keys.add(lease.handle.key)
    assert len(keys) == 1
    # A lease whose ttl ran out (the background thread deleted its key) frees the key for the next
    # call; its late release must neither delete that call's key nor let a third call share it.
    expired = distlock.acquire(lock_name, ttl=0.5, using=alias)
    # The background thread deletes the key, then frees its slot: wait for both (CI once saw the gap).
    backend = locks[alias]
    wait_for(lambda: queue_length(cluster, prefix, lock_name) == 0 and lock_name not in backend._keeper.session.slots,
             5, "the expired key deleted and its slot freed")
    current = distlock.acquire(lock_name, ttl=10, blocking=False, using=alias)
    assert current.handle.key == expired.handle.key
    assert expired.release() is False
    with pytest.raises(distlock.LockNotAcquired):
        distlock.acquire(lock_name, timeout=0.3, using=alias)
    (info,) = locks[alias].held_locks(lock_name)
    assert info.owner == current.owner and not current.lost
    assert current.release() is True
    assert cluster.keys(prefix.encode()) == []


def test_the_stock_python_etcd3_lock_leaks_a_lease_per_acquire(cluster, lock_name):
    """The measuring stick of the leak test above: python3-etcd3's lock() does leak, and the lease list sees it."""
    import etcd3  # noqa: PLC0415

    host, port = cluster.members[0].address.split(":")
    client = etcd3.client(host=host, port=int(port), timeout=5)
    try:
        before = set(cluster.leases())
        for _ in range(10):
            stock = client.lock(lock_name, ttl=30)
            assert stock.acquire(timeout=5)
            stock.release()
        assert len(set(cluster.leases()) - before) == 10
    finally:
        for lease_id in set(cluster.leases()) - before:
            cluster.revoke_lease(lease_id)
        client.close()


def test_only_the_holder_is_listed_while_others_wait(configure, cluster, prefix, lock_name):
    (alias,) = configure(etcd_own={})
    holder = distlock.acquire(lock_name, ttl=30, using=alias)
    thread, result = acquire_in_thread(lock_name, ttl=30, timeout=20, using=alias)
    wait_for(lambda: queue_length(cluster, prefix, lock_name) == 2, 10, "the waiter did not queue")
    (info,) = locks[alias].held_locks(lock_name)
    assert (info.owner, info.token, info.pid) == (holder.owner, holder.token, os.getpid())
    assert info.expires_at is None, "the ttl lives in the holder's process"
    time.sleep(1.1)
    holder.release()
    thread.join(20)
    waiter = result["lease"]
    (info,) = locks[alias].held_locks(lock_name)
    assert (info.owner, info.token) == (waiter.owner, waiter.token)
    assert (waiter.acquired_at - info.acquired_at).total_seconds() > 1, "the listing shows when it queued"
    assert waiter.attempts > 1
    waiter.release()


def queue_waiters(cluster, prefix, name, aliases):
    """Queue one waiter for ``name`` per alias, in order, each in a thread that releases once granted."""
    def wait_turn(alias):
        with distlock.lock(name, ttl=30, timeout=60, using=alias):
            pass

    threads, queued = [], queue_length(cluster, prefix, name)
    for index, alias in enumerate(aliases, start=1):
        threads.append(threading.Thread(target=wait_turn, args=(alias,)))
        threads[-1].start()
        wait_for(lambda: queue_length(cluster, prefix, name) == queued + index, 10, "a waiter did not queue")
    return threads


def pages_of(backend, prefix, limit):
    """Return every page of ``backend.held_locks(prefix, limit=limit)``, following the cursors."""
    pages, cursor = [], None
    while not pages or cursor is not None:
        pages.append(backend.held_locks(prefix, limit=limit, cursor=cursor))
        cursor = pages[-1].cursor
        assert len(pages) < 100, "the cursors never end"
    return pages


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_a_lock_whose_waiters_straddle_a_range_is_listed_once_with_its_holder(
        configure, cluster, prefix, lock_name, limit):
    """Lock b has 5 waiters, whose keys (of two sessions) sort around its holder's: ranges of a few keys
    cut its queue, or hold nothing else, and the page must still report its holder, once."""
    holder_alias, waiter_alias = configure(etcd_holder={}, etcd_waiter={})
    names = [f"{lock_name}:{letter}" for letter in "abcdef"]
    leases = {name: distlock.acquire(name, ttl=60, using=holder_alias) for name in names}
    waiters = queue_waiters(cluster, prefix, names[1], [waiter_alias, holder_alias] * 2 + [waiter_alias])
    try:
        backend = locks[holder_alias]
        unpaged = backend.held_locks(f"{lock_name}:")
        assert [(info.name, info.owner, info.token) for info in unpaged] == [
            (name, leases[name].owner, leases[name].token) for name in names]
        pages = pages_of(backend, f"{lock_name}:", limit)
        assert [info for page in pages for info in page] == unpaged
        assert [len(page) for page in pages] == [limit] * (len(names) // limit) + [len(names) % limit] * (
            len(names) % limit > 0)
        assert [page.cursor for page in pages] == [page[-1].name for page in pages[:-1]] + [None]
    finally:
        for lease in leases.values():
            lease.release()
        for thread in waiters:
            thread.join(60)
    assert queue_length(cluster, prefix, names[1]) == 0


def test_pages_follow_the_key_order_and_list_each_lock_once(configure, cluster, prefix, lock_name):
    """Keys sort by the quoted name plus "/": "b-1" before "b", "b:1" (quoted "b%3A1") before both."""
    (alias,) = configure(etcd_own={})
    names = sorted(f"{lock_name}:{suffix}" for suffix in ["b", "b-1", "b.x", "b:1", "b/c", "b c", "bé", "c"])
    leases = [distlock.acquire(name, ttl=60, using=alias) for name in names]
    try:
        backend = locks[alias]
        assert [info.name for info in backend.held_locks(f"{lock_name}:")] == names
        for limit in (1, 2, 3):
            pages = pages_of(backend, f"{lock_name}:", limit)
            listed = [info.name for page in pages for info in page]
            assert sorted(listed) == names and len(listed) == len(names), f"each lock once (limit={limit})"
            assert all([info.name for info in page] == sorted(info.name for info in page) for page in pages)
            assert all(len(page) == limit for page in pages[:-1]) and pages[-1].cursor is None
    finally:
        for lease in leases:
            lease.release()


def test_a_page_reads_about_one_page_of_keys_however_many_locks_are_held(
        configure, cluster, prefix, lock_name, monkeypatch):
    (alias,) = configure(etcd_own={})
    names = [f"{lock_name}:{index:03}" for index in range(60)]
    leases = [distlock.acquire(name, ttl=60, using=alias) for name in names]
    waiters = queue_waiters(cluster, prefix, names[22], [alias] * 3)
    backend, asked = locks[alias], []
    connection_range = backend._connection.range

    def counted_range(request, deadline):
        response = connection_range(request, deadline)
        asked.append((request.limit, len(response.kvs)))
        return response

    monkeypatch.setattr(backend._connection, "range", counted_range)
    try:
        first = backend.held_locks(f"{lock_name}:", limit=5)
        middle = backend.held_locks(f"{lock_name}:", limit=5, cursor=names[19])
        assert ([info.name for info in first], first.cursor) == (names[:5], names[4])
        assert ([info.name for info in middle], middle.cursor) == (names[20:25], names[24])
        assert all(0 < limit <= 6 for limit, _ in asked), f"every range has a limit (0: no limit): {asked}"
        assert sum(read for _, read in asked) <= 2 * 2 * 6, f"keys read for two pages of 5: {asked}"
    finally:
        monkeypatch.undo()
        for lease in leases:
            lease.release()
        for thread in waiters:
            thread.join(60)


def test_waiters_get_the_lock_in_the_order_they_queued(configure, cluster, prefix, lock_name):
    (alias,) = configure(etcd_own={})
    holder = distlock.acquire(lock_name, ttl=30, using=alias)
    order = []

    def contend(index):
        with distlock.lock(lock_name, ttl=30, timeout=30, using=alias) as lease:
            order.append((index, lease.token))
            time.sleep(0.05)

    threads = []
    for index in range(4):
        threads.append(threading.Thread(target=contend, args=(index,)))
        threads[-1].start()
        wait_for(lambda: queue_length(cluster, prefix, lock_name) == index + 2, 10, "a waiter did not queue")
    holder.release()
    for thread in threads:
        thread.join(30)
    assert [index for index, _ in order] == [0, 1, 2, 3]
    assert [token for _, token in order] == sorted(token for _, token in order)


def test_ttl_is_enforced_by_the_holder_process_even_if_it_never_releases(lock_name):
    """A live holder that forgets its lease: its own process deletes the key at the ttl, long before the session."""
    require_alias("etcd")
    holder = spawn("hold", alias="etcd", name=lock_name, ttl=1)
    try:
        assert holder.stdout.readline(), holder.stderr.read()
        started = time.monotonic()
        lease = distlock.acquire(lock_name, ttl=5, timeout=15, using="etcd")
        took = time.monotonic() - started
        assert holder.poll() is None, "the holder is still alive"
        assert took < 1 + 1.5 < lease.session_timeout, took
        lease.release()
    finally:
        holder.kill()
        holder.communicate()


def watchers_on(member):
    """Return how many watches the member serves now (its ``etcd_debugging_mvcc_watcher_total`` gauge)."""
    with urllib.request.urlopen(f"http://{member.address}/metrics", timeout=5) as reply:  # noqa: S310 - loopback
        for line in reply.read().decode().splitlines():
            if line.startswith("etcd_debugging_mvcc_watcher_total "):
                return int(float(line.split()[1]))
    raise AssertionError(f"{member.name} reports no etcd_debugging_mvcc_watcher_total")


def test_a_waiter_is_woken_after_its_watch_stream_breaks(configure, cluster, restore, prefix, lock_name, caplog):
    """python3-etcd3's own watch thread dies with NameError('six') when a stream ends; ours re-reads and re-watches."""
    leader = cluster.leader()
    watched, other = [member for member in cluster.members if member is not leader]
    holder_alias, waiter_alias = configure(
        etcd_holder={"ENDPOINTS": [leader.address, other.address]},
        etcd_waiter={"ENDPOINTS": [watched.address, leader.address, other.address]},
    )
    holder = distlock.acquire(lock_name, ttl=60, using=holder_alias)
    there, elsewhere = watchers_on(watched), watchers_on(leader) + watchers_on(other)
    with caplog.at_level(logging.INFO, logger="distlock.backends.etcd"):
        thread, result = acquire_in_thread(lock_name, ttl=30, timeout=30, using=waiter_alias)
        wait_for(lambda: queue_length(cluster, prefix, lock_name) == 2, 10, "the waiter did not queue")
        wait_until(lambda: watchers_on(watched) > there, 10, f"the waiter's watch on {watched.name}")
        watched.stop()
        wait_for(lambda: f"etcd watch on {watched.address} ended" in caplog.text, 5, "the watch stream did not break")
        wait_until(lambda: watchers_on(leader) + watchers_on(other) > elsewhere, 10,
                   "the waiter's watch through another member")
        released_at = time.monotonic()
        holder.release()
        thread.join(30)
    assert "lease" in result, result
    assert result["at"] - released_at < 1.5, "woken by the release, not by the periodic re-check (REQUEST_TIMEOUT=5)"
    assert result["lease"].token > holder.token
    result["lease"].release()


def test_a_release_just_before_the_waiter_s_watch_starts_wakes_it(configure, lock_name):
    """The watch starts at the member's current revision; a deletion after the waiter saw its predecessor
    but before the watch exists is caught by reading the key again, not by the periodic re-check."""
    holder_alias, waiter_alias = configure(etcd_holder={}, etcd_waiter={"REQUEST_TIMEOUT": 10})
    holder = distlock.acquire(lock_name, ttl=60, using=holder_alias)
    released = []

    class ReleaseFirst:
        """The waiter's watch stub: the holder releases right before the watch is created."""

        def __init__(self, stub):
            self.stub = stub

        def Watch(self, *args, **kwargs):  # noqa: N802 - the gRPC method's name
            if not released:
                released.append(time.monotonic())
                holder.release()
            return self.stub.Watch(*args, **kwargs)

    connection = locks[waiter_alias]._connection
    connection._channel()  # opens the channels
    for channel in connection._channels:
        channel.watch = ReleaseFirst(channel.watch)
    thread, result = acquire_in_thread(lock_name, ttl=30, timeout=30, using=waiter_alias)
    thread.join(30)
    assert released, "the waiter never watched"
    assert "lease" in result, result
    assert result["at"] - released[0] < 2, "woken by the read behind the watch, not by a re-check after REQUEST_TIMEOUT"
    assert result["lease"].token > holder.token
    result["lease"].release()


def test_a_cancelled_waiter_stops_watching_at_once_and_leaves_the_queue(configure, cluster, prefix, lock_name):
    """The job of a caller that was interrupted is cancelled (``distlock.backends.offload``): its watch
    ends then, not after REQUEST_TIMEOUT, and the attempt gives up its place."""
    from distlock.backends.base import Attempt  # noqa: PLC0415
    from distlock.backends.offload import Abandoned, Job  # noqa: PLC0415

    holder_alias, waiter_alias = configure(etcd_holder={}, etcd_waiter={"REQUEST_TIMEOUT": 30})
    holder = distlock.acquire(lock_name, ttl=60, using=holder_alias)
    backend = locks[waiter_alias]
    attempt = Attempt(name=lock_name, owner="cancelled-waiter", ttl=30, blocking=True, deadline=None)
    job = Job(lambda job: backend._acquire_loop(attempt, job))
    waiter = threading.Thread(target=job.run)
    waiter.start()
    wait_for(lambda: job.wake is not None, 10, "the waiter did not watch")
    cancelled_at = time.monotonic()
    job.cancel()
    waiter.join(10)
    assert isinstance(job.error, Abandoned) and time.monotonic() - cancelled_at < 2
    assert queue_length(cluster, prefix, lock_name) == 1, "the waiter's key was deleted"
    holder.release()


def test_a_waiter_whose_session_lease_was_revoked_queues_again(configure, cluster, prefix, lock_name):
    """The waiter's key vanished with its lease: it must not take the lock on a dead lease (etcd issue 11456).

    A second waiter queued behind it gets the lock first; the first one queues again on a new session lease.
    """
    holder_alias, waiter_alias, behind_alias = configure(etcd_holder={}, etcd_waiter={}, etcd_behind={})
    lock_keys = f"{prefix}{quote(lock_name, safe='')}/".encode()
    holder = distlock.acquire(lock_name, ttl=60, using=holder_alias)
    order, errors = [], []

    def contend(alias):
        try:
            with distlock.lock(lock_name, ttl=30, timeout=30, using=alias) as lease:
                listed = [info.owner for info in locks[alias].held_locks(lock_name)]
                order.append((alias, lease.token, listed == [lease.owner]))
                time.sleep(0.2)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    waiter = threading.Thread(target=contend, args=(waiter_alias,))
    waiter.start()
    wait_for(lambda: len(cluster.keys(lock_keys)) == 2, 10, "the waiter did not queue")
    (_, _, revoked) = max(cluster.keys(lock_keys), key=lambda kv: kv[1])
    behind = threading.Thread(target=contend, args=(behind_alias,))
    behind.start()
    wait_for(lambda: len(cluster.keys(lock_keys)) == 3, 10, "the second waiter did not queue")
    cluster.revoke_lease(revoked)
    assert len(cluster.keys(lock_keys)) == 2
    holder.release()
    waiter.join(30)
    behind.join(30)
    assert errors == []
    assert order == [(behind_alias, order[0][1], True), (waiter_alias, order[1][1], True)], "each held a live key"
    assert holder.token < order[0][1] < order[1][1]
    assert cluster.keys(lock_keys) == []


def test_a_late_copy_of_an_acquire_that_recreates_our_key_never_yields_an_older_token(
        configure, cluster, prefix, lock_name):
    """The soak's etcd run 927: a retried ACQUIRE whose first copy committed only later (held in a cut
    link) put our released key back into the queue. Finding it at the head, the next acquire took the
    key's old mod revision for its token, below the token of a grant made meanwhile."""
    ours, first, second = configure(etcd_ours={}, etcd_first={}, etcd_second={})
    earlier = distlock.acquire(lock_name, ttl=30, using=ours)
    handle, owner = earlier.handle, earlier.owner
    earlier.release()
    holder = distlock.acquire(lock_name, ttl=30, using=first)
    thread, result = acquire_in_thread(lock_name, ttl=30, timeout=20, using=second)
    wait_for(lambda: queue_length(cluster, prefix, lock_name) == 2, 10, "the waiter did not queue")
    backend = locks[ours]
    late_copy = acquire_txn(backend._lock_prefix(lock_name), handle.key, json.dumps({"owner": owner}).encode(),
                            handle.session.id, True)
    backend._connection.txn(late_copy, time.monotonic() + 5)  # our key again, queued behind the waiter
    holder.release()
    thread.join(20)
    granted_meanwhile = result["lease"]
    granted_meanwhile.release()
    lease = distlock.acquire(lock_name, ttl=30, blocking=False, using=ours)
    try:
        assert lease.handle.key == handle.key, "the slot's key, found at the head of the queue"
        assert lease.token > granted_meanwhile.token > holder.token
    finally:
        lease.release()
    assert cluster.keys(prefix.encode()) == []


@pytest.mark.parametrize("fault", ["pause", "stop"])
def test_keepalive_failure_past_the_lease_ttl_marks_leases_lost(
        configure, cluster, restore, lost_leases, lock_name, fault):
    holder_alias, other_alias = configure(etcd_holder={"LEASE_TTL": 2, "REQUEST_TIMEOUT": 1}, etcd_other={})
    lease = distlock.acquire(lock_name, ttl=120, using=holder_alias)
    session_timeout = lease.session_timeout
    assert session_timeout == 2
    failed_at = time.monotonic()
    for member in cluster.members:
        getattr(member, fault)()
    try:
        wait_for(lambda: lease.lost, session_timeout + 1.5, "the lease was not marked lost")
        lost_after = time.monotonic() - failed_at
        # Marked lost (check() fails) first, announced right after, by the background thread.
        wait_for(lambda: lost_leases, 2, "lock_lost was not sent")
        assert lost_after >= session_timeout * 2 / 3, "not before the last keepalive's lease could run out"
        assert [lost for lost, _ in lost_leases] == [lease] and "session lease" in lost_leases[0][1]
        with pytest.raises(distlock.LockLost, match="session lease"):
            lease.check()
    finally:
        cluster.restore()
    # The lock is free again soon (etcd expires or we revoke the abandoned lease) and fenced above the old holder.
    other = distlock.acquire(lock_name, ttl=10, timeout=session_timeout + 10, using=other_alias)
    assert other.token > lease.token
    assert lease.release() is False
    other.release()
    again = distlock.acquire(lock_name, ttl=10, timeout=10, using=holder_alias)
    assert again.handle.session.id != lease.handle.session.id and not again.lost
    again.release()


def test_after_the_leader_is_killed_acquisitions_succeed_within_seconds(
        configure, cluster, restore, lost_leases, lock_name):
    leader = cluster.leader()
    endpoints = [leader.address] + [member.address for member in cluster.members if member is not leader]
    holder_alias, other_alias = configure(etcd_holder={"ENDPOINTS": endpoints, "LEASE_TTL": 3},
                                          etcd_other={"ENDPOINTS": endpoints})
    held = distlock.acquire(f"{lock_name}:held", ttl=60, using=holder_alias)
    distlock.acquire(f"{lock_name}:warm-up", ttl=5, using=other_alias).release()
    leader.kill()
    killed_at = time.monotonic()
    fresh = distlock.acquire(f"{lock_name}:fresh", ttl=10, timeout=15, using=other_alias)
    recovered_after = time.monotonic() - killed_at
    assert recovered_after < 5, f"a new acquisition took {recovered_after:.1f}s after the leader died"
    assert fresh.token > held.token
    fresh.release()
    # The lease held across the election is either still ours and excludes others, or reported lost.
    time.sleep(held.session_timeout + 1)
    if held.lost:
        # ``lost`` turns true by itself once the session may have run out; lock_lost comes from the
        # background thread that finds out.
        wait_until(lambda: lost_leases, 10, "lock_lost for the lease held across the election")
        assert [lease for lease, _ in lost_leases] == [held]
        distlock.acquire(f"{lock_name}:held", ttl=10, timeout=10, using=other_alias).release()
    else:
        held.check()
        with pytest.raises(distlock.LockNotAcquired):
            distlock.acquire(f"{lock_name}:held", blocking=False, using=other_alias)
        assert held.release() is True


def test_a_paused_cluster_raises_backend_unavailable_within_the_timeout(configure, cluster, restore, lock_name):
    (alias,) = configure(etcd_own={"REQUEST_TIMEOUT": 5})
    distlock.acquire(f"{lock_name}:warm-up", ttl=5, using=alias).release()
    for member in cluster.members:
        member.pause()
    for timeout in (0, 1.5):
        started = time.monotonic()
        with pytest.raises(distlock.BackendUnavailable, match=rf"^Lock alias '{alias}' \(etcd\) could not acquire lock "):
            distlock.acquire(lock_name, ttl=5, timeout=timeout, using=alias)
        assert time.monotonic() - started < max(timeout, 1) + 1


def test_a_holder_frozen_past_its_session_ttl_finds_its_lease_expired_at_once(lock_name):
    """``check()`` is local, yet bounded by the session: no background thread has to run first."""
    import json  # noqa: PLC0415
    import signal  # noqa: PLC0415

    from tests.conftest import require_alias  # noqa: PLC0415
    from tests.workers import spawn  # noqa: PLC0415

    alias = require_alias("etcd")
    holder = spawn("hold_then_check", alias=alias, name=lock_name, ttl=120, options={"LEASE_TTL": 2})
    try:
        held = json.loads(holder.stdout.readline())
        holder.send_signal(signal.SIGSTOP)
        time.sleep(held["session_timeout"] + 1)
        holder.send_signal(signal.SIGCONT)
        holder.stdin.write("go\n")
        holder.stdin.flush()
        report = json.loads(holder.stdout.readline())
        assert report["check"] == "LockLost" and "session" in report["message"], report
    finally:
        holder.kill()
        holder.communicate()


# -- loss detection survives any lock_lost receiver --------------------------------------------------------


class _ReceiverCrashed(BaseException):
    """Not an ``Exception``: ``send_robust`` lets it through, like a time limit landing in a receiver."""


@pytest.mark.parametrize("error", [RuntimeError, _ReceiverCrashed])
def test_a_raising_lock_lost_receiver_leaves_no_lease_of_the_session_unmarked(configure, cluster, lock_name, error):
    """The session lease is revoked under two leases: both fail ``check()`` before the first receiver
    runs, both are announced although every receiver call raises, and the background thread lives on."""
    (alias,) = configure(etcd_own={"LEASE_TTL": ETCD_MIN_TTL})
    leases = [distlock.acquire(f"{lock_name}:{i}", ttl=60, using=alias) for i in range(2)]
    session = leases[0].handle.session
    assert leases[1].handle.session is session
    calls = []

    def receiver(lease, **kwargs):
        if any(lease is mine for mine in leases):
            calls.append((lease, [mine.lost for mine in leases]))
            raise error("the alerting service is down")

    lock_lost.connect(receiver, weak=False)
    try:
        cluster.revoke_lease(session.id)
        wait_for(lambda: len(calls) == 2, 3 * ETCD_MIN_TTL, "both leases were not announced lost")
    finally:
        lock_lost.disconnect(receiver)
    assert {id(lease) for lease, _ in calls} == {id(lease) for lease in leases}
    assert [flags for _, flags in calls] == [[True, True], [True, True]], "marked lost before any receiver ran"
    for lease in leases:
        with pytest.raises(distlock.LockLost, match="session"):
            lease.check()
    backend = locks[alias]
    assert backend._keeper._daemon.is_alive(), "the background loop survived the receivers"
    again = distlock.acquire(lock_name, ttl=60, using=alias)
    first_valid_until = again.handle.session.valid_until
    wait_for(lambda: again.handle.session.valid_until > first_valid_until, 2 * ETCD_MIN_TTL,
             "the new session lease was not kept alive")
    assert again.release() is True


# -- an exception raised inside a gRPC call surfaces as itself ---------------------------------------------


class _SoftTimeLimit(Exception):  # noqa: N818 - named like Celery's SoftTimeLimitExceeded, also an Exception
    """What a Celery soft time limit raises from its signal handler, wherever the main thread is."""


class _HardInterrupt(BaseException):
    """A ``BaseException`` raised from a signal handler (``KeyboardInterrupt``-like)."""


@pytest.mark.parametrize("error", [_SoftTimeLimit, _HardInterrupt])
def test_an_exception_raised_inside_grpc_s_deserializer_surfaces_as_itself(
        configure, monkeypatch, cluster, prefix, lock_name, error):
    """gRPC turns an ``Exception`` raised while it deserializes a response into a failed call (INTERNAL):
    a time limit landing there must reach the caller as itself, not as ``BackendUnavailable``, and the
    grant of the interrupted acquire must be given back."""
    from etcd3 import etcdrpc  # noqa: PLC0415

    (alias,) = configure(etcd_own={})
    parse, armed = etcdrpc.TxnResponse.FromString, []

    def interrupted(data):
        if armed:
            armed.pop()
            raise error("time limit exceeded")
        return parse(data)

    monkeypatch.setattr(etcdrpc.TxnResponse, "FromString", interrupted)  # before the alias opens its channels
    distlock.acquire(f"{lock_name}:warm-up", ttl=10, using=alias).release()
    armed.append(True)
    with pytest.raises(error, match="time limit exceeded"):
        distlock.acquire(lock_name, ttl=10, using=alias)
    assert not armed, "the patched deserializer ran inside the acquire"
    wait_for(lambda: queue_length(cluster, prefix, lock_name) == 0, 5, "the interrupted grant was not given back")
    distlock.acquire(lock_name, ttl=10, blocking=False, using=alias).release()


# -- fork: the parent's session survives, children work ----------------------------------------------------


@pytest.mark.slow
def test_forks_of_a_process_busy_with_etcd_work_in_the_child_and_leave_the_parent_intact(lock_name):
    """Celery prefork: the main process used etcd (the revoke handler releases locks there), then billiard
    forks children on top of its gRPC state while its threads may be inside calls. Each child takes and
    releases a lock and exits 0 within its deadline; the parent's lease still extends, its session is
    the same, and it takes new locks."""
    alias = require_alias("etcd")
    worker = spawn("etcd_fork", alias=alias, prefix=lock_name, forks=8, child_deadline=10)
    try:
        out, err = worker.communicate(timeout=150)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.communicate()
    assert worker.returncode == 0, err[-4000:]
    (report,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    # gRPC's own verdict on each fork: with a thread inside a call it skips its fork handlers, and the
    # child may then crash (SIGSEGV, "Check failed: next_worker->state == KICKED") or hang.
    assert "skipping fork() handlers" not in err, err[-2000:]
    assert [child["status"] for child in report["children"]] == [0] * 8, report
    assert report["extended"] is True and report["check"] == "ok", report
    assert report["same_session"] and report["fresh_session"], report
    assert report["released"] == [True, True], report
    assert report["cycles"] > 0, report
    assert report["error_count"] == 0, report["errors"]  # the errors themselves: a dict this long is cut short


def test_an_inherited_backend_in_a_forked_child_leaves_the_parent_s_locks_alone(configure, cluster, prefix, lock_name):
    (alias,) = configure(etcd_own={})
    lease = distlock.acquire(lock_name, ttl=60, using=alias)
    backend = locks[alias]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's lease and backend object, inherited
        try:
            report = f"{lease.release()},{backend._keeper.session is None},{lease.lost}"
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            report = repr(exc)
        os.write(write, report.encode())
        os._exit(0)
    os.close(write)
    wait_for(lambda: os.waitpid(pid, os.WNOHANG)[0] == pid, 20, "the child did not exit")
    with os.fdopen(read) as pipe:
        assert pipe.read() == "False,True,True", "the child neither released the parent's lock nor kept its session"
    assert queue_length(cluster, prefix, lock_name) == 1
    assert lease.extend() is True and lease.release() is True


# -- green threads -----------------------------------------------------------------------------------------


def _run_patched(patch, scenario, arguments, timeout=90):
    code = f"{patch}\nimport runpy\nrunpy.run_module('tests.workers', run_name='__main__', alter_sys=True)"
    worker = subprocess.Popen([sys.executable, "-c", code, scenario, json.dumps(arguments)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=child_env(), cwd=ROOT)
    try:
        out, err = worker.communicate(timeout=timeout)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.communicate()
    return worker.returncode, [json.loads(line) for line in out.splitlines() if line.startswith("{")], err


@pytest.mark.slow
def test_under_gevent_grpc_cooperates_and_a_renewed_lease_survives_four_ttls(lock_name):
    """10 greenlets x 5 lock/unlock cycles and a lease held with auto_renew for 4x its ttl: the lease is
    kept, and a heartbeat greenlet ticking every 50 ms never waits more than 1 s (gRPC yields to the hub)."""
    require_module("gevent")
    alias = require_alias("etcd")
    code, events, err = _run_patched("from gevent import monkey; monkey.patch_all()", "etcd_green",
                                     {"alias": alias, "prefix": lock_name, "threads": 10, "cycles": 5, "ttl": 2.0,
                                      "hold_for": 8.0}, timeout=45)
    assert code == 0, err[-4000:]
    (report,) = events
    assert report["gevent_activated"] is True, report
    assert report["error_count"] == 0 and report["check"] == "ok" and report["released"] is True, report
    assert report["max_gap"] < 1.0, report
    assert report["held"] == [], report


def test_under_eventlet_the_alias_is_refused_with_the_fix_named(lock_name):
    """gRPC has no eventlet support (its calls block every green thread): building the alias and the
    system checks both refuse, naming what to do instead."""
    require_module("eventlet")
    alias = require_alias("etcd")
    code, events, err = _run_patched("import eventlet; eventlet.monkey_patch()", "etcd_eventlet_refused",
                                     {"alias": alias, "name": lock_name}, timeout=60)
    assert code == 0, err[-4000:]
    (report,) = events
    assert report["acquire"].startswith("ImproperlyConfigured") and "eventlet" in report["acquire"], report
    assert "Celery --pool=prefork" in report["acquire"], report
    assert any("eventlet" in message for message in report["check_errors"]), report


# -- TLS and auth on a secured single-member cluster -------------------------------------------------------

SECRET = "Zq81-never-shown-4u"


@pytest.fixture(scope="module")
def secure_cluster(tmp_path_factory):
    """One member: TLS with client certificates required, and etcd auth on (user root, password SECRET)."""
    with EtcdCluster(tmp_path_factory.mktemp("etcd-secure"), size=1, tls=True) as running:
        running.enable_auth(SECRET)
        yield running


@pytest.fixture
def configure_secure(settings, secure_cluster, prefix):
    def configure_alias(**options):
        full = {"ENDPOINTS": secure_cluster.endpoints, "KEY_PREFIX": prefix, **secure_cluster.tls_options(),
                "USER": "root", "PASSWORD": SECRET}
        full.update(options)
        settings.DISTLOCK = {**settings.DISTLOCK, "etcd_secure": {
            "BACKEND": BACKEND, "OPTIONS": {key: value for key, value in full.items() if value is not None}}}
        return "etcd_secure"

    return configure_alias


def test_a_lock_round_trip_over_tls_with_auth(configure_secure, secure_cluster, prefix, lock_name):
    alias = configure_secure()
    with distlock.lock(lock_name, ttl=10, using=alias) as lease:
        assert [info.owner for info in locks[alias].held_locks(lock_name)] == [lease.owner]
        assert len(secure_cluster.keys(prefix.encode())) == 1
        assert lease.extend() is True
    assert secure_cluster.keys(prefix.encode()) == []


@pytest.mark.parametrize("ca", ["wrong", "missing"])
def test_a_wrong_or_missing_ca_is_backend_unavailable_naming_tls(configure_secure, secure_cluster, lock_name, ca):
    ca_cert = str(secure_cluster.pki.other_ca) if ca == "wrong" else None  # missing: the system's CAs
    alias = configure_secure(CA_CERT=ca_cert, REQUEST_TIMEOUT=1)
    started = time.monotonic()
    with pytest.raises(distlock.BackendUnavailable, match="TLS handshake failed") as excinfo:
        distlock.acquire(lock_name, ttl=10, using=alias)
    assert time.monotonic() - started < 5
    assert "CA_CERT" in str(excinfo.value) and SECRET not in str(excinfo.value)


def test_a_wrong_password_is_backend_unavailable_without_the_password(configure_secure, lock_name, caplog):
    wrong = SECRET + "-wrong"
    alias = configure_secure(PASSWORD=wrong)
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(distlock.BackendUnavailable, match="etcd refused to authenticate USER 'root'") as excinfo:
            distlock.acquire(lock_name, ttl=10, using=alias)
    message = str(excinfo.value)
    assert "check USER and PASSWORD" in message
    for secret in (wrong, SECRET):
        assert secret not in message and secret not in caplog.text
        assert secret not in repr(locks[alias]) and secret not in repr(locks[alias]._connection.security)


def test_no_credentials_on_an_auth_cluster_is_backend_unavailable(configure_secure, lock_name):
    alias = configure_secure(USER=None, PASSWORD=None, REQUEST_TIMEOUT=1)
    with pytest.raises(distlock.BackendUnavailable, match=r"^Lock alias 'etcd_secure' \(etcd\) could not acquire lock "):
        distlock.acquire(lock_name, ttl=10, using=alias)


@pytest.mark.parametrize("value", [b"bytes-" + SECRET.encode(), "", 12345])
def test_a_bad_password_option_never_shows_its_value(value):
    with pytest.raises(ImproperlyConfigured, match="PASSWORD") as excinfo:
        EtcdBackend("e", {"USER": "root", "PASSWORD": value})
    assert SECRET not in str(excinfo.value) and "12345" not in str(excinfo.value)
    assert "not shown" in str(excinfo.value)


@pytest.mark.parametrize(("options", "warned"), [
    ({}, "without TLS and without auth"),
    ({"USER": "root", "PASSWORD": SECRET}, "password and the auth token cross the network in clear text"),
    ({"CA_CERT": "/etc/etcd/ca.pem"}, None),
    ({"ENDPOINTS": "https://etcd-1:2379", "USER": "root", "PASSWORD": SECRET}, None),
])
def test_an_unsecured_alias_gets_a_system_check_warning_when_debug_is_off(settings, options, warned):
    from distlock.checks import W001, check_distlock_setting  # noqa: PLC0415

    settings.DISTLOCK = {**settings.DISTLOCK, "etcd_checked": {"BACKEND": BACKEND, "OPTIONS": options}}
    settings.DEBUG = False
    messages = [message for message in check_distlock_setting() if "'etcd_checked'" in message.msg]
    if warned is None:
        assert messages == []
    else:
        (message,) = messages
        assert message.id == W001 and warned in message.msg and SECRET not in message.msg
    settings.DEBUG = True
    assert [message for message in check_distlock_setting() if "'etcd_checked'" in message.msg] == []
