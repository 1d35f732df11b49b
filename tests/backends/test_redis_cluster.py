"""The Redis backend on a Redis Cluster (``CLUSTER``): keys in one slot per lock, tokens per name, every master listed.

Runs on the alias ``redis_cluster`` of the three-master cluster ``python -m tests.servers`` starts
(``rediscluster``); the contract suite and the fencing timelines run on it too.
"""

import os
import threading
import uuid
from urllib.parse import urlsplit

import pytest
import redis
from redis.crc import key_slot

import distlock
from distlock.backends import _redis_cluster
from distlock.checks import E004, check_distlock_setting
from distlock.handler import locks
from tests.conftest import long_only, require_alias
from tests.servers import wait_until
from tests.servers.redis import RedisClusterDeployment

pytestmark = pytest.mark.django_db(transaction=True, databases=["default"])

BACKEND = "distlock.backends.redis.RedisBackend"
SECRET = "c1uster-Pa55"


@pytest.fixture
def alias():
    return require_alias("redis_cluster")


def masters():
    """Return a redis-py client per master of the test cluster, by the lowest slot it serves, and the slots' owners."""
    seed = urlsplit(os.environ["DISTLOCK_TEST_REDIS_CLUSTER_URL"])
    with redis.Redis(host=seed.hostname, port=seed.port, socket_timeout=5) as client:
        ranges = sorted((start, end, int(node[1])) for start, end, node, *_ in client.execute_command("CLUSTER SLOTS"))
    return [(start, end, redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)) for start, end, port in ranges]


def master_of(name, nodes):
    """Return the client of the master that serves lock ``name``'s slot."""
    slot = key_slot(_redis_cluster.hash_tag(name).encode())
    return next(client for start, end, client in nodes if start <= slot <= end)


def names_on_every_master(base, nodes, per_master=1):
    """Return lock names ``<base>:<n>``, ``per_master`` of them on each master."""
    found = {id(client): [] for _, _, client in nodes}
    index = 0
    while any(len(names) < per_master for names in found.values()):
        name = f"{base}:{index}"
        index += 1
        names = found[id(master_of(name, nodes))]
        if len(names) < per_master:
            names.append(name)
    return sorted(name for names in found.values() for name in names)


def test_names_in_different_slots_on_different_masters_both_work(alias, lock_name):
    nodes = masters()
    assert len(nodes) == 3
    first, second = names_on_every_master(lock_name, nodes)[:2]
    assert master_of(first, nodes) is not master_of(second, nodes)
    prefix = locks[alias].settings["KEY_PREFIX"]
    with distlock.lock(first, ttl=10, using=alias) as a, distlock.lock(second, ttl=10, using=alias) as b:
        for name, lease in ((first, a), (second, b)):
            key = f"{prefix}:{_redis_cluster.hash_tag(name)}:lock:{name}"
            value = master_of(name, nodes).get(key)
            assert value.decode().startswith(lease.owner + "\n"), "the lock's key on its slot's master"
            with pytest.raises(distlock.LockNotAcquired):
                distlock.acquire(name, blocking=False, using=alias)
        assert a.extend(20) and b.extend(20)
    assert not locks[alias].held_locks(first) and not locks[alias].held_locks(second)
    for _, _, client in nodes:
        client.close()


def test_a_names_token_never_goes_back_across_release_and_expiry(alias, lock_name):
    tokens = []
    for _ in range(3):
        with distlock.lock(lock_name, ttl=10, using=alias) as lease:
            tokens.append(lease.token)
    expiring = distlock.acquire(lock_name, ttl=0.3, using=alias)
    tokens.append(expiring.token)
    wait_until(lambda: not locks[alias].held_locks(lock_name), 10, "the lock's expiry")
    taken_over = distlock.acquire(lock_name, ttl=10, blocking=False, using=alias)
    tokens.append(taken_over.token)
    taken_over.release()
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), tokens


def test_a_waiter_on_another_master_is_woken_by_the_release(alias, lock_name):
    """The waiter's queue and wake list lie in the lock's slot: the release's script reaches them."""
    holder = distlock.acquire(lock_name, ttl=30, using=alias)
    granted = []
    waiter = threading.Thread(target=lambda: granted.append(distlock.acquire(lock_name, ttl=30, timeout=20,
                                                                             using=alias)))
    waiter.start()
    prefix = locks[alias].settings["KEY_PREFIX"]
    queue = f"{prefix}:{_redis_cluster.hash_tag(lock_name)}:queue:{lock_name}"
    node = master_of(lock_name, masters())
    wait_until(lambda: node.zcard(queue) == 1, 10, "the waiter queueing")
    holder.release()
    waiter.join(20)
    (lease,) = granted
    assert lease.token > holder.token
    lease.release()


