"""The Redlock backend (5 masters) against pottery's ``Redlock`` (3 masters) on the same servers, with the target.

    python -m tests.servers --servers redlock -- .venv/bin/python -m bench.redlock_baselines

- distlock's backend: one script per master, written to all five sockets before any reply is read;
  release is one more such round.
- pottery's ``Redlock``, used as its docs show, a new ``Redlock(key=..., masters=...)`` per critical
  section: ``SET NX PX`` on every master through a thread pool created for each call, then a release
  script the same way. It waits by sleeping a random time up to 0.2 s between attempts.
- pottery with all five masters, for a like-for-like reference.
- the protocol floor: distlock's own acquire and release scripts (``distlock.backends.redlock``), sent
  to every master through one raw redis-py connection each, written to all of them before any reply
  is read; held when a majority granted it with validity left (Redlock's rule). Nothing else: no
  master threads, no skipping of failed masters, no retries, no notifications. Uncontended only.

Target (issue 3): uncontended acquire+release with 5 masters ≥ 2× pottery's ``Redlock`` with 3 masters.
Contended figures (4 processes, one key) are printed beside pottery's.
"""

import json
import os
import secrets
import socket
import time

from django.conf import settings

from bench import run_standalone
from bench.harness import (
    Contender,
    ContenderSpec,
    contended,
    print_contended,
    print_uncontended,
    round_options,
    uncontended,
    verdict,
)

#: Target ratio of issue 3.
POTTERY_RATIO_TARGET = 2.0

#: The floor's keys, token counter and release channel on each master, apart from distlock's.
FLOOR_PREFIX = "bench-floor"
#: Redlock's clock-drift allowance, as a fraction of the ttl (the backend's default CLOCK_DRIFT_FACTOR).
FLOOR_DRIFT_FACTOR = 0.01


def floor(urls, ttl=30):
    """The protocol floor: the acquire script on every master at once, a majority with validity left, the release
    script on every master at once (uncontended only)."""
    import redis  # noqa: PLC0415

    from distlock.backends.redlock import ACQUIRE, RELEASE, milliseconds, remaining_validity  # noqa: PLC0415

    connections = []
    for url in urls:
        client = redis.Redis.from_url(url, single_connection_client=True, socket_timeout=5)
        for script in (ACQUIRE, RELEASE):
            client.script_load(script.source)  # EVALSHA below never meets NOSCRIPT
        connections.append(client.connection)
    quorum = len(connections) // 2 + 1
    token_key, channel, ttl_ms = f"{FLOOR_PREFIX}:token", f"{FLOOR_PREFIX}:released", milliseconds(ttl)
    # The holder record distlock stores with each grant (host, pid, task id), encoded once.
    holder = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "task_id": ""})
    pack = connections[0].pack_command

    def broadcast(command):
        packed = pack(*command)  # once for every master, as the backend packs once per round
        for connection in connections:
            connection.send_packed_command(packed)
        replies = []
        for connection in connections:
            try:
                replies.append(connection.read_response())
            except redis.ResponseError as exc:  # read every reply first: none may answer the next command
                replies.append(exc)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    def release(handle):
        name, key, owner, token = handle
        broadcast(RELEASE.command((key, token_key), (owner, token, channel, name)))

    def acquire(name):
        key, owner = f"{FLOOR_PREFIX}:lock:{name}", secrets.token_hex(16)
        started = time.monotonic()
        replies = broadcast(ACQUIRE.command((key, token_key), (owner, ttl_ms, holder)))
        elapsed = time.monotonic() - started
        grants = [reply[1] for reply in replies if reply[0] == 1]
        handle = (name, key, owner, max(grants, default=0))
        if len(grants) < quorum or remaining_validity(ttl, elapsed, FLOOR_DRIFT_FACTOR) <= 0:
            release(handle)
            raise RuntimeError("the floor does not wait: use it uncontended only")
        return handle

    return Contender(acquire, release)


