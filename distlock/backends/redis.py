"""Locks on one Redis server or a Redis Cluster: tokens that survive a restart without persistence, fair hand-off.

Keys, under ``KEY_PREFIX`` (default ``distlock``), for a lock named ``N``:

- ``<prefix>:token``: the alias-wide token counter (no expiry).
- ``<prefix>:lock:N``: the lock, a string ``owner \\n token \\n acquired_us \\n {"host", "pid", "task_id"}``,
  written with ``SET NX PX ttl``; the holder metadata lives in the value so ``held_locks()`` reads it
  with the lock, in one ``GET``.
- ``<prefix>:queue:N``: sorted set of blocking waiters, owner -> arrival (server µs): the FIFO order.
- ``<prefix>:alive:N``: sorted set of the same waiters, owner -> expiry of their entry (server ms).
- ``<prefix>:wake:N:<owner>``: a waiter's private list; the release pushes one element to the head
  waiter's list, and that waiter alone is blocked on it in ``BLPOP``.

Fair hand-off: a free lock goes to the head of the queue, or to anyone when no live waiter queues.
A releaser that comes straight back therefore queues behind the others instead of racing the
waiter it just woke (with python-redis-lock and redis-py's ``Lock`` nothing stops it from winning
again and again).
Waiters refresh their entry on every attempt, at least every ``WAITER_REFRESH`` seconds; a waiter
that dies stops refreshing and its entry expires after ``WAITER_TTL``, so it delays the others by at
most that long and never blocks them.

Assumptions, said plainly: this is one Redis instance, or with ``CLUSTER`` a Redis Cluster. There
every key of lock ``N`` carries its hash tag, ``<prefix>:{xxxx}:lock:N`` and so on, wake keys included
(the scripts build those from the wake-key prefix, in the same slot), and ``<prefix>:{xxxx}:token``
replaces the alias-wide counter: tokens grow per name (``_redis_cluster``). A restart without
persistence loses the locks (a second holder may get one at once: use ``FencedModel``) but never the
token order, as long as the server clock does not step back.

With ``SENTINELS`` the instance is whichever master Redis Sentinel names for the service, asked
again on every new connection, so after a failover the locks are taken on the promoted replica.
Replication is asynchronous: a grant the replica had not received is lost with the old master, and
the lock is granted a second time (use ``FencedModel``). The token still does not go back, because
the promoted replica's clock has moved on past every token the old master issued, as long as the
two clocks differ by less than the failover takes (at least Sentinel's ``down-after-milliseconds``).
``REPLICAS_ACK`` reports a grant or an extension only once that many replicas acknowledged it
(``WAIT``), which narrows that window but does not close it: Redis stays asynchronous.
"""

import bisect
import collections
import inspect
import logging
import math
import threading
import time
from datetime import datetime, timedelta, timezone

import redis
import redis.backoff
import redis.retry
import redis.sentinel
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from distlock.backends import _redis, _redis_cluster
from distlock.backends.base import (
    NOTIFICATIONS, SAFE_FENCING_TOKENS, BaseLockBackend, Grant, LockPage, check_page, operation_words,
)
from distlock.backends.deadlines import request_seconds
from distlock.backends.offload import Abandoned
from distlock.backends.options import Option, positive_count, positive_number
from distlock.backends.redis_servers import (
    SENTINEL_URL_SHAPE,
    redis_server,
    sentinel_kwargs_problem,
    sentinel_kwargs_shown,
    sentinel_service,
    sentinel_url_problem,
    sentinels_problem,
    unsecured,
    unsecured_sentinels,
    url_problem,
)
from distlock.exceptions import BackendUnavailable, LockNotAcquired
from distlock.holder import holder_record, read_holder_record
from distlock.redaction import redact

logger = logging.getLogger(__name__)

__all__ = ["RedisBackend"]

# Shared by the scripts below, after ``_redis.LUA_CLOCK``. The uncontended path reads no queue beyond
# one EXISTS: a queue key exists only while somebody waits.
#
# held_by: whether the lock value ``value`` (or nil) is ``owner``'s.
# prune: drop the waiters whose entry expired (they died, or gave up without saying so), 100 at a
#   time so a script never unpacks an unbounded list; return how many it dropped.
# wake: give waiter ``owner`` at most one pending wake-up; it expires with the waiter's entry.
# head: the first waiter in FIFO order, or nil.
# wake_head: after the lock was freed, wake the first live waiter, if anybody queues.
_LUA_HELPERS = """
local function held_by(value, owner)
  return value and string.sub(value, 1, #owner + 1) == owner .. '\\n'
end

local function prune(queue, alive, now_ms)
  local dead = redis.call('ZRANGEBYSCORE', alive, '-inf', now_ms, 'LIMIT', 0, 100)
  if #dead > 0 then
    redis.call('ZREM', queue, unpack(dead))
    redis.call('ZREM', alive, unpack(dead))
  end
  return #dead
end

local function wake(wake_prefix, owner, waiter_ttl)
  local key = wake_prefix .. owner
  if redis.call('LLEN', key) == 0 then
    redis.call('LPUSH', key, '1')
  end
  redis.call('PEXPIRE', key, waiter_ttl)
end

local function head(queue)
  return redis.call('ZRANGE', queue, 0, 0)[1]
end

local function wake_head(queue, alive, wake_prefix, waiter_ttl)
  if redis.call('EXISTS', queue) == 1 then
    local _, now_ms = clock()
    prune(queue, alive, now_ms)
    local first = head(queue)
    if first then
      wake(wake_prefix, first, waiter_ttl)
    end
  end
end
"""
_HELPERS = (_redis.LUA_CLOCK, _LUA_HELPERS)

