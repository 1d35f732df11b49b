"""Locks on one Redis server, with fencing tokens that survive a restart without persistence and fair hand-off.

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

Assumptions, said plainly: this is one Redis instance (not a cluster: the scripts build the wake key
names themselves). A restart without persistence loses the locks (a second holder may get one at
once: use ``FencedModel``) but never the token order, as long as the server clock does not step back.
"""

import collections
import inspect
import json
import logging
import math
import os
import threading
import time
from datetime import datetime, timedelta, timezone
from hashlib import sha1

import redis
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from distlock.backends.base import (
    NOTIFICATIONS,
    SAFE_FENCING_TOKENS,
    BaseLockBackend,
    Grant,
    LockInfo,
    Option,
    positive_number,
)
from distlock.backends.redis_servers import redis_server, tls_problem, unsecured
from distlock.exceptions import BackendUnavailable
from distlock.holder import holder_record
from distlock.redaction import redact

logger = logging.getLogger("distlock.redis")

# Shared by the scripts below. Times come from the server's clock (TIME), so every expiry and every
# token is judged on one clock, never the clients'. The uncontended path reads no queue beyond one
# EXISTS: a queue key exists only while somebody waits.
#
# clock: return the server time in µs and in ms.
# prune: drop the waiters whose entry expired (they died, or gave up without saying so), 100 at a
#   time so a script never unpacks an unbounded list; return how many it dropped.
# wake: give waiter ``owner`` at most one pending wake-up; it expires with the waiter's entry.
# head: the first waiter in FIFO order, or nil.
# wake_head: after the lock was freed, wake the first live waiter, if anybody queues.
_LUA_HELPERS = """
local function clock()
  local time = redis.call('TIME')
  local now_us = tonumber(time[1]) * 1000000 + tonumber(time[2])
  return now_us, math.floor(now_us / 1000)
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
#   its reply was lost) reports the first grant again instead of waiting for itself.
# Returns: {1, token, acquired_us} granted; {0, ms} not granted, retry within ms at the latest (the
#   holder's remaining ttl, or how long the head waiter's entry has left to live).
ACQUIRE_SCRIPT = _LUA_HELPERS + """
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
if current then
  if string.sub(current, 1, #owner + 1) == owner .. '\\n' then
    local token, acquired = string.match(current, '\\n(%d+)\\n(%d+)\\n')
    return {1, tonumber(token), tonumber(acquired)}
  end
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
"""

# Release (compare-and-delete), also the operator's force release.
# KEYS: 1 lock, 2 queue, 3 alive, 4 wake-key prefix. ARGV: 1 owner, 2 waiter entry ttl in ms.
# Invariant: deletes the lock only while ``owner`` holds it, never another holder's; then wakes the
#   live head of the queue, the only waiter the lock may go to.
# Returns: 1 deleted, 0 not held by ``owner`` (released already, expired, or taken over).
RELEASE_SCRIPT = _LUA_HELPERS + """
local current = redis.call('GET', KEYS[1])
if not current or string.sub(current, 1, #ARGV[1] + 1) ~= ARGV[1] .. '\\n' then
  return 0
end
redis.call('DEL', KEYS[1])
wake_head(KEYS[2], KEYS[3], KEYS[4], ARGV[2])
return 1
"""

# Extend (compare-and-extend), for renewal.
# KEYS: 1 lock. ARGV: 1 owner, 2 ttl in ms.
# Invariant: moves the expiry only while ``owner`` holds the lock; a lost lock stays lost.
# Returns: 1 extended, 0 not held by ``owner``.
EXTEND_SCRIPT = """
local current = redis.call('GET', KEYS[1])
if not current or string.sub(current, 1, #ARGV[1] + 1) ~= ARGV[1] .. '\\n' then
  return 0
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# Leave the queue: a blocking acquire that timed out gives its place up at once instead of
# blocking a free lock until its entry expires.
# KEYS: 1 lock, 2 queue, 3 alive, 4 wake-key prefix. ARGV: 1 owner, 2 waiter entry ttl in ms.
# Invariant: if the caller headed the queue of a free lock, the next live waiter is woken.
# Returns: 1 if the caller was queued, else 0.
LEAVE_SCRIPT = _LUA_HELPERS + """
redis.call('DEL', KEYS[4] .. ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
if redis.call('ZREM', KEYS[2], ARGV[1]) == 0 then
  return 0
end
if redis.call('EXISTS', KEYS[1]) == 0 then
  wake_head(KEYS[2], KEYS[3], KEYS[4], ARGV[2])
end
return 1
"""

#: Seconds a waiter's queue entry lives without a refresh: how long a waiter that died can delay the others.
WAITER_TTL = 2.0
#: Longest a waiter blocks before it refreshes its entry by trying again.
WAITER_REFRESH = WAITER_TTL / 3
#: Shortest network timeout of a call near the caller's deadline: a server that answers in time is
#: not reported down because the deadline was a millisecond away.
MIN_CALL_TIMEOUT = 0.1
#: Keys fetched per ``SCAN`` round trip in ``held_locks()``.
SCAN_COUNT = 500
#: Most idle connections an alias with its own pool (``URL``) keeps between calls; more go back to
#: the pool. A ``CACHE`` alias keeps none: the cache's pool gets every connection back after each call.
MAX_IDLE = 8

#: Server errors meaning "this server cannot take locks now" (-> ``BackendUnavailable``); any other
#: error reply is a bug or a foreign key under our prefix (-> ``RuntimeError``).
_UNUSABLE_SERVER_REPLIES = ("OOM", "MISCONF", "READONLY", "read only replica", "NOREPLICAS", "BUSY", "LOADING",
                            "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "NOPERM", "NOAUTH", "WRONGPASS")
#: The codes of those errors by redis-py's class: before redis-py 5 an error reply's code ("OOM",
#: "READONLY", ...) went into the class and out of the message, and there is no ``status_code``.
_UNUSABLE_SERVER_ERRORS = {getattr(redis.exceptions, name): code for name, code in (
    ("OutOfMemoryError", "OOM"), ("ReadOnlyError", "READONLY"), ("BusyLoadingError", "LOADING"),
    ("NoPermissionError", "NOPERM"), ("MasterDownError", "MASTERDOWN"), ("TryAgainError", "TRYAGAIN"),
    ("AuthenticationError", "NOAUTH")) if hasattr(redis.exceptions, name)}


class _Script:
    """A Lua script run with ``EVALSHA``, falling back to ``EVAL`` (which caches it) after a restart."""

    def __init__(self, name, source):
        self.name = name
        self.source = source
        self.sha = sha1(source.encode()).hexdigest()


_ACQUIRE = _Script("acquire", ACQUIRE_SCRIPT)
_RELEASE = _Script("release", RELEASE_SCRIPT)
_EXTEND = _Script("extend", EXTEND_SCRIPT)
_LEAVE = _Script("leave", LEAVE_SCRIPT)


#: What redis-py reports when a plain connection meets a TLS-only port (the server drops it).
_PLAIN_ON_TLS = ("reset by peer", "Connection closed by server")

#: redis-py's TLS keyword arguments, given in a ``rediss://`` URL's query (``from_url`` passes them on).
TLS_PARAMETERS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname",
                  "ssl_ca_path", "ssl_password")


def _url_problem(value):
    if not value.startswith(("redis://", "rediss://", "unix://")):
        return "must be a redis://, rediss:// or unix:// URL"
    return tls_problem(value)


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


class RedisBackend(BaseLockBackend):
    """Locks on a single Redis server: one script round trip per acquire and per release.

    Options: ``URL`` (a redis:// URL) or ``CACHE`` (the alias of a django-redis cache in ``CACHES``,
    whose connection pool is reused; its socket timeouts then come from that cache), ``KEY_PREFIX``,
    ``SOCKET_TIMEOUT`` and ``SOCKET_CONNECT_TIMEOUT`` (seconds, with ``URL`` only).

    TLS and ACL users are the URL's, as redis-py's ``from_url`` reads them:
    ``rediss://user:password@host:port/db?ssl_ca_certs=/ca.crt&ssl_certfile=...&ssl_keyfile=...&ssl_cert_reqs=required``.

    Every call is bounded in time (by the socket timeout, and by the caller's deadline while
    waiting), so a server that is down or frozen gives ``BackendUnavailable``, never a hang.
    """

    capabilities = frozenset({SAFE_FENCING_TOKENS, NOTIFICATIONS})

    options = {
        "URL": Option(str, None, check=_url_problem, expected="a redis:// URL"),
        "CACHE": Option(str, None, expected="the alias of a django-redis cache in CACHES"),
        "KEY_PREFIX": Option(str, "distlock", check=lambda v: None if v else "must not be empty",
                             expected="a str"),
        "SOCKET_TIMEOUT": Option((int, float), None, check=positive_number, expected="a number of seconds"),
        "SOCKET_CONNECT_TIMEOUT": Option((int, float), None, check=positive_number,
                                         expected="a number of seconds"),
    }

    #: Socket timeouts of a ``URL`` connection pool when the options leave them out (seconds).
    default_socket_timeout = 2.0
    default_socket_connect_timeout = 2.0

    @classmethod
    def check_combination(cls, alias, options):
        where = f"DISTLOCK['{alias}']['OPTIONS']"
        if (options["URL"] is None) == (options["CACHE"] is None):
            raise ImproperlyConfigured(
                f"{where} needs exactly one of 'URL' (a redis:// URL) or 'CACHE' (the alias of a django-redis "
                f"cache in CACHES), got {'both' if options['URL'] else 'neither'}."
            )
        cache = options["CACHE"]
        if cache is None:
            return
        for name in ("SOCKET_TIMEOUT", "SOCKET_CONNECT_TIMEOUT"):
            if options[name] is not None:
                raise ImproperlyConfigured(
                    f"{where}['{name}'] cannot be combined with 'CACHE': the pool belongs to the cache; "
                    f"set it in CACHES['{cache}']['OPTIONS']['{name}'] instead."
                )
        caches = getattr(settings, "CACHES", {})
        if cache not in caches:
            raise ImproperlyConfigured(
                f"{where}['CACHE'] names the cache '{cache}', which is not in settings.CACHES "
                f"(configured: {', '.join(map(repr, caches)) or 'none'})."
            )

    @classmethod
    def key_spaces(cls, alias, options):
        return [(redis_server(url), options["KEY_PREFIX"]) for url in cls._server_urls(options)]

    @classmethod
    def security_warnings(cls, alias, options):
        """Warn about each server this alias reaches over the network with neither TLS nor a password."""
        password = None
        if options["CACHE"] is not None:
            cache_options = settings.CACHES.get(options["CACHE"], {}).get("OPTIONS", {})
            password = cache_options.get("PASSWORD") or cache_options.get("CONNECTION_POOL_KWARGS", {}).get("password")
        messages = (unsecured(url, password=password) for url in cls._server_urls(options))
        return [message for message in messages if message]

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

    # -- connections ------------------------------------------------------------------------------

    @property
    def pool(self):
        """The redis-py connection pool: built from ``URL``, or the ``CACHE``'s own pool, on first use."""
        return self._get_connections().pool

    def _get_connections(self):
        if self._connections is None:
            with self._connections_lock:
                if self._connections is None:
                    self._connections = _Connections(self._make_pool(), owned=self.settings["URL"] is not None)
        return self._connections

    def _make_pool(self):
        if self.settings["URL"] is not None:
            timeout = self.settings["SOCKET_TIMEOUT"] or self.default_socket_timeout
            connect = self.settings["SOCKET_CONNECT_TIMEOUT"] or self.default_socket_connect_timeout
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

    def _call_timeout(self, deadline):
        """Seconds a call may take: the socket timeout, shortened to the caller's deadline if sooner."""
        timeout = self._get_connections().socket_timeout
        if deadline is None:
            return timeout
        remaining = max(deadline - time.monotonic(), MIN_CALL_TIMEOUT)
        return remaining if timeout is None else min(timeout, remaining)

    def _translate(self, exc, operation):
        """Return the exception to raise for redis-py's ``exc``: the one place where its errors are mapped.

        Fail closed: a server that cannot be reached or cannot take locks now is ``BackendUnavailable``;
        any other error reply is a bug, or a foreign key under our prefix.
        """
        message = redact(exc)
        if isinstance(exc, (redis.ConnectionError, redis.TimeoutError, OSError)):
            hint = ""
            url = self.settings["URL"]
            if url is not None and url.startswith("redis://") and any(s in message for s in _PLAIN_ON_TLS):
                hint = " (if the server takes TLS connections only, use a rediss:// URL)"
            return BackendUnavailable(f"Redis of lock alias '{self.alias}' failed during {operation}: {message}{hint}")
        status = getattr(exc, "status_code", None) or _UNUSABLE_SERVER_ERRORS.get(type(exc), "")
        if any(reply in message or reply == status for reply in _UNUSABLE_SERVER_REPLIES):
            return BackendUnavailable(f"Redis of lock alias '{self.alias}' refused {operation}: {status} {message}")
        return RuntimeError(
            f"Redis refused distlock's {operation} on alias '{self.alias}': {message}; is another "
            f"program writing keys under KEY_PREFIX '{self._prefix}'?"
        )

    def _execute(self, *command, timeout, operation, script=None):
        """Send one command and return its reply, waiting at most ``timeout`` seconds for it."""
        connections = self._get_connections()
        try:
            try:
                return connections.call(_pack(command), timeout)
            except redis.exceptions.NoScriptError:
                if script is None:
                    raise
            # The server forgot the script (a restart, SCRIPT FLUSH): EVAL runs it and caches it again.
            return connections.call(_pack(("EVAL", script.source, *command[2:])), timeout)
        except (redis.RedisError, OSError) as exc:
            raise self._translate(exc, operation) from exc

    def _run(self, script, keys, args, *, deadline=None):
        return self._execute("EVALSHA", script.sha, len(keys), *keys, *args, timeout=self._call_timeout(deadline),
                             operation=f"the {script.name} script", script=script)

    def _keys(self, name):
        """Return the lock, queue, alive and wake-prefix keys of lock ``name``."""
        prefix = self._prefix
        return (f"{prefix}:lock:{name}", f"{prefix}:queue:{name}", f"{prefix}:alive:{name}",
                f"{prefix}:wake:{name}:")

    # -- acquiring ---------------------------------------------------------------------------------

    def _give_up(self, attempt):
        """A waiter whose timeout ran out gives its place in the queue up at once (else it expires)."""
        if attempt.blocking and attempt.tries:
            self._leave_queue(attempt.name, attempt.owner)

    def _try_acquire(self, attempt):
        name, owner, ttl, blocking = attempt.name, attempt.owner, attempt.ttl, attempt.blocking
        lock, queue, alive, wake = self._keys(name)
        metadata = holder_record()
        reply = self._run(_ACQUIRE, (lock, self._token_key, queue, alive, wake),
                          (owner, math.ceil(ttl * 1000), metadata, "1" if blocking else "0",
                           int(WAITER_TTL * 1000)),
                          deadline=None if not blocking else attempt.deadline)
        if reply[0] != 1:
            attempt.retry_after = reply[1] / 1000
            return None
        token, acquired_us = reply[1], reply[2]
        return Grant(token=token, acquired_at=datetime.fromtimestamp(acquired_us / 1e6, timezone.utc))

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
        deadline = None if remaining is None else time.monotonic() + remaining
        call_timeout = self._call_timeout(deadline)
        self._execute("BLPOP", wake_key, f"{pause:.3f}",
                      timeout=None if call_timeout is None else pause + call_timeout,
                      operation="waiting for a release")

    def _leave_queue(self, name, owner):
        lock, queue, alive, wake = self._keys(name)
        try:
            self._run(_LEAVE, (lock, queue, alive, wake), (owner, int(WAITER_TTL * 1000)))
        except BackendUnavailable as exc:
            # The caller's answer is still "not acquired"; the entry expires on its own within WAITER_TTL.
            logger.warning("Could not leave the queue of lock %r (alias %r): %s", name, self.alias, exc)

    # -- holding -------------------------------------------------------------------------------

    def _execute_release(self, name, owner):
        lock, queue, alive, wake = self._keys(name)
        return self._run(_RELEASE, (lock, queue, alive, wake), (owner, int(WAITER_TTL * 1000))) == 1

    def _do_release(self, lease):
        return self._execute_release(lease.name, lease.owner)

    def _do_extend(self, lease, ttl):
        # An extension that cannot answer before the lease runs out is worth nothing: bound it so
        # renewal reports a frozen server while the lease is still valid.
        deadline = time.monotonic() + lease.remaining()
        return self._run(_EXTEND, (self._keys(lease.name)[0],), (lease.owner, math.ceil(ttl * 1000)),
                         deadline=deadline) == 1

    # -- operating -----------------------------------------------------------------------------

    def held_locks(self, prefix=""):
        """Return every held lock whose name starts with ``prefix``, walking the keys with ``SCAN`` (never ``KEYS``)."""
        pattern = _glob_escape(self._lock_prefix + prefix) + "*"
        strip = len(self._lock_prefix.encode())
        found, cursor = [], 0
        while True:
            cursor, keys = self._execute("SCAN", cursor, "MATCH", pattern, "COUNT", SCAN_COUNT,
                                         timeout=self._call_timeout(None), operation="SCAN")
            if keys:
                found.extend(self._describe(keys, strip))
            cursor = int(cursor)
            if cursor == 0:
                return found

    def _describe(self, keys, strip):
        """Return the ``LockInfo`` of the locks at ``keys`` that still exist: GET and PTTL in one pipeline."""
        commands = [_pack(command)[0] for key in keys for command in (("GET", key), ("PTTL", key))]
        try:
            replies = self._get_connections().call_many(commands, self._call_timeout(None))
        except (redis.RedisError, OSError) as exc:
            raise self._translate(exc, "reading held locks") from exc
        now = datetime.now(timezone.utc)
        infos = []
        for key, value, pttl in zip(keys, replies[::2], replies[1::2]):
            if value is None:
                continue  # expired or released since SCAN saw it
            if isinstance(value, redis.ResponseError):
                if str(value).startswith("WRONGTYPE"):
                    continue  # not a lock of this backend: another program's key under the prefix
                raise self._translate(value, "reading held locks")
            owner, token, acquired_us, metadata = _text(value).split("\n", 3)
            holder = json.loads(metadata)
            key = key if isinstance(key, bytes) else key.encode()
            infos.append(LockInfo(
                alias=self.alias, name=key[strip:].decode(), owner=owner, token=self.public_token(int(token)),
                acquired_at=datetime.fromtimestamp(int(acquired_us) / 1e6, timezone.utc),
                expires_at=now + timedelta(milliseconds=pttl) if pttl >= 0 else None,
                host=holder["host"], pid=holder["pid"], task_id=holder["task_id"],
            ))
        return infos

    def force_release(self, name, owner):
        return self._execute_release(name, owner)

    def ping(self):
        self._execute("PING", timeout=self._call_timeout(None), operation="PING")

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
    distlock sits on them. A connection the server closed while it sat idle (a restart, an
    idle timeout) is found on first use instead, and the command is sent once more on a fresh
    connection. That is safe because every command distlock sends may run twice: the acquire script
    reports its own earlier grant again, extend and leave are idempotent, reads are reads; a release
    whose first run succeeded reports False the second time, and a wake-up consumed by the first
    ``BLPOP`` is made up for by the waiter's refresh period.
    """

    def __init__(self, pool, *, owned):
        self.pool = pool
        #: True if the pool is ours (``URL``) and is disconnected on close; a cache's pool is left open.
        self.owned = owned
        self.socket_timeout = pool.connection_kwargs.get("socket_timeout")
        #: How many idle connections are kept here rather than given back to the pool.
        self.max_idle = MAX_IDLE if owned else 0
        self._idle = collections.deque()  # append/pop are atomic: no lock on the fast path
        self._pid = os.getpid()
        # redis-py before 5 requires a command name, which 8 deprecates (distlock's pools ignore it).
        parameter = inspect.signature(pool.get_connection).parameters.get("command_name")
        self._checkout_args = ("EVALSHA",) if parameter is not None and parameter.default is parameter.empty else ()

    def _borrow(self):
        """Return an idle connection and whether it was connected, or a new one from the pool."""
        if self._pid != os.getpid():
            # A forked child must not share the parent's sockets (their replies would interleave),
            # nor close them: it starts with no idle connection; the pool resets itself likewise.
            self._idle, self._pid = collections.deque(), os.getpid()
        try:
            connection = self._idle.pop()
        except IndexError:
            return self.pool.get_connection(*self._checkout_args), False
        return connection, connection._sock is not None

    def _give_back(self, connection):
        """Keep ``connection`` for the next call if fewer than ``max_idle`` are idle, else return it to the pool.

        Threads returning at the same moment may leave a few more on the stack; they go back the
        next time one is returned while the stack is full.
        """
        if len(self._idle) < self.max_idle:
            self._idle.append(connection)
        else:
            self.pool.release(connection)

    def _exchange(self, requests, timeout):
        """Send ``requests`` (packed commands) on one connection; return the list of replies.

        An error reply comes back in its place as the ``ResponseError`` instance, after every reply
        was read. A connection is used again only when every reply was read: one that
        an exception (a timeout, a lost connection, or a signal handler's exception such as Celery's
        soft time limit) interrupted between the send and the last read is disconnected, since its
        next user would read the leftover replies as its own (a refused acquire read as a grant).
        """
        connection, was_connected = self._borrow()
        try:
            try:
                replies = _send_and_read(connection, requests, timeout)
            except redis.ConnectionError:
                if not was_connected:
                    raise
                # Closed by the server while idle: once more on a fresh connection (see the class docstring).
                connection.disconnect()
                replies = _send_and_read(connection, requests, timeout)
        except BaseException:
            connection.disconnect()
            self._give_back(connection)  # disconnected: its next use connects afresh
            raise
        self._give_back(connection)
        return replies

    def call(self, request, timeout):
        """Return the reply to one command; raise its error reply (a ``ResponseError``)."""
        (reply,) = self._exchange(request, timeout)
        if isinstance(reply, redis.ResponseError):
            raise reply
        return reply

    def call_many(self, requests, timeout):
        """Return the replies to ``requests``, error replies in their place as ``ResponseError`` instances."""
        return self._exchange(requests, timeout)

    def close(self):
        while self._idle:
            connection = self._idle.pop()
            if self.owned:
                connection.disconnect()
            else:
                self.pool.release(connection)
        if self.owned:
            self.pool.disconnect()


def _read_bounded(connection, timeout):
    """Return the next reply, waiting at most ``timeout`` seconds (None: no limit) for it.

    The socket already waits ``socket_timeout``: then there is nothing to change. redis-py 8 bounds
    one read itself (``read_response(timeout=...)``); before 8 the socket's timeout is set around
    the read and put back afterwards (on an error redis-py has disconnected: no socket to put back).
    """
    if timeout == connection.socket_timeout:
        return connection.read_response()
    if _READ_TAKES_TIMEOUT:
        return connection.read_response(timeout=timeout)
    sock = connection._sock
    sock.settimeout(timeout)
    try:
        return connection.read_response()
    finally:
        if connection._sock is sock:
            sock.settimeout(connection.socket_timeout)


#: True from redis-py 8 on: ``Connection.read_response`` takes a ``timeout`` for one read.
_READ_TAKES_TIMEOUT = "timeout" in inspect.signature(redis.connection.Connection.read_response).parameters


def _send_and_read(connection, requests, timeout):
    """Send ``requests`` in one write and read one reply per request, error replies included."""
    connection.send_packed_command((b"".join(requests),))
    replies = []
    for _ in requests:
        try:
            replies.append(_read_bounded(connection, timeout))
        except redis.ResponseError as error:  # read in full: the next reply is the next request's
            replies.append(error)
    return replies


def _pack(command):
    """Encode ``command`` (str, bytes and int arguments) as one RESP request, in the list ``send_packed_command`` takes.

    redis-py's ``pack_command`` costs more than the rest of a loopback round trip's client work for
    the dozen arguments of the acquire script; keys and values are always UTF-8 here.
    """
    parts = [arg.encode() if isinstance(arg, str) else arg if isinstance(arg, bytes) else b"%d" % arg
             for arg in command]
    return [b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(part), part) for part in parts)]


def _glob_escape(text):
    """Escape the characters ``SCAN MATCH`` treats as a glob, so a name prefix matches literally."""
    return "".join("\\" + char if char in "*?[]\\" else char for char in text)