def test_listing_pages_through_every_master(alias, lock_name):
    nodes = masters()
    names = names_on_every_master(lock_name, nodes, per_master=3)
    leases = [distlock.acquire(name, ttl=30, using=alias) for name in names]
    try:
        backend = locks[alias]
        pages, cursor = [], None
        while True:
            page = backend.held_locks(f"{lock_name}:", limit=2, cursor=cursor)
            pages.append(page)
            cursor = page.cursor
            if cursor is None:
                break
            assert len(pages) < 20, "the cursors never end"
        listed = [info.name for page in pages for info in page]
        assert sorted(listed) == names, "every lock once, from every master"
        assert {info.token for page in pages for info in page} == {lease.token for lease in leases}
        assert len(pages) >= 3, "at least one page per master"
        assert sorted(info.name for info in backend.held_locks(f"{lock_name}:")) == names
    finally:
        for lease in leases:
            lease.release()
        for _, _, client in nodes:
            client.close()


@pytest.mark.parametrize("cursor", ["12", "16384:0", "1:x", ":", "0:18446744073709551616"])
def test_a_cursor_no_cluster_page_gave_is_refused_before_any_io(alias, cursor):
    with pytest.raises(ValueError, match="no page's"):
        locks[alias].held_locks("", cursor=cursor)


def test_extend_many_extends_locks_of_every_master_and_reports_the_lost_one(alias, lock_name):
    backend = locks[alias]
    names = names_on_every_master(lock_name, masters(), per_master=2)
    leases = [distlock.acquire(name, ttl=5, using=alias) for name in names]
    assert backend.release_owned(names[2], leases[2].owner)
    outcomes = backend.extend_many([(lease, 30) for lease in leases])
    assert outcomes == [index != 2 for index in range(len(names))]
    for info in backend.held_locks(f"{lock_name}:"):
        assert (info.expires_at - info.acquired_at).total_seconds() > 20
    for lease in leases:
        lease.release()


def test_a_stale_slot_map_is_corrected_by_moved(alias, lock_name):
    """A map that sends every slot to one master (as after a resharding it missed): MOVED, then the right master."""
    nodes = masters()
    name = next(name for name in names_on_every_master(lock_name, nodes) if master_of(name, nodes) is not nodes[0][2])
    connections = locks[alias]._get_connections()
    connections.refresh(5)
    wrong = ("127.0.0.1", nodes[0][2].connection_pool.connection_kwargs["port"])
    connections._map = ([0], [(0, _redis_cluster.SLOTS - 1, wrong)])
    with distlock.lock(name, ttl=10, using=alias) as lease:
        assert [info.owner for info in locks[alias].held_locks(name)] == [lease.owner]
    assert len(connections.masters(5)) == 3, "the map was read again"
    for _, _, client in nodes:
        client.close()


def checked(settings, **aliases):
    """Return the system-check messages about ``aliases`` (name -> OPTIONS of a Redis alias)."""
    settings.DISTLOCK = {**settings.DISTLOCK, **{name: {"BACKEND": BACKEND, "OPTIONS": options}
                                                 for name, options in aliases.items()}}
    return [error for error in check_distlock_setting() if any(f"DISTLOCK['{name}']" in error.msg for name in aliases)]


@pytest.mark.parametrize(("options", "words"), [
    ({"CLUSTER": True}, "needs 'URL' naming one node"),
    ({"CLUSTER": True, "CACHE": "default"}, "needs 'URL' naming one node"),
    ({"CLUSTER": True, "URL": f"redis://:{SECRET}@127.0.0.1:7000/0", "CACHE": "default"},
     "cannot be combined with 'CACHE'"),
    ({"CLUSTER": True, "URL": f"redis://:{SECRET}@127.0.0.1:7000/1"}, "on db 0"),
    ({"CLUSTER": True, "URL": "unix:///tmp/redis.sock"}, "over TCP"),
    ({"CLUSTER": True, "URL": "redis://127.0.0.1:7000/0", "KEY_PREFIX": "locks{a}"}, "must not contain '{'"),
    ({"CLUSTER": True, "URL": "redis://127.0.0.1:7000/0", "SENTINELS": [("127.0.0.1", 26379)]},
     "cannot be combined with 'SENTINELS'"),
    ({"CLUSTER": "yes", "URL": "redis://127.0.0.1:7000/0"}, "CLUSTER"),
])
def test_cluster_options_are_checked_without_io(settings, options, words):
    (error,) = checked(settings, cluster=options)
    assert error.id == E004 and words in error.msg, error.msg
    assert SECRET not in error.msg


def test_a_valid_cluster_alias_passes_the_checks_and_connects_to_nothing(settings):
    options = {"CLUSTER": True, "URL": f"redis://:{SECRET}@127.0.0.1:1/0", "KEY_PREFIX": f"c-{uuid.uuid4().hex}"}
    assert [error for error in checked(settings, cluster=options) if error.is_serious()] == []
    assert locks["cluster"].label == "Redis Cluster" and not locks["cluster"].tokens_grow_alias_wide
    with pytest.raises(distlock.BackendUnavailable) as failed:
        distlock.acquire("x", ttl=5, blocking=False, using="cluster")
    assert "Redis Cluster" in str(failed.value) and SECRET not in str(failed.value)