# Acquire, in one round trip.
# KEYS: 1 lock, 2 token counter, 3 queue, 4 alive, 5 wake-key prefix (``<prefix>:wake:N:``).
# ARGV: 1 owner, 2 ttl in ms, 3 holder metadata (JSON), 4 '1' to queue up if not granted (blocking),
#       5 waiter entry ttl in ms.
# Invariants: the lock is taken only with ``SET NX PX``, and only by the head of the queue or when no
#   live waiter queues (fair hand-off). The token is max(counter + 1, server time in µs): greater than
#   every earlier token even after a restart without persistence lost the counter, as long as the
#   server clock has not stepped back. A blocking caller that is not granted holds a place in the
#   queue, refreshed on every attempt. Whoever drops dead waiters while the lock is free wakes the
#   new head, since no release will. Running the script twice for one owner (a command re-sent after
#   its reply was lost) reports the first grant again instead of waiting for itself, and sets its ttl
#   anew: a write, so a WAIT on the new connection (``REPLICAS_ACK``) counts the replicas that have it.
# Returns: {1, token, acquired_us} granted; {0, ms} not granted, retry within ms at the latest (the
#   holder's remaining ttl, or how long the head waiter's entry has left to live).
ACQUIRE = _redis.Script("acquire", """
local owner, waiter_ttl = ARGV[1], tonumber(ARGV[5])
local now_us, now_ms = clock()
local function queue_up()
  if ARGV[4] == '1' then
    redis.call('ZADD', KEYS[3], 'NX', now_us, owner)
    redis.call('ZADD', KEYS[4], now_ms + waiter_ttl, owner)
    redis.call('PEXPIRE', KEYS[3], waiter_ttl)
    redis.call('PEXPIRE', KEYS[4], waiter_ttl)
  end
end

local current = redis.call('GET', KEYS[1])
if held_by(current, owner) then
  local token, acquired = string.match(current, '\\n(%d+)\\n(%d+)\\n')
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, tonumber(token), tonumber(acquired)}
elseif current then
  queue_up()
  return {0, redis.call('PTTL', KEYS[1])}
end

local queued = redis.call('EXISTS', KEYS[3]) == 1
if queued then
  local dropped = prune(KEYS[3], KEYS[4], now_ms)
  local first = head(KEYS[3])
  if first and first ~= owner then
    queue_up()
    if dropped > 0 then
      wake(KEYS[5], first, waiter_ttl)
    end
    return {0, tonumber(redis.call('ZSCORE', KEYS[4], first)) - now_ms}
  end
end

local token = math.max(tonumber(redis.call('GET', KEYS[2]) or '0') + 1, now_us)
local token_text = string.format('%d', token)
local value = owner .. '\\n' .. token_text .. '\\n' .. string.format('%d', now_us) .. '\\n' .. ARGV[3]
redis.call('SET', KEYS[1], value, 'NX', 'PX', ARGV[2])
redis.call('SET', KEYS[2], token_text)
if queued then
  redis.call('ZREM', KEYS[3], owner)
  redis.call('ZREM', KEYS[4], owner)
  redis.call('DEL', KEYS[5] .. owner)
end
return {1, token, now_us}
""", helpers=_HELPERS)

# Release (compare-and-delete), also the operator's release.
# KEYS: 1 lock, 2 queue, 3 alive, 4 wake-key prefix. ARGV: 1 owner, 2 waiter entry ttl in ms.
# Invariant: deletes the lock only while ``owner`` holds it, never another holder's; then wakes the
#   live head of the queue, the only waiter the lock may go to.
# Returns: 1 deleted, 0 not held by ``owner`` (released already, expired, or taken over).
RELEASE = _redis.Script("release", """
if not held_by(redis.call('GET', KEYS[1]), ARGV[1]) then
  return 0
end
redis.call('DEL', KEYS[1])
wake_head(KEYS[2], KEYS[3], KEYS[4], ARGV[2])
return 1
""", helpers=_HELPERS)

# Extend (compare-and-extend), for renewal.
# KEYS: 1 lock. ARGV: 1 owner, 2 ttl in ms.
# Invariant: moves the expiry only while ``owner`` holds the lock; a lost lock stays lost.
# Returns: 1 extended, 0 not held by ``owner``.
EXTEND = _redis.Script("extend", """
if not held_by(redis.call('GET', KEYS[1]), ARGV[1]) then
  return 0
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
""", helpers=_HELPERS)

# Extend many locks (compare-and-extend each), for the renewal scheduler: one run per chunk of locks,
# every chunk of a round in one round trip.
# KEYS: the locks. ARGV: for each lock in turn, its owner and its ttl in ms.
# Invariant: EXTEND's, for each lock on its own.
# Returns: for each lock, 1 extended, 0 not held by its owner.
EXTEND_MANY = _redis.Script("extend_many", """
local extended = {}
for index, key in ipairs(KEYS) do
  if held_by(redis.call('GET', key), ARGV[2 * index - 1]) then
    redis.call('PEXPIRE', key, ARGV[2 * index])
    extended[index] = 1
  else
    extended[index] = 0
  end
end
return extended
""", helpers=_HELPERS)

# Leave the queue: a blocking acquire that timed out gives its place up at once instead of
# blocking a free lock until its entry expires.
# KEYS: 1 lock, 2 queue, 3 alive, 4 wake-key prefix. ARGV: 1 owner, 2 waiter entry ttl in ms.
# Invariant: if the caller headed the queue of a free lock, the next live waiter is woken.
# Returns: 1 if the caller was queued, else 0.
LEAVE = _redis.Script("leave", """
redis.call('DEL', KEYS[4] .. ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
if redis.call('ZREM', KEYS[2], ARGV[1]) == 0 then
  return 0
end
if redis.call('EXISTS', KEYS[1]) == 0 then
  wake_head(KEYS[2], KEYS[3], KEYS[4], ARGV[2])
end
return 1
""", helpers=_HELPERS)

#: Seconds a waiter's queue entry lives without a refresh: how long a waiter that died can delay the others.
WAITER_TTL = 2.0
_WAITER_TTL_MS = int(WAITER_TTL * 1000)
#: Longest a waiter blocks before it refreshes its entry by trying again.
WAITER_REFRESH = WAITER_TTL / 3
#: Keys fetched per ``SCAN`` round trip in ``held_locks()``.
SCAN_COUNT = 500
#: Locks per EXTEND_MANY run: a script blocks the server while it runs, so a round of many is cut in chunks.
EXTEND_MANY_CHUNK = 500
#: Most idle connections an alias with its own pool (``URL``) keeps between calls; more go back to
#: the pool. A ``CACHE`` alias keeps none: the cache's pool gets every connection back after each call.
MAX_IDLE = 8

