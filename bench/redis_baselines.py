"""The Redis backend against stock recipes on the same Redis server, in the same run, with the targets.

- the protocol floor: a bare ``SET key value NX PX ttl`` and a Lua compare-and-delete, through redis-py;
  no token, no holder metadata, no queue: what one round trip per acquire and per release costs;
- the same floor sent over distlock's own connection layer (pooled connections used directly, its
  RESP packing), for information: it separates what the protocol costs from what redis-py's client
  costs, since the backend skips the latter;
- redis-py's built-in ``Lock`` (waits by polling every 0.1 s);
- python-redis-lock (waits on a ``BLPOP`` signal list that the release pushes to).

Targets (issue 2): uncontended ops/s of the backend ≥ 0.9× the floor's; contended with 4 processes on
one key, hand-offs/s ≥ 0.8× python-redis-lock's and Jain's fairness index ≥ 0.95.
"""

import secrets
import statistics

from django.conf import settings

from bench.harness import (
    Contender,
    ContenderSpec,
    contended,
    print_contended,
    print_uncontended,
    uncontended,
    verdict,
)

UNLOCK_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

#: Target ratios of issue 2.
FLOOR_RATIO_TARGET = 0.9
HANDOFF_RATIO_TARGET = 0.8
JAIN_TARGET = 0.95


def floor(url, ttl=30):
    """The protocol floor: ``SET NX PX`` + Lua compare-and-delete, one round trip each (uncontended only)."""
    import redis  # noqa: PLC0415

    client = redis.Redis.from_url(url)
    unlock = client.register_script(UNLOCK_SCRIPT)
    ttl_ms = int(ttl * 1000)

    def acquire(name):
        key, value = f"bench-floor:{name}", secrets.token_hex(16)
        if not client.set(key, value, nx=True, px=ttl_ms):
            raise RuntimeError("the floor does not wait: use it uncontended only")
        return key, value

    def release(handle):
        key, value = handle
        unlock(keys=[key], args=[value])

    return Contender(acquire, release)


def raw_floor(url, ttl=30):
    """The floor's two commands over distlock's connection layer instead of ``redis.Redis``."""
    import redis  # noqa: PLC0415

    from distlock.backends.redis import _Connections  # noqa: PLC0415 - measuring the backend's I/O path

    connections = _Connections(redis.ConnectionPool.from_url(url), owned=True)
    unlock_sha = redis.Redis.from_url(url).script_load(UNLOCK_SCRIPT)
    ttl_ms = int(ttl * 1000)

    def acquire(name):
        key, value = f"bench-raw-floor:{name}", secrets.token_hex(16)
        if connections.exchange([("SET", key, value, "NX", "PX", ttl_ms)], None) == [None]:
            raise RuntimeError("the floor does not wait: use it uncontended only")
        return key, value

    def release(handle):
        key, value = handle
        connections.exchange([("EVALSHA", unlock_sha, 1, key, value)], None)

    return Contender(acquire, release)


def redis_py_lock(url, ttl=30):
    """redis-py's ``Lock``: ``SET NX PX`` in a loop that sleeps 0.1 s between tries."""
    import redis  # noqa: PLC0415

    client = redis.Redis.from_url(url)

    def acquire(name):
        lock = client.lock(f"bench-redis-py:{name}", timeout=ttl)
        lock.acquire(blocking=True)
        return lock

    return Contender(acquire, lambda lock: lock.release())


def python_redis_lock(url, ttl=30):
    """python-redis-lock: ``SET NX EX``, waiting on ``BLPOP`` of a signal list the release pushes to."""
    import redis  # noqa: PLC0415
    import redis_lock  # noqa: PLC0415

    client = redis.Redis.from_url(url)

    def acquire(name):
        lock = redis_lock.Lock(client, f"bench-python-redis-lock:{name}", expire=int(ttl))
        lock.acquire(blocking=True)
        return lock

    return Contender(acquire, lambda lock: lock.release())


