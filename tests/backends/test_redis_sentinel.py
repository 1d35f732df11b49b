"""The Redis backend behind Redis Sentinel: locks on the master the Sentinels name, the options, failover."""

import logging
import re
import threading
import time
import uuid

import pytest
from redis.sentinel import SentinelConnectionPool

import distlock
from distlock.checks import E004, E005, W001, check_distlock_setting
from distlock.handler import locks
from distlock.redaction import redact
from tests.faults.proxy import ReplicationProxy
from tests.fencing_app.models import Account
from tests.servers import free_port, wait_until
from tests.servers.redis import SentinelDeployment

#: The default database alone (the metrics recorder's and the worker processes'): the locks live in Redis,
#: and emptying PostgreSQL and the locks database after each test took 0.1–0.2 s a test.
pytestmark = pytest.mark.django_db(transaction=True, databases=["default"])

#: The password of the deployment's nodes and Sentinels: it must show in no message.
SECRET = "s3ntinel-Pa55"
BACKEND = "distlock.backends.redis.RedisBackend"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """A master, its replica and three Sentinels, each node behind a proxy that can stall its replication."""
    with SentinelDeployment(tmp_path_factory.mktemp("sentinel"), password=SECRET,
                            front=lambda port: ReplicationProxy(port).start()) as deployment:
        yield deployment


@pytest.fixture
def prefix():
    return f"sentinel-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def sentinel_alias(deployment, settings, prefix):
    """The alias 'sentinel' on the deployment's service, in a key prefix of its own."""
    settings.DISTLOCK = {**settings.DISTLOCK, "sentinel": {
        "BACKEND": BACKEND, "OPTIONS": deployment.options(KEY_PREFIX=prefix, REQUEST_TIMEOUT=1)}}
    return "sentinel"


def checked(settings, **aliases):
    """Return the system-check messages about ``aliases`` (name -> OPTIONS of a Redis alias)."""
    settings.DISTLOCK = {**settings.DISTLOCK, **{name: {"BACKEND": BACKEND, "OPTIONS": options}
                                                 for name, options in aliases.items()}}
    return [error for error in check_distlock_setting() if any(f"DISTLOCK['{name}']" in error.msg for name in aliases)]


# -- locks through the Sentinels ----------------------------------------------------------------------

def test_locks_are_taken_on_the_master_the_sentinels_name(deployment, sentinel_alias, prefix, lock_name):
    lease = distlock.acquire(lock_name, ttl=10, using=sentinel_alias)
    with deployment.master().client() as master:
        assert master.exists(f"{prefix}:lock:{lock_name}")
    with pytest.raises(distlock.LockNotAcquired):
        distlock.acquire(lock_name, blocking=False, using=sentinel_alias)
    assert lease.extend(20) and 19 < lease.remaining() <= 20
    (info,) = locks[sentinel_alias].held_locks(lock_name)
    assert (info.name, info.owner, info.token) == (lock_name, lease.owner, lease.token)
    locks[sentinel_alias].ping()
    assert isinstance(locks[sentinel_alias].pool, SentinelConnectionPool)
    assert lease.release() and not lease.release()
    again = distlock.acquire(lock_name, ttl=10, blocking=False, using=sentinel_alias)
    assert again.token > lease.token
    again.release()


def test_a_waiter_is_woken_by_the_release(sentinel_alias, lock_name):
    holder = distlock.acquire(lock_name, ttl=30, using=sentinel_alias)
    released_at = []

    def release_soon():
        time.sleep(0.3)
        released_at.append(time.monotonic())
        holder.release()

    thread = threading.Thread(target=release_soon)
    thread.start()
    waiter = distlock.acquire(lock_name, ttl=10, timeout=5, using=sentinel_alias)
    woke_at = time.monotonic()
    thread.join()
    assert 0 <= woke_at - released_at[0] < 0.5 and waiter.token > holder.token
    waiter.release()


def test_fenced_writes_refuse_the_older_token(sentinel_alias, lock_name):
    older = distlock.acquire(f"{lock_name}:a", ttl=30, using=sentinel_alias)
    newer = distlock.acquire(f"{lock_name}:b", ttl=30, using=sentinel_alias)
    assert older.token_is_safe
    account = Account.objects.create(balance=1)
    account.save(lease=newer)
    account.balance = 2
    with pytest.raises(distlock.StaleFencingToken):
        account.save(lease=older)
    assert Account.objects.get(pk=account.pk).fencing_token == newer.token
    older.release()
    newer.release()