#: The options a ``CACHE`` alias leaves to its cache, by their django-redis names there.
_CACHE_OWNS = {"REQUEST_TIMEOUT": "SOCKET_TIMEOUT", "SOCKET_CONNECT_TIMEOUT": "SOCKET_CONNECT_TIMEOUT"}


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


def _scan_cursor(cursor):
    """Return the ``SCAN`` cursor a page's ``cursor`` stands for (0: the first page); ``ValueError`` if no page gave it.

    Checked before any I/O: the server would refuse a cursor past 64 bits as an error reply, and a
    cursor from a URL (the admin page) is the caller's input, not a failure of the server.
    """
    if not cursor:
        return 0
    if not (cursor.isascii() and cursor.isdigit()) or int(cursor) >= 2**64:
        raise ValueError(f"cursor {cursor!r} is no page's: a SCAN cursor is a decimal number below 2**64")
    return int(cursor)


class RedisBackend(BaseLockBackend):
    """Locks on a single Redis server: one script round trip per acquire and per release.

    Options: ``URL`` (a redis:// URL) or ``CACHE`` (the alias of a django-redis cache in ``CACHES``,
    whose connection pool is reused; its socket timeouts then come from that cache), ``KEY_PREFIX``,
    ``REQUEST_TIMEOUT`` and ``SOCKET_CONNECT_TIMEOUT`` (seconds, with ``URL`` only).

    Redis Cluster: ``URL`` names one node (``RedisCluster.from_url``'s form) and ``CLUSTER`` is True;
    tokens then grow per lock name, not alias-wide.

    Redis Sentinel, in django-redis's words: ``URL`` names the service, ``redis://<service_name>/<db>``
    (its password is the masters'), ``SENTINELS`` lists the Sentinels as ``(host, port)`` pairs and
    ``SENTINEL_KWARGS`` holds redis-py's keyword arguments for them (their password, TLS, timeouts).

    ``REPLICAS_ACK``: report a grant or an extension only once that many replicas acknowledged it
    (``WAIT``, within ``REPLICAS_ACK_TIMEOUT`` seconds); fewer is ``BackendUnavailable``, and a grant
    is given back first.

    TLS and ACL users are the URL's, as redis-py's ``from_url`` reads them:
    ``rediss://user:password@host:port/db?ssl_ca_certs=/ca.crt&ssl_certfile=...&ssl_keyfile=...&ssl_cert_reqs=required``.

    Every request is bounded in time (``REQUEST_TIMEOUT``, cut to the caller's deadline while
    waiting), so a server that is down or frozen gives ``BackendUnavailable``, never a hang.
    """

    label = "Redis"
    capabilities = frozenset({SAFE_FENCING_TOKENS, NOTIFICATIONS})
    client_errors = _redis.CLIENT_ERRORS
    renamed_options = {"SOCKET_TIMEOUT": "REQUEST_TIMEOUT"}

    options = {
        "URL": Option(str, None, check=url_problem, expected="a redis:// URL"),
        "CACHE": Option(str, None, expected="the alias of a django-redis cache in CACHES"),
        "KEY_PREFIX": _redis.KEY_PREFIX_OPTION,
        "REQUEST_TIMEOUT": Option((int, float), None, check=positive_number, expected="a number of seconds"),
        "SOCKET_CONNECT_TIMEOUT": Option((int, float), None, check=positive_number,
                                         expected="a number of seconds"),
        "SENTINELS": Option((list, tuple), None, check=sentinels_problem,
                            expected="a list of (host, port) pairs, one per Redis Sentinel"),
        "SENTINEL_KWARGS": Option(dict, None, check=sentinel_kwargs_problem, shown=sentinel_kwargs_shown,
                                  expected="a dict of redis-py keyword arguments for the Sentinels"),
        "CLUSTER": Option(bool, False),
        "REPLICAS_ACK": Option(int, None, check=positive_count, expected="a number of replicas"),
        "REPLICAS_ACK_TIMEOUT": Option((int, float), None, check=positive_number, expected="a number of seconds"),
    }

    #: ``REQUEST_TIMEOUT`` and ``SOCKET_CONNECT_TIMEOUT`` of a ``URL`` alias that leaves them out (seconds).
    default_request_timeout = 2.0
    default_socket_connect_timeout = 2.0
    #: ``REPLICAS_ACK_TIMEOUT`` of an alias with ``REPLICAS_ACK`` that leaves it out (seconds).
    default_replicas_ack_timeout = 0.1

    @classmethod
    def check_combination(cls, alias, options):
        where = f"DISTLOCK['{alias}']['OPTIONS']"
        if options["REPLICAS_ACK_TIMEOUT"] is not None and options["REPLICAS_ACK"] is None:
            raise ImproperlyConfigured(
                f"{where}['REPLICAS_ACK_TIMEOUT'] is read only with 'REPLICAS_ACK'; set how many replicas must "
                "acknowledge each grant as 'REPLICAS_ACK', or leave REPLICAS_ACK_TIMEOUT out."
            )
        if options["CLUSTER"] and (options["SENTINELS"] is not None or options["SENTINEL_KWARGS"] is not None):
            raise ImproperlyConfigured(
                f"{where}['CLUSTER'] cannot be combined with 'SENTINELS' or 'SENTINEL_KWARGS': a Redis Cluster fails "
                "over by itself; leave the Sentinel options out, or CLUSTER for a Sentinel service.")
        if options["SENTINELS"] is not None or options["SENTINEL_KWARGS"] is not None:
            cls._check_sentinel_combination(where, options)
            return
        if options["CLUSTER"]:
            cls._check_cluster_combination(where, options)
            return
        if (options["URL"] is None) == (options["CACHE"] is None):
            raise ImproperlyConfigured(
                f"{where} needs exactly one of 'URL' (a redis:// URL) or 'CACHE' (the alias of a django-redis "
                f"cache in CACHES), got {'both' if options['URL'] else 'neither'}."
            )
        cache = options["CACHE"]
        if cache is None:
            return
        for name, cache_name in _CACHE_OWNS.items():
            if options[name] is not None:
                raise ImproperlyConfigured(
                    f"{where}['{name}'] cannot be combined with 'CACHE': the pool belongs to the cache; "
                    f"set CACHES['{cache}']['OPTIONS']['{cache_name}'] instead."
                )
        caches = getattr(settings, "CACHES", {})
        if cache not in caches:
            raise ImproperlyConfigured(
                f"{where}['CACHE'] names the cache '{cache}', which is not in settings.CACHES "
                f"(configured: {', '.join(map(repr, caches)) or 'none'})."
            )

    @staticmethod
    def _check_sentinel_combination(where, options):
        """Raise ``ImproperlyConfigured`` unless ``SENTINELS`` comes with a service ``URL`` and nothing of ``CACHE``."""
        if options["SENTINELS"] is None:
            raise ImproperlyConfigured(
                f"{where}['SENTINEL_KWARGS'] is read only with 'SENTINELS'; add the Sentinels' (host, port) pairs "
                "as 'SENTINELS', or leave SENTINEL_KWARGS out."
            )
        if options["CACHE"] is not None:
            raise ImproperlyConfigured(
                f"{where}['SENTINELS'] cannot be combined with 'CACHE': give the Sentinel service as "
                f"'URL' ({SENTINEL_URL_SHAPE}), or leave the Sentinels to the cache's OPTIONS."
            )
        url = options["URL"]
        if url is None:
            raise ImproperlyConfigured(
                f"{where} needs 'URL' naming the Sentinel service, {SENTINEL_URL_SHAPE}, with 'SENTINELS'."
            )
        problem = sentinel_url_problem(url)
        if problem:
            raise ImproperlyConfigured(f"{where}['URL'] {problem}, got {redact(repr(url))}.")

    @staticmethod
    def _check_cluster_combination(where, options):
        """Raise ``ImproperlyConfigured`` unless ``CLUSTER`` has a node's ``URL`` on db 0 and a brace-free prefix."""
        if options["URL"] is None:
            raise ImproperlyConfigured(
                f"{where}['CLUSTER'] needs 'URL' naming one node of the cluster (redis://host:port/0), from which "
                "the backend learns the others" + (", not 'CACHE'." if options["CACHE"] is not None else "."))
        if options["CACHE"] is not None:
            raise ImproperlyConfigured(
                f"{where}['CLUSTER'] cannot be combined with 'CACHE': give one node of the cluster as 'URL'.")
        if options["URL"].startswith("unix://") or redis_server(options["URL"])[-1] != 0:
            raise ImproperlyConfigured(
                f"{where}['URL'] must name a cluster node over TCP on db 0 (a Redis Cluster has no other db): "
                f"redis://host:port/0, got {redact(repr(options['URL']))}.")
        if set("{}") & set(options["KEY_PREFIX"]):
            raise ImproperlyConfigured(
                f"{where}['KEY_PREFIX'] must not contain '{{' or '}}' with 'CLUSTER': Redis Cluster would read them "
                f"as the hash tag that puts a lock's keys in one slot, got {options['KEY_PREFIX']!r}.")

    @classmethod
    def key_spaces(cls, alias, options):
        sentinels, _ = cls._sentinels(options)
        identify = redis_server if sentinels is None else sentinel_service
        return [(identify(url), options["KEY_PREFIX"]) for url in cls._server_urls(options)]

    @classmethod
    def security_warnings(cls, alias, options):
        """Warn about each server this alias reaches over the network with neither TLS nor a password."""
        password = None
        if options["CACHE"] is not None:
            cache_options = settings.CACHES.get(options["CACHE"], {}).get("OPTIONS", {})
            password = cache_options.get("PASSWORD") or cache_options.get("CONNECTION_POOL_KWARGS", {}).get("password")
        sentinels, sentinel_kwargs = cls._sentinels(options)
        if sentinels is None:
            messages = (unsecured(url, password=password) for url in cls._server_urls(options))
            return [message for message in messages if message]
        messages = [
            f"the masters of Redis Sentinel service {sentinel_service(url)[1]!r} are reached with neither TLS nor "
            "a password: anyone who can connect to them can take, release or delete every lock. Use a rediss:// "
            "URL (with ssl_ca_certs=... in its query) and an ACL user: rediss://user:password@<service_name>/<db>."
            for url in cls._server_urls(options) if unsecured(url, password=password)]
        messages.append(unsecured_sentinels(sentinels, sentinel_kwargs))
        return [message for message in messages if message]

    @staticmethod
    def _sentinels(options):
        """Return the ``SENTINELS`` and ``SENTINEL_KWARGS`` of the alias or of its cache; (None, {}) without Sentinels.

        A django-redis cache's are used only if they are valid (django-redis itself would refuse the others).
        """
        if options["CACHE"] is None:
            return options["SENTINELS"], options["SENTINEL_KWARGS"] or {}
        cache_options = settings.CACHES.get(options["CACHE"], {}).get("OPTIONS", {})
        sentinels, kwargs = cache_options.get("SENTINELS"), cache_options.get("SENTINEL_KWARGS") or {}
        if sentinels is None or sentinels_problem(sentinels) or not isinstance(kwargs, dict):
            return None, {}
        return sentinels, kwargs

    @staticmethod
    def _server_urls(options):
        """Return the URLs of the servers the alias uses: its ``URL``, or its cache's ``LOCATION``."""
        if options["URL"] is not None:
            return [options["URL"]]
        location = settings.CACHES.get(options["CACHE"], {}).get("LOCATION", [])
        return [location] if isinstance(location, str) else list(location)

    def __init__(self, alias, options):
        super().__init__(alias, options)
        prefix = self.settings["KEY_PREFIX"]
        self._prefix = prefix
        self._token_key = f"{prefix}:token"
        self._lock_prefix = f"{prefix}:lock:"
        self._connections = None
        self._connections_lock = threading.Lock()
        self._cluster = self.settings["CLUSTER"]
        if self.settings["SENTINELS"] is not None:
            self.label = f"Redis Sentinel service {sentinel_service(self.settings['URL'])[1]!r}"
        if self._cluster:
            self.label = "Redis Cluster"
            #: One token counter per hash tag (``_redis_cluster``): tokens grow per lock name, not alias-wide.
            self.tokens_grow_alias_wide = False
            self._watch_tokens = False
        self._replicas_ack = self.settings["REPLICAS_ACK"]
        self._ack_timeout = self.settings["REPLICAS_ACK_TIMEOUT"] or self.default_replicas_ack_timeout

    # -- connections and errors -----------------------------------------------------------------

    @property
    def pool(self):
        """The redis-py connection pool: built from ``URL``, or the ``CACHE``'s own pool, on first use."""
        return self._get_connections().pool

    def _get_connections(self):
        if self._connections is None:
            with self._connections_lock:
                if self._connections is None:
                    if self.settings["SENTINELS"] is not None:
                        self._connections = self._sentinel_connections()
                    elif self._cluster:
                        self._connections = self._cluster_connections()
                    else:
                        self._connections = _Connections(self._make_pool(), owned=self.settings["URL"] is not None)
        return self._connections

    def _timeouts(self):
        """Return the socket timeout (``REQUEST_TIMEOUT``) and connect timeout of an alias with a pool of its own."""
        return (self.settings["REQUEST_TIMEOUT"] or self.default_request_timeout,
                self.settings["SOCKET_CONNECT_TIMEOUT"] or self.default_socket_connect_timeout)

    def _sentinel_connections(self):
        """Return connections to the master of the ``URL``'s Sentinel service (redis-py's ``SentinelConnectionPool``).

        Each new connection asks the Sentinels, in turn, for the master's address, so after a failover
        it reaches the promoted replica; idle connections to a master that went away fail on first use
        and are replaced (``_redis.exchange``), and one to a master demoted to a replica is dropped by
        redis-py on its ``READONLY`` reply. The Sentinels are asked with the same timeouts unless
        ``SENTINEL_KWARGS`` sets its own, and once each: asking the next Sentinel is the retry
        (redis-py 6 and later would retry each one three times, with back-off, by default).
        """
        timeout, connect = self._timeouts()
        url = self.settings["URL"]
        service = sentinel_service(url)[1]
        master_kwargs = redis.connection.parse_url(url)
        master_kwargs.pop("host", None)
        if master_kwargs.pop("connection_class", None) is redis.connection.SSLConnection:
            master_kwargs["ssl"] = True  # the pool picks its own, Sentinel-managed, TLS connection class
        sentinel = redis.sentinel.Sentinel(
            [tuple(pair) for pair in self.settings["SENTINELS"]],
            sentinel_kwargs={"socket_timeout": timeout, "socket_connect_timeout": connect,
                             "retry": redis.retry.Retry(redis.backoff.NoBackoff(), 0),
                             **(self.settings["SENTINEL_KWARGS"] or {})},
            socket_timeout=timeout, socket_connect_timeout=connect)
        pool = sentinel.master_for(service, **master_kwargs).connection_pool
        return _Connections(pool, owned=True, sentinels=sentinel.sentinels)

    def _cluster_connections(self):
        """Return connections to every master of the cluster the ``URL``'s node belongs to, made as each is first used.

        Every node is reached with the URL's user, password and TLS parameters (as redis-py's
        ``RedisCluster.from_url`` does), at the address the cluster gives for it.
        """
        timeout, connect = self._timeouts()
        url = self.settings["URL"]
        node_kwargs = redis.connection.parse_url(url)

        def make_connections(host, port):
            pool = redis.ConnectionPool(**{**node_kwargs, "host": host, "port": port}, socket_timeout=timeout,
                                        socket_connect_timeout=connect)
            return _Connections(pool, owned=True)

        return _redis_cluster.ClusterConnections((node_kwargs["host"], node_kwargs.get("port", 6379)),
                                                 make_connections, timeout)

    def _make_pool(self):
        if self.settings["URL"] is not None:
            timeout, connect = self._timeouts()
            return redis.ConnectionPool.from_url(self.settings["URL"], socket_timeout=timeout,
                                                 socket_connect_timeout=connect)
        from django_redis import get_redis_connection  # noqa: PLC0415 - only CACHE needs django-redis

        try:
            return get_redis_connection(self.settings["CACHE"]).connection_pool
        except NotImplementedError as exc:
            raise ImproperlyConfigured(
                f"DISTLOCK['{self.alias}']['OPTIONS']['CACHE'] names the cache '{self.settings['CACHE']}', "
                "which is not a django-redis cache (BACKEND 'django_redis.cache.RedisCache')."
            ) from exc

    def _request_seconds(self, deadline=None):
        """Seconds one request may take: the pool's socket timeout (``REQUEST_TIMEOUT``), cut to ``deadline``."""
        timeout = self._get_connections().socket_timeout
        if deadline is None:
            return timeout
        return request_seconds(timeout, deadline, minimum=_redis.MIN_REQUEST_SECONDS)

    def _cause(self, exc):
        return _redis.failure_cause(exc, self.settings["URL"])

    def _raise_error_reply(self, error, operation):
        """Raise the error reply ``error``, as ``RuntimeError`` unless the server cannot take locks now.

        A server that refuses because of its state (``refusal_code``: out of memory, read-only, ACL)
        is down for distlock, and ``translate_errors`` makes it ``BackendUnavailable``; any other
        error reply is a bug, or another program's key under our prefix.
        """
        if _redis.refusal_code(error) is not None:
            raise error
        raise RuntimeError(
            f"Redis refused distlock's request to {operation_words(operation)} on alias '{self.alias}': "
            f"{redact(error)}; is another program writing keys under KEY_PREFIX '{self._prefix}'?"
        ) from error

    def _execute(self, command, *, operation, timeout):
        """Return the reply to ``command``, waiting at most ``timeout`` seconds for it."""
        with self.translate_errors(operation):
            (reply,) = self._get_connections().exchange([command], timeout)
            if isinstance(reply, redis.ResponseError):
                self._raise_error_reply(reply, operation)
            return reply

    def _run(self, script, keys, args, *, operation, deadline=None):
        return self._execute(script.command(keys, args), operation=operation, timeout=self._request_seconds(deadline))

    def _run_acknowledged(self, script, keys, args, *, operation, written, deadline=None):
        """Return the reply of ``script`` and how many replicas acknowledged its write (None unless ``written(reply)``).

        ``WAIT`` goes on the connection that ran the script: it counts the replicas that have that
        connection's writes. Its reply may take ``REPLICAS_ACK_TIMEOUT`` more than a request.
        """
        wait = ("WAIT", self._replicas_ack, math.ceil(self._ack_timeout * 1000))
        with self.translate_errors(operation):
            reply, acknowledged = self._get_connections().exchange_acknowledged(
                script.command(keys, args), self._request_seconds(deadline), wait, self._ack_timeout, written)
            for answer in (reply, acknowledged):
                if isinstance(answer, redis.ResponseError):
                    self._raise_error_reply(answer, operation)
            return reply, acknowledged

    def _unacknowledged(self, operation, what, acknowledged, *, given_back=False):
        """Return the ``BackendUnavailable`` for a write fewer replicas than ``REPLICAS_ACK`` acknowledged."""
        return self.unavailable(operation, (
            f"{acknowledged} of the {self._replicas_ack} replica(s) REPLICAS_ACK asks for acknowledged {what} within "
            f"{self._ack_timeout:g}s (REPLICAS_ACK_TIMEOUT){'; it was given back' if given_back else ''}"))

    def _keys(self, name):
        """Return the lock, queue, alive and wake-prefix keys of lock ``name``.

        On a cluster each after the prefix and the name's hash tag, ``<prefix>:{xxxx}:lock:<name>``, so
        that they all lie in one slot.
        """
        prefix = self._prefix if not self._cluster else f"{self._prefix}:{_redis_cluster.hash_tag(name)}"
        return (f"{prefix}:lock:{name}", f"{prefix}:queue:{name}", f"{prefix}:alive:{name}",
                f"{prefix}:wake:{name}:")

    def _token_key_of(self, name):
        """Return the token counter lock ``name`` draws from: the alias's, or on a cluster its hash tag's."""
        return self._token_key if not self._cluster else f"{self._prefix}:{_redis_cluster.hash_tag(name)}:token"

    # -- acquiring ---------------------------------------------------------------------------------

    def _give_up(self, attempt, reason):
        """A waiter whose timeout ran out gives its place in the queue up at once (else it expires).

        Only on a timeout, or for a caller that already left (``Abandoned``: a cancelled coroutine,
        whose place would otherwise hold up a free lock for ``WAITER_TTL``): after any other exception
        (the server failed, the caller was interrupted on its own thread) one more request would
        stretch the caller's wait, and the entry expires within ``WAITER_TTL``.
        """
        if not (isinstance(reason, (LockNotAcquired, Abandoned)) and attempt.blocking and attempt.tries):
            return
        lock, queue, alive, wake = self._keys(attempt.name)
        try:
            self._run(LEAVE, (lock, queue, alive, wake), (attempt.owner, _WAITER_TTL_MS),
                      operation=f"leave the queue of lock {attempt.name!r}")
        except BackendUnavailable as exc:
            # The caller's answer is still "not acquired"; the entry expires on its own within WAITER_TTL.
            logger.warning("%s Its queue entry expires within %gs.", exc, WAITER_TTL)

    def _try_acquire(self, attempt):
        lock, queue, alive, wake = self._keys(attempt.name)
        keys = (lock, self._token_key_of(attempt.name), queue, alive, wake)
        args = (attempt.owner, math.ceil(attempt.ttl * 1000), holder_record(), "1" if attempt.blocking else "0",
                _WAITER_TTL_MS)
        operation = ("acquire lock", attempt.name)
        deadline = attempt.deadline if attempt.blocking else None
        if self._replicas_ack is None:
            reply = self._run(ACQUIRE, keys, args, operation=operation, deadline=deadline)
        else:
            reply, acknowledged = self._run_acknowledged(ACQUIRE, keys, args, operation=operation, deadline=deadline,
                                                         written=lambda reply: reply[0] == 1)
            if reply[0] == 1 and acknowledged < self._replicas_ack:
                self._give_back_unacknowledged(attempt)
                raise self._unacknowledged(operation, "the grant", acknowledged, given_back=True)
        if reply[0] != 1:
            attempt.retry_after = reply[1] / 1000
            return None
        token, acquired_us = reply[1], reply[2]
        return Grant(token=token, acquired_at=datetime.fromtimestamp(acquired_us / 1e6, timezone.utc))

    def _give_back_unacknowledged(self, attempt):
        """Delete a grant too few replicas acknowledged: a failover could hand it to a second holder."""
        try:
            self.release_owned(attempt.name, attempt.owner)
        except BackendUnavailable as exc:
            logger.warning("%s The unacknowledged grant expires within its ttl of %gs.", exc, attempt.ttl)

    def _wait_for_release(self, attempt, remaining):
        """Block on this waiter's wake list until the release hands it the lock, or the server's hint runs out.

        The hint is the holder's remaining ttl (an expiring holder pushes nothing) or the life left
        to a head waiter that may have died; ``WAITER_REFRESH`` caps it so the entry stays alive.
        """
        retry_after = attempt.retry_after
        if retry_after < 0:  # a lock without expiry: not ours to judge, look again after a refresh period
            retry_after = WAITER_REFRESH
        pause = min(retry_after, WAITER_REFRESH)
        if remaining is not None:
            pause = min(pause, remaining)
        if pause <= 0:
            return
        pause = max(pause, 0.001)  # BLPOP's timeout 0 would mean forever
        wake_key = self._keys(attempt.name)[3] + attempt.owner
        timeout = self._request_seconds(None if remaining is None else time.monotonic() + remaining)
        self._execute(("BLPOP", wake_key, f"{pause:.3f}"), operation=f"wait for lock {attempt.name!r}",
                      timeout=None if timeout is None else pause + timeout)

    # -- holding -------------------------------------------------------------------------------

    def release_owned(self, name, owner):
        lock, queue, alive, wake = self._keys(name)
        return self._run(RELEASE, (lock, queue, alive, wake), (owner, _WAITER_TTL_MS),
                         operation=("release lock", name)) == 1

    def _do_extend(self, lease, ttl):
        # An extension that cannot answer before the lease runs out is worth nothing: bound it so
        # renewal reports a frozen server while the lease is still valid.
        keys, args = (self._keys(lease.name)[0],), (lease.owner, math.ceil(ttl * 1000))
        operation, deadline = ("extend lock", lease.name), time.monotonic() + lease.remaining()
        if self._replicas_ack is None:
            return self._run(EXTEND, keys, args, operation=operation, deadline=deadline) == 1
        # An extension the replicas lack would be lost in a failover: the lease keeps its old validity.
        reply, acknowledged = self._run_acknowledged(EXTEND, keys, args, operation=operation, deadline=deadline,
                                                     written=lambda reply: reply == 1)
        if reply == 1 and acknowledged < self._replicas_ack:
            raise self._unacknowledged(operation, "the extension", acknowledged)
        return reply == 1

    def extend_many(self, requests):
        """Extend every ``(lease, ttl)`` in one round trip: EXTEND_MANY on chunks of ``EXTEND_MANY_CHUNK`` locks.

        With ``REPLICAS_ACK``, one acknowledged extension each, as ``extend`` does. Bounded by the
        longest validity left: a reply after that is worth nothing to any of them.
        """
        if self._replicas_ack is not None:
            return super().extend_many(requests)
        commands, chunks = [], []
        for group in self._extend_groups(requests):
            for start in range(0, len(group), EXTEND_MANY_CHUNK):
                chunk = group[start:start + EXTEND_MANY_CHUNK]
                chunks.append(chunk)
                commands.append(EXTEND_MANY.command(
                    [self._keys(requests[index][0].name)[0] for index in chunk],
                    [arg for index in chunk for arg in (requests[index][0].owner,
                                                        math.ceil(requests[index][1] * 1000))]))
        operation = f"extend {len(requests)} lock(s)"
        deadline = time.monotonic() + max(lease.remaining() for lease, _ in requests)
        outcomes = [False] * len(requests)
        with self.translate_errors(operation):
            replies = self._get_connections().exchange(commands, self._request_seconds(deadline))
            for chunk, reply in zip(chunks, replies):
                if isinstance(reply, redis.ResponseError):
                    self._raise_error_reply(reply, operation)
                for index, extended in zip(chunk, reply):
                    outcomes[index] = extended == 1
        return outcomes

    def _extend_groups(self, requests):
        """Return the positions of ``requests`` that one EXTEND_MANY may take together: all, or on a cluster, per slot.

        A script's keys must lie in one slot on a cluster (``CROSSSLOT``); the runs of one master
        still go in one round trip (``ClusterConnections.exchange``).
        """
        if not self._cluster:
            return [range(len(requests))]
        by_slot = {}
        for index, (lease, _) in enumerate(requests):
            by_slot.setdefault(_redis_cluster.key_slot(self._keys(lease.name)[0].encode()), []).append(index)
        return list(by_slot.values())

    # -- operating -----------------------------------------------------------------------------

    def held_locks(self, prefix="", *, limit=None, cursor=None):
        """Return held locks whose name starts with ``prefix``, walking the keys with ``SCAN`` (never ``KEYS``).

        A page ends with the ``SCAN`` call that brought it to ``limit`` locks or more; its cursor is
        ``SCAN``'s, so pages come in ``SCAN`` order, each sorted by name.
        """
        check_page(limit, cursor)
        count = SCAN_COUNT if limit is None else min(SCAN_COUNT, max(limit, 10))
        if self._cluster:
            return self._held_locks_on_cluster(prefix, limit, cursor, count)
        pattern = _redis.glob_escape(self._lock_prefix + prefix) + "*"
        found, scan_cursor = [], _scan_cursor(cursor)
        while True:
            scan_cursor, keys = self._execute(("SCAN", scan_cursor, "MATCH", pattern, "COUNT", count),
                                              operation="list held locks", timeout=self._request_seconds())
            if keys:
                found.extend(self._describe(keys))
            scan_cursor = int(scan_cursor)
            if scan_cursor == 0 or (limit is not None and len(found) >= limit):
                found.sort(key=lambda info: info.name)
                return LockPage(found, str(scan_cursor) if scan_cursor else None)

    def _held_locks_on_cluster(self, prefix, limit, cursor, count):
        """``held_locks`` on a cluster: ``SCAN`` each master in turn, by the lowest slot it serves.

        The cursor is ``<slot>:<SCAN cursor>``: the master serving that slot, and where its ``SCAN``
        stands. A failover or a resharding while paging may show a lock twice or not at all, as a
        ``SCAN`` of one node may while keys come and go.
        """
        if cursor:
            problem = _redis_cluster.cursor_problem(cursor)
            if problem:
                raise ValueError(f"cursor {cursor!r} is no page's: {problem}")
        slot, scan_cursor = _redis_cluster.parse_cursor(cursor)
        # Any hash tag, then the lock part of the key: the tag has a fixed length, so a name is matched from its start.
        pattern = (_redis.glob_escape(self._prefix) + ":{" + "?" * _redis_cluster.TAG_DIGITS + "}:lock:"
                   + _redis.glob_escape(prefix) + "*")
        operation = "list held locks"
        found = []
        with self.translate_errors(operation):
            connections = self._get_connections()
            masters = connections.masters(self._request_seconds())
            lowest = [start for start, _ in masters]
            index = max(bisect.bisect_right(lowest, slot) - 1, 0)
            while True:
                (reply,) = connections.on_node(masters[index][1], [("SCAN", scan_cursor, "MATCH", pattern, "COUNT",
                                                                    count)], self._request_seconds())
                if isinstance(reply, redis.ResponseError):
                    self._raise_error_reply(reply, operation)
                scan_cursor, keys = int(reply[0]), reply[1]
                if keys:
                    found.extend(self._describe(keys))
                if scan_cursor == 0:
                    index += 1
                    if index == len(masters):
                        found.sort(key=lambda info: info.name)
                        return LockPage(found)
                if limit is not None and len(found) >= limit:
                    found.sort(key=lambda info: info.name)
                    return LockPage(found, f"{masters[index][0]}:{scan_cursor}")

    def _describe(self, keys):
        """Return the ``LockInfo`` of the locks at ``keys`` that still exist: GET and PTTL in one round trip."""
        strip = len(self._lock_prefix.encode()) if not self._cluster else len(
            f"{self._prefix}:{{{'0' * _redis_cluster.TAG_DIGITS}}}:lock:".encode())
        with self.translate_errors("list held locks"):
            replies = self._get_connections().exchange(
                [(command, key) for key in keys for command in ("GET", "PTTL")], self._request_seconds())
            now = datetime.now(timezone.utc)
            infos = []
            for key, value, pttl in zip(keys, replies[::2], replies[1::2]):
                if value is None:
                    continue  # expired or released since SCAN saw it
                if isinstance(value, redis.ResponseError):
                    if str(value).startswith("WRONGTYPE"):
                        continue  # not a lock of this backend: another program's key under the prefix
                    self._raise_error_reply(value, "list held locks")
                owner, token, acquired_us, holder = _text(value).split("\n", 3)
                key = key if isinstance(key, bytes) else key.encode()
                infos.append(self.lock_info(
                    key[strip:].decode(), read_holder_record(holder), owner=owner, token=int(token),
                    acquired_at=datetime.fromtimestamp(int(acquired_us) / 1e6, timezone.utc),
                    expires_at=now + timedelta(milliseconds=pttl) if pttl >= 0 else None,
                ))
        return infos

    def ping(self):
        if not self._cluster:
            self._execute(("PING",), operation="answer a ping", timeout=self._request_seconds())
            return
        with self.translate_errors("answer a ping"):
            connections = self._get_connections()
            for _, address in connections.masters(self._request_seconds()):
                (reply,) = connections.on_node(address, [("PING",)], self._request_seconds())
                if isinstance(reply, redis.ResponseError):
                    self._raise_error_reply(reply, "answer a ping")

    def close(self):
        with self._connections_lock:
            connections, self._connections = self._connections, None
        if connections is not None:
            connections.close()