def redis_aliases():
    """Return the aliases of ``settings.DISTLOCK`` that use the Redis backend with a ``URL`` on one instance.

    Not a Redis Cluster (``CLUSTER``): the floor's scripts name keys of several slots.
    """
    return [alias for alias, entry in settings.DISTLOCK.items()
            if entry.get("BACKEND") == "distlock.backends.redis.RedisBackend" and "URL" in entry.get("OPTIONS", {})
            and not entry["OPTIONS"].get("CLUSTER")]


def paired_ratio(ours, theirs):
    """Median over rounds of ours/theirs: each round's two figures were measured side by side, under one load."""
    return statistics.median(a / b for a, b in zip(ours, theirs) if b)


def run(*, seconds=0.25, rounds=10, contended_seconds=1.0, contended_rounds=8):
    """Print the baselines against the first Redis alias, and the ratios against the targets."""
    aliases = redis_aliases()
    if not aliases:
        print("\nRedis baselines: no DISTLOCK alias uses RedisBackend with a URL; skipped.")
        return
    alias = aliases[0]
    url = settings.DISTLOCK[alias]["OPTIONS"]["URL"]
    here = "bench.redis_baselines"
    api = ContenderSpec(f"distlock '{alias}' (public API)", "bench.harness.alias_contender", {"alias": alias})
    backend = ContenderSpec(f"distlock '{alias}' (backend only)", "bench.harness.backend_contender", {"alias": alias})
    bare = ContenderSpec("floor: SET NX PX + Lua delete", f"{here}.floor", {"url": url})
    raw = ContenderSpec("floor over distlock's connections", f"{here}.raw_floor", {"url": url})
    redis_py = ContenderSpec("redis-py Lock", f"{here}.redis_py_lock", {"url": url})
    prl = ContenderSpec("python-redis-lock", f"{here}.python_redis_lock", {"url": url})

    print(f"\n== Redis baselines: alias '{alias}' against stock recipes on the same server ({url}) ==")
    alone = uncontended([bare, api, backend, raw, redis_py, prl], seconds=seconds, rounds=rounds)
    print_uncontended(alone, f"Uncontended acquire+release, 1 process ({rounds} interleaved rounds of {seconds:g} s, "
                             "median ops/s)")
    together = contended([api, prl, redis_py], seconds=contended_seconds, rounds=contended_rounds)
    print_contended(together, f"Contended: 4 processes on one key ({contended_rounds} interleaved rounds of "
                              f"{contended_seconds:g} s, medians)")

    api_ratio = paired_ratio(alone[api.label].rounds, alone[bare.label].rounds)
    backend_ratio = paired_ratio(alone[backend.label].rounds, alone[bare.label].rounds)
    raw_ratio = paired_ratio(alone[backend.label].rounds, alone[raw.label].rounds)
    handoff_ratio = paired_ratio(together[api.label].handoffs, together[prl.label].handoffs)
    jain = together[api.label].median("jain")
    print("\nTargets (ratios: median over rounds of the two figures measured side by side)")
    print(f"  uncontended ops/s vs the floor, public API:  {api_ratio:5.2f}x  (target >= {FLOOR_RATIO_TARGET}x: "
          f"{verdict(api_ratio, FLOOR_RATIO_TARGET)})")
    print(f"  uncontended ops/s vs the floor, backend only: {backend_ratio:5.2f}x  (target >= {FLOOR_RATIO_TARGET}x: "
          f"{verdict(backend_ratio, FLOOR_RATIO_TARGET)})")
    print(f"  (information) backend only vs the floor over the same connections: {raw_ratio:5.2f}x")
    print(f"  hand-offs/s vs python-redis-lock:            {handoff_ratio:5.2f}x  (target >= {HANDOFF_RATIO_TARGET}x: "
          f"{verdict(handoff_ratio, HANDOFF_RATIO_TARGET)})")
    print(f"  Jain fairness, 4 processes:                  {jain:5.3f}   (target >= {JAIN_TARGET}: "
          f"{verdict(jain, JAIN_TARGET)})")