def test_a_cache_alias_may_name_a_django_redis_cache_behind_sentinel(deployment, settings, prefix, lock_name):
    settings.CACHES = {**settings.CACHES, "sentinel": {
        "BACKEND": "django_redis.cache.RedisCache", "LOCATION": deployment.url,
        "OPTIONS": {"CLIENT_CLASS": "django_redis.client.SentinelClient",
                    "CONNECTION_FACTORY": "django_redis.pool.SentinelConnectionFactory",
                    "SENTINELS": deployment.sentinel_addresses, "SENTINEL_KWARGS": deployment.sentinel_kwargs}}}
    settings.DISTLOCK = {**settings.DISTLOCK, "cached": {"BACKEND": BACKEND, "OPTIONS": {
        "CACHE": "sentinel", "KEY_PREFIX": prefix}}}
    with distlock.lock(lock_name, ttl=10, using="cached"):
        with deployment.master().client() as master:
            assert master.exists(f"{prefix}:lock:{lock_name}")
    assert isinstance(locks["cached"].pool, SentinelConnectionPool)
    errors = checked(settings, own={**deployment.options(), "KEY_PREFIX": prefix})
    assert [error.id for error in errors] == [E005], "one service, db and prefix, through the cache or not"


def test_sentinels_that_do_not_answer_are_backend_unavailable_naming_the_service(settings):
    settings.DISTLOCK = {**settings.DISTLOCK, "down": {"BACKEND": BACKEND, "OPTIONS": {
        "URL": f"redis://:{SECRET}@orders/0", "SENTINELS": [("127.0.0.1", free_port()), ("127.0.0.1", free_port())],
        "SENTINEL_KWARGS": {"password": SECRET}, "REQUEST_TIMEOUT": 0.5}}}
    started = time.monotonic()
    with pytest.raises(distlock.BackendUnavailable) as failed:
        distlock.acquire("anything", ttl=5, timeout=1, using="down")
    assert time.monotonic() - started < 2
    message = str(failed.value)
    assert message.startswith("Lock alias 'down' (Redis Sentinel service 'orders') could not acquire lock 'anything': "
                              "No master found for 'orders'"), message
    assert "check the service name" in message and SECRET not in message


def test_a_wrong_sentinel_password_shows_in_no_message_repr_or_log(deployment, settings, caplog):
    caplog.set_level(logging.DEBUG)
    wrong = "wr0ng-Pa55"
    settings.DISTLOCK = {**settings.DISTLOCK, "wrong": {"BACKEND": BACKEND, "OPTIONS": deployment.options(
        SENTINEL_KWARGS={"password": wrong}, KEY_PREFIX="wrong")}}
    with pytest.raises(distlock.BackendUnavailable) as failed:
        distlock.acquire("anything", ttl=5, timeout=1, using="wrong")
    backend = locks["wrong"]
    shown = [str(failed.value), repr(failed.value), repr(backend), backend.label,
             *(record.getMessage() for record in caplog.records)]
    assert "AuthenticationError" in str(failed.value) or "auth" in str(failed.value).lower()
    assert not [text for text in shown if SECRET in text or wrong in text]


# -- options and system checks ------------------------------------------------------------------------

SENTINELS = [("10.0.0.1", 26379), ("10.0.0.2", 26379)]