@pytest.mark.parametrize("name", ["}x", "{", "a{b}c", "{}", "x" * 200])
def test_every_key_of_a_lock_lies_in_one_slot_whatever_its_name(name):
    tag = _redis_cluster.hash_tag(name)
    keys = [f"p:{tag}:{kind}:{name}" for kind in ("lock", "queue", "alive")] + [f"p:{tag}:wake:{name}:owner",
                                                                                f"p:{tag}:token"]
    assert len({key_slot(key.encode()) for key in keys}) == 1


# -- a master fails over to its replica ----------------------------------------------------------------

@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    """A cluster of its own: three masters, each with a replica that replaces it 2 s after it stops answering."""
    with RedisClusterDeployment(tmp_path_factory.mktemp("cluster"), replicas=1) as deployment:
        yield deployment


@pytest.mark.slow
@long_only  # 11 s with its own 6-node cluster; the contract suite and the fencing timelines run in make test
def test_a_master_fails_over_to_its_replica_and_the_names_token_does_not_go_back(replicated, settings, lock_name):
    settings.DISTLOCK = {**settings.DISTLOCK, "failover": {"BACKEND": BACKEND, "OPTIONS": {
        "URL": f"redis://127.0.0.1:{replicated.nodes[0].port}/0", "CLUSTER": True, "REQUEST_TIMEOUT": 1}}}
    masters = [node for node in replicated.nodes if replicated.role(node) == "master"]
    with masters[0].client() as client:
        ranges = [(start, end, int(node[1])) for start, end, node, *_ in client.execute_command("CLUSTER SLOTS")]
    index = 0
    while True:  # a name on the master that will fail
        name, index = f"{lock_name}:{index}", index + 1
        slot = key_slot(_redis_cluster.hash_tag(name).encode())
        port = next(port for start, end, port in ranges if start <= slot <= end)
        if port == masters[0].port:
            break
    before = distlock.acquire(name, ttl=1, using="failover")
    replica = replicated.replica_of(masters[0])
    with masters[0].client() as client:
        written = client.info("replication")["master_repl_offset"]
    wait_until(lambda: replica.client().info("replication").get("slave_repl_offset", 0) >= written, 10,
               "the replica receiving the grant")

    replicated.fail_over(masters[0])
    with pytest.raises(distlock.BackendUnavailable, match=r"^Lock alias 'failover' \(Redis Cluster\)"):
        distlock.acquire(name, ttl=10, blocking=False, using="failover")  # the old master: nothing waits
    after = distlock.acquire(name, ttl=10, timeout=10, using="failover")  # the promoted replica, once `before` expired
    assert after.token > before.token
    assert before.release() is False
    assert after.release() is True


def test_a_lock_whose_slot_moves_to_another_master_is_extended_listed_and_released(alias, lock_name):
    """A resharding moves the lock's slot while it is held: ASK while it migrates, MOVED once it has moved.

    While the slot migrates, a script whose keys are split between the two masters is refused
    (``TRYAGAIN``): an acquire fails closed.
    """
    nodes = masters()
    source = master_of(lock_name, nodes)
    target = next(client for _, _, client in nodes if client is not source)
    target_port = target.connection_pool.connection_kwargs["port"]
    slot = key_slot(_redis_cluster.hash_tag(lock_name).encode())
    node_id = {client: client.execute_command("CLUSTER MYID") for _, _, client in nodes}
    prefix = f"{locks[alias].settings['KEY_PREFIX']}:{_redis_cluster.hash_tag(lock_name)}"
    lease = distlock.acquire(lock_name, ttl=10, using=alias)
    target.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", node_id[source])
    source.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", node_id[target])
    moved = False
    try:
        source.execute_command("MIGRATE", "127.0.0.1", target_port, f"{prefix}:lock:{lock_name}", 0, 5000)
        assert lease.extend(20), "the source answers ASK: the extension runs on the target"
        with target.pipeline(transaction=False) as pipe:
            _, pttl = pipe.execute_command("ASKING").pttl(f"{prefix}:lock:{lock_name}").execute()
        assert 15000 < pttl <= 20000
        assert [info.token for info in locks[alias].held_locks(lock_name)] == [lease.token]
        with pytest.raises(distlock.BackendUnavailable, match="TRYAGAIN"):
            distlock.acquire(lock_name, ttl=10, blocking=False, using=alias)

        source.execute_command("MIGRATE", "127.0.0.1", target_port, f"{prefix}:token", 0, 5000)
        for _, _, client in nodes:
            client.execute_command("CLUSTER SETSLOT", slot, "NODE", node_id[target])
        moved = True
        assert lease.release() is True, "the source answers MOVED: the release runs on the target"
        again = distlock.acquire(lock_name, ttl=10, blocking=False, using=alias)
        assert again.token > lease.token, "the tag's counter moved with the slot"
        assert target.exists(f"{prefix}:lock:{lock_name}") == 1
        again.release()
    finally:
        if not moved:
            for client in (source, target):
                client.execute_command("CLUSTER SETSLOT", slot, "STABLE")
        for _, _, client in nodes:
            client.close()