def pottery_redlock(urls, ttl=30):
    """pottery's ``Redlock`` on ``urls``: a new lock object per acquire, blocking until it is held."""
    from pottery import Redlock  # noqa: PLC0415
    from redis import Redis  # noqa: PLC0415

    masters = frozenset(Redis.from_url(url) for url in urls)

    def acquire(name):
        lock = Redlock(key=name, masters=masters, auto_release_time=ttl)
        lock.acquire(blocking=True)
        return lock

    return Contender(acquire, lambda lock: lock.release())


def redlock_aliases():
    return [alias for alias, entry in settings.DISTLOCK.items()
            if entry.get("BACKEND") == "distlock.backends.redlock.RedlockBackend"
            and len(entry.get("OPTIONS", {}).get("URLS", ())) >= 5]


def run(*, seconds=0.25, rounds=20, contended_seconds=2.0, contended_rounds=3):
    """Print the baselines against the first Redlock alias with 5 masters or more, and the ratio to the target."""
    aliases = redlock_aliases()
    if not aliases:
        print("\nRedlock baselines: no DISTLOCK alias uses RedlockBackend with 5 masters; skipped.")
        return
    alias = aliases[0]
    urls = list(settings.DISTLOCK[alias]["OPTIONS"]["URLS"])
    here = "bench.redlock_baselines"
    api = ContenderSpec(f"distlock '{alias}' {len(urls)} masters (API)", "bench.harness.alias_contender",
                        {"alias": alias})
    backend = ContenderSpec(f"distlock '{alias}' {len(urls)} masters (backend)", "bench.harness.backend_contender",
                            {"alias": alias})
    pottery3 = ContenderSpec("pottery Redlock, 3 masters", f"{here}.pottery_redlock", {"urls": urls[:3]})
    pottery5 = ContenderSpec(f"pottery Redlock, {len(urls)} masters", f"{here}.pottery_redlock", {"urls": urls})
    bare = ContenderSpec(f"floor: its scripts, {len(urls)} masters", f"{here}.floor", {"urls": urls})

    print(f"\n== Redlock baselines: alias '{alias}' against pottery's Redlock on the same masters ==")
    alone = uncontended([api, backend, pottery3, pottery5, bare], seconds=seconds, rounds=rounds)
    print_uncontended(alone, f"Uncontended acquire+release, 1 process ({rounds} interleaved rounds of {seconds:g} s, "
                             "median ops/s)")
    together = contended([api, pottery3], seconds=contended_seconds, rounds=contended_rounds)
    print_contended(together, f"Contended: 4 processes on one key ({contended_rounds} interleaved rounds of "
                              f"{contended_seconds:g} s, medians)")

    print("\nTargets")
    for spec in (api, backend):
        ratio = alone[spec.label].ops / alone[pottery3.label].ops
        print(f"  {spec.label + ' vs ' + pottery3.label + ':':<70}{ratio:5.2f}x  "
              f"(target >= {POTTERY_RATIO_TARGET}x: {verdict(ratio, POTTERY_RATIO_TARGET)})")
        ratio = alone[spec.label].ops / alone[pottery5.label].ops
        print(f"  {spec.label + ' vs ' + pottery5.label + ':':<70}{ratio:5.2f}x  (for reference)")
        ratio = alone[spec.label].ops / alone[bare.label].ops
        print(f"  {spec.label + ' vs the floor:':<70}{ratio:5.2f}x  (for reference)")
    handoff_ratio = together[api.label].median("handoffs") / max(together[pottery3.label].median("handoffs"), 1e-9)
    print(f"  {'contended hand-offs/s vs ' + pottery3.label + ':':<70}{handoff_ratio:5.2f}x  "
          f"(Jain {together[api.label].median('jain'):.3f} vs {together[pottery3.label].median('jain'):.3f})")


def main(argv):
    run(**round_options("python -m bench.redlock_baselines", __doc__, argv))


if __name__ == "__main__":
    run_standalone(main)