@pytest.mark.parametrize(("options", "message"), [
    ({"URL": "redis://mymaster/0", "SENTINELS": []}, r"\['SENTINELS'\] must list at least one Sentinel"),
    ({"URL": "redis://mymaster/0", "SENTINELS": "10.0.0.1:26379"}, r"\['SENTINELS'\] must be a list of \(host, port\)"),
    ({"URL": "redis://mymaster/0", "SENTINELS": [("10.0.0.1",)]}, r"must hold \(host, port\) pairs"),
    ({"URL": "redis://mymaster/0", "SENTINELS": [("10.0.0.1", "26379")]}, "whose port is not a port number"),
    ({"URL": "redis://mymaster/0", "SENTINELS": SENTINELS, "SENTINEL_KWARGS": {"pasword": SECRET}},
     r"\['SENTINEL_KWARGS'\] has pasword, which redis-py's Redis\(\) does not take"),
    ({"URL": "redis://mymaster/0", "SENTINELS": SENTINELS, "SENTINEL_KWARGS": {"password": SECRET, "port": 1}},
     "sets port, which SENTINELS gives"),
    ({"URL": "redis://mymaster/0", "SENTINELS": SENTINELS,
      "SENTINEL_KWARGS": {"password": SECRET, "socket_timeout": None}}, "has socket_timeout None; it must be a number"),
    ({"URL": "redis://mymaster/0", "SENTINELS": SENTINELS, "SENTINEL_KWARGS": [("password", SECRET)]},
     r"\['SENTINEL_KWARGS'\] must be a dict"),
    ({"URL": "redis://10.0.0.5:6379/0", "SENTINELS": SENTINELS}, r"\['URL'\] gives a port, but with SENTINELS"),
    ({"URL": "unix:///run/redis.sock", "SENTINELS": SENTINELS}, r"\['URL'\] must be redis://<service_name>/<db>"),
    ({"URL": f"redis://:{SECRET}@/0", "SENTINELS": SENTINELS}, r"\['URL'\] names no Sentinel service"),
    ({"URL": "redis://mymaster/zero", "SENTINELS": SENTINELS}, "has db 'zero', which is not a number"),
    ({"URL": "redis://mymaster/0?ssl_cert_reqs=required", "SENTINELS": SENTINELS}, "is not a rediss:// URL"),
    ({"SENTINELS": SENTINELS}, "needs 'URL' naming the Sentinel service, redis://<service_name>/<db>"),
    ({"CACHE": "default", "SENTINELS": SENTINELS}, r"\['SENTINELS'\] cannot be combined with 'CACHE'"),
    ({"URL": "redis://10.0.0.5:6379/0", "SENTINEL_KWARGS": {"password": SECRET}},
     r"\['SENTINEL_KWARGS'\] is read only with 'SENTINELS'"),
    ({"URL": "redis://mymaster/0", "SENTINELS": SENTINELS, "REPLICAS_ACK": 0},
     r"\['REPLICAS_ACK'\] must be at least 1"),
    ({"URL": "redis://mymaster/0", "SENTINELS": SENTINELS, "REPLICAS_ACK": "1"},
     r"\['REPLICAS_ACK'\] must be a number of replicas"),
    ({"URL": "redis://mymaster/0", "SENTINELS": SENTINELS, "REPLICAS_ACK": 1, "REPLICAS_ACK_TIMEOUT": 0},
     r"\['REPLICAS_ACK_TIMEOUT'\] must be a finite number of seconds above zero"),
    ({"URL": "redis://mymaster/0", "SENTINELS": SENTINELS, "REPLICAS_ACK_TIMEOUT": 0.1},
     r"\['REPLICAS_ACK_TIMEOUT'\] is read only with 'REPLICAS_ACK'"),
])
def test_the_system_checks_name_the_alias_the_option_and_the_fix(settings, options, message):
    (error,) = checked(settings, bad=options)
    assert error.id == E004 and error.msg.startswith("DISTLOCK['bad']")
    assert re.search(message, error.msg), error.msg
    assert SECRET not in error.msg


def test_a_good_sentinel_alias_passes_the_checks_without_io(settings):
    options = {"URL": "rediss://locks:pw@MyMaster/2?ssl_ca_certs=/ca.crt", "SENTINELS": [["10.0.0.1", 26379]],
               "SENTINEL_KWARGS": {"password": "pw", "ssl": True, "socket_timeout": 0.5}}
    assert checked(settings, good=options) == []
    backend = locks["good"]  # built without I/O: nothing listens at 10.0.0.1
    assert backend.label == "Redis Sentinel service 'MyMaster'"


def test_two_aliases_on_one_service_and_prefix_are_refused(settings):
    options = {"URL": "redis://mymaster/0", "SENTINELS": SENTINELS, "KEY_PREFIX": "shared"}
    errors = checked(settings, one=options, two={**options, "SENTINELS": SENTINELS[:1]},
                     other_db={**options, "URL": "redis://mymaster/1"})
    (error,) = [error for error in errors if error.id != W001]
    assert error.id == E005 and "behind Sentinel service 'mymaster', db 0" in error.msg


def test_masters_and_sentinels_reached_without_tls_or_password_are_warned_about(settings):
    settings.DEBUG = False
    warnings = checked(settings, open={"URL": "redis://mymaster/0", "SENTINELS": SENTINELS, "KEY_PREFIX": "open"},
                       closed={"URL": "rediss://:pw@mymaster/0", "SENTINELS": SENTINELS, "KEY_PREFIX": "closed",
                               "SENTINEL_KWARGS": {"password": "pw"}})
    assert [warning.id for warning in warnings] == [W001, W001]
    masters, sentinels = (warning.msg for warning in warnings)
    assert masters.startswith("DISTLOCK['open']: the masters of Redis Sentinel service 'mymaster'")
    assert sentinels.startswith("DISTLOCK['open']: the Redis Sentinels 10.0.0.1:26379, 10.0.0.2:26379")


def test_a_password_in_sentinel_kwargs_is_redacted_wherever_a_dict_is_shown():
    shown = redact(repr({"password": SECRET, "socket_timeout": 1}))
    assert shown == "{'password': '***', 'socket_timeout': 1}"
    assert redact(f"Redis(sentinel_password={SECRET!r}, token: 34)") == "Redis(sentinel_password='***', token: 34)"