class _Connections:
    """Connections taken from a redis-py pool, a few kept on a stack of idle ones between calls.

    The pool's own checkout probes every connection with a non-blocking read and records
    observability counters, which costs about as much as a loopback round trip. Keeping idle
    connections here skips that, for a pool of our own (``URL``): at most ``MAX_IDLE`` of them, the
    others go back to the pool. A pool shared with a cache (``CACHE``) gets every connection back
    after each call, so the cache never runs short of connections (its ``max_connections``) because
    distlock sits on them. A connection the server closed while it sat idle is found on first use
    (``_redis.exchange``).
    """

    def __init__(self, pool, *, owned, sentinels=()):
        self.pool = pool
        #: True if the pool is ours (``URL``) and is disconnected on close; a cache's pool is left open.
        self.owned = owned
        #: redis-py clients of the Sentinels that name the pool's master, disconnected on close.
        self.sentinels = sentinels
        self.socket_timeout = pool.connection_kwargs.get("socket_timeout")
        #: How many idle connections are kept here rather than given back to the pool.
        self.max_idle = MAX_IDLE if owned else 0
        self.forget_after_fork()  # no idle connection yet
        # redis-py before 5 requires a command name, which 8 deprecates (distlock's pools ignore it).
        parameter = inspect.signature(pool.get_connection).parameters.get("command_name")
        self._checkout_args = ("EVALSHA",) if parameter is not None and parameter.default is parameter.empty else ()
        _redis.FORGET_IN_FORKED_CHILD.add(self)

    def forget_after_fork(self):
        """Keep no idle connection, without closing any: a forked child must not use the parent's sockets."""
        self._idle = collections.deque()  # append/pop are atomic: no lock on the fast path

    def _borrow(self):
        """Return an idle connection, or one from the pool."""
        try:
            return self._idle.pop()
        except IndexError:
            return self.pool.get_connection(*self._checkout_args)

    def _give_back(self, connection):
        """Keep ``connection`` for the next call if fewer than ``max_idle`` are idle, else return it to the pool.

        Threads returning at the same moment may leave a few more on the stack; they go back the
        next time one is returned while the stack is full.
        """
        if len(self._idle) < self.max_idle:
            self._idle.append(connection)
        else:
            self.pool.release(connection)

    def exchange_acknowledged(self, command, timeout, wait, wait_seconds, written):
        """Return the reply to ``command`` and, if ``written(reply)``, the reply to ``wait`` (a ``WAIT``), else None.

        Both on one connection: ``WAIT`` counts the replicas that have its own connection's writes.
        ``WAIT`` is never sent again on a fresh connection (which has written nothing, so every replica
        has its writes); its reply may take ``wait_seconds`` more than ``timeout``.
        """
        connection = self._borrow()
        try:
            (reply,) = _redis.exchange(connection, [command], timeout)
            acknowledged = None
            if not isinstance(reply, redis.ResponseError) and written(reply):
                bound = None if timeout is None else timeout + wait_seconds
                (acknowledged,) = _redis.exchange(connection, [wait], bound, once=True)
        except BaseException:
            connection.disconnect()
            self._give_back(connection)
            raise
        self._give_back(connection)
        return reply, acknowledged

    def exchange(self, commands, timeout):
        """Return the replies to ``commands`` (``_redis.exchange``), error replies in their place.

        A connection is used again only when every reply was read: one that an exception (a timeout,
        a lost connection, or a signal handler's exception such as Celery's soft time limit)
        interrupted between the send and the last read is disconnected.
        """
        connection = self._borrow()
        try:
            replies = _redis.exchange(connection, commands, timeout)
        except BaseException:
            connection.disconnect()
            self._give_back(connection)  # disconnected: its next use connects afresh
            raise
        self._give_back(connection)
        return replies

    def close(self):
        while self._idle:
            connection = self._idle.pop()
            if self.owned:
                connection.disconnect()
            else:
                self.pool.release(connection)
        if self.owned:
            self.pool.disconnect()
        for sentinel in self.sentinels:
            sentinel.connection_pool.disconnect()