# -- REPLICAS_ACK -------------------------------------------------------------------------------------

@pytest.fixture
def acknowledged_alias(deployment, settings, prefix):
    """The alias 'acknowledged': grants and extensions are reported once the replica has them."""
    settings.DISTLOCK = {**settings.DISTLOCK, "acknowledged": {"BACKEND": BACKEND, "OPTIONS": deployment.options(
        KEY_PREFIX=prefix, REQUEST_TIMEOUT=1, REPLICAS_ACK=1, REPLICAS_ACK_TIMEOUT=0.2)}}
    return "acknowledged"


def test_with_replicas_ack_a_grant_is_reported_once_the_replica_has_it(deployment, acknowledged_alias, prefix,
                                                                      lock_name):
    lease = distlock.acquire(lock_name, ttl=10, using=acknowledged_alias)
    with deployment.replica().client() as replica:
        assert replica.exists(f"{prefix}:lock:{lock_name}"), "acknowledged, so the replica has it"
        assert lease.extend(20)
        assert 19_000 < replica.pttl(f"{prefix}:lock:{lock_name}") <= 20_000
    assert lease.release()


def test_with_replicas_ack_an_unacknowledged_grant_is_given_back_and_fails_closed(deployment, acknowledged_alias,
                                                                                  prefix, lock_name):
    held = distlock.acquire(f"{lock_name}:held", ttl=10, using=acknowledged_alias)
    master = deployment.master()
    deployment.proxies[master].stall_replication()
    try:
        started = time.monotonic()
        with pytest.raises(distlock.BackendUnavailable) as failed:
            distlock.acquire(lock_name, ttl=10, timeout=5, using=acknowledged_alias)
        assert 0.2 <= time.monotonic() - started < 1.5
        assert str(failed.value) == (
            "Lock alias 'acknowledged' (Redis Sentinel service 'distlock') could not acquire lock "
            f"'{lock_name}': 0 of the 1 replica(s) REPLICAS_ACK asks for acknowledged the grant within 0.2s "
            "(REPLICAS_ACK_TIMEOUT); it was given back.")
        with master.client() as client:
            assert not client.exists(f"{prefix}:lock:{lock_name}"), "the unacknowledged grant was given back"
        with pytest.raises(distlock.BackendUnavailable, match="acknowledged the extension"):
            held.extend()
    finally:
        deployment.proxies[master].heal()
    assert held.release()


# -- failover --------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_after_a_failover_locks_are_granted_on_the_promoted_replica_with_greater_tokens(
        deployment, sentinel_alias, prefix, lock_name):
    """The replica misses the last grant and token (its replication stalled): the token still goes up."""
    kept = distlock.acquire(f"{lock_name}:kept", ttl=60, using=sentinel_alias)
    wait_until(lambda: deployment.replica_behind() == 0, 10, "the replica catching up")
    master, replica = deployment.master(), deployment.replica()
    deployment.proxies[master].stall_replication()
    try:
        lost = distlock.acquire(f"{lock_name}:lost", ttl=60, using=sentinel_alias)
        assert deployment.replica_behind() > 0
        with replica.client() as client:
            assert not client.exists(f"{prefix}:lock:{lock_name}:lost")
            assert int(client.get(f"{prefix}:token")) < lost.token, "the replica must lack the latest token"
        promoted = deployment.fail_over()
    finally:
        deployment.proxies[master].heal()
    try:
        assert promoted is replica
        again = distlock.acquire(f"{lock_name}:lost", ttl=60, timeout=5, using=sentinel_alias)
        assert again.token > lost.token > kept.token, "the token must not go back with the unreplicated counter"
        with pytest.raises(distlock.LockNotAcquired):
            distlock.acquire(f"{lock_name}:kept", blocking=False, using=sentinel_alias)
        assert not lost.extend(), "the lost grant is gone from the promoted replica"
        assert kept.release() and again.release()
    finally:
        deployment.restore()


def test_a_master_demoted_by_a_manual_failover_hands_the_next_call_to_the_new_master(
        deployment, sentinel_alias, prefix, lock_name):
    """An idle connection to the old master meets READONLY; the call goes to the promoted replica instead."""
    before = distlock.acquire(lock_name, ttl=60, using=sentinel_alias)
    wait_until(lambda: deployment.replica_behind() == 0, 10, "the replica catching up")
    old = deployment.master()
    new = deployment.switch_over()
    assert new is not old and old.replication()["role"] == "slave"
    after = distlock.acquire(f"{lock_name}:after", ttl=60, blocking=False, using=sentinel_alias)
    assert after.token > before.token
    with new.client() as client:
        assert client.exists(f"{prefix}:lock:{lock_name}:after")
    assert before.release() and after.release()
