"""Scenario 8 on every backend: a slow, then black-holed network between one client and the servers.

The client reaches every server through a ``FaultProxy`` (PostgreSQL through a ``DATABASES`` entry of
its own). Under a delay, acquire still works and never claims more validity than the ttl minus the
time it took; black-holed, it gives up within its timeout (plus the one round trip ZooKeeper and
etcd allow a non-blocking attempt) with ``BackendUnavailable``, never hanging; healed, it works again.
"""

import time
from contextlib import ExitStack

import pytest
from django.db import connections

from distlock.conformance.process import ClientError
from distlock.conformance.run import RECOVERY_SLACK
from tests.faults.conftest import DATABASES
from tests.faults.proxy import FaultProxy
from tests.faults.targets import TARGETS, shared_address

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]

#: Seconds each packet is held, each way, in the slow phase.
DELAY = 0.25
#: The timeout of acquisitions while black-holed; the seconds a non-blocking attempt may take.
WAIT = 1.5
ROUND_TRIP_GRACE = 1.0
TTL = 10.0


def _port(address):
    return int(address.rsplit(":", 1)[1].split("/", 1)[0])


def proxied_aliases(key, stack):
    """Return ``(aliases, databases, proxies)``: the alias under test through proxies, started on ``stack``."""
    target = TARGETS[key]
    address = shared_address(target.server)
    if address is None:
        target.shared_entry()  # skips, or fails under make test

    def proxy(port):
        return stack.enter_context(FaultProxy(port))

    if key == "database":
        settings_dict = connections["postgres"].settings_dict
        front = proxy(int(settings_dict["PORT"]))
        database = {"ENGINE": settings_dict["ENGINE"], "HOST": "127.0.0.1", "PORT": str(front.port),
                    "USER": settings_dict["USER"], "NAME": settings_dict["NAME"]}
        entry = target.entry(database="postgres_proxied")
        return {"proxied": entry}, {"postgres_proxied": database}, [front]
    if key == "redis":
        front = proxy(_port(address["url"]))
        return {"proxied": target.entry(url=f"redis://127.0.0.1:{front.port}/0")}, {}, [front]
    if key == "redlock":
        fronts = [proxy(_port(url)) for url in address["urls"]]
        entry = target.entry(urls=[f"redis://127.0.0.1:{p.port}/0" for p in fronts])
        # Redlock gives each master REQUEST_TIMEOUT to answer (0.25 s by default): "slow" must stay below it.
        entry["OPTIONS"]["REQUEST_TIMEOUT"] = 1.0
        return {"proxied": entry}, {}, fronts
    members = address["hosts" if key == "zookeeper" else "endpoints"].split(",")
    fronts = [proxy(_port(member)) for member in members]
    joined = ",".join(f"127.0.0.1:{front.port}" for front in fronts)
    entry = target.entry(hosts=joined) if key == "zookeeper" else target.entry(endpoints=joined)
    return {"proxied": entry}, {}, fronts


def timed(client, op, wait=120, **args):
    """Return ``(answer or ClientError, seconds)`` of one command."""
    started = time.monotonic()
    try:
        answer = client.call(op, wait=wait, **args)
    except ClientError as exc:
        answer = exc
    return answer, time.monotonic() - started


@pytest.mark.parametrize("key", list(TARGETS))
def test_slow_then_black_holed_network(key, fault_run, safety):
    target = TARGETS[key]
    problems = []
    with ExitStack() as stack:
        aliases, databases, proxies = proxied_aliases(key, stack)
        run = fault_run(aliases, databases=databases)
        (client,) = run.spawn("behind-proxy")
        warm = run.lock_name()
        client.call("acquire", name=warm, ttl=TTL, timeout=30)
        client.call("release", name=warm)

        # Slow: every packet waits DELAY each way. Acquire works and claims no more than ttl - elapsed.
        for front in proxies:
            front.delay(DELAY)
        name = run.lock_name()
        row = run.row() if run.fenced else None
        held, _ = timed(client, "acquire", name=name, ttl=TTL, timeout=60)
        if isinstance(held, ClientError):
            problems.append(f"acquire under a {DELAY:g}s delay failed: {held}")
        else:
            if held["remaining"] > TTL - held["elapsed"] + 0.01:
                problems.append(f"acquire took {held['elapsed']:.2f}s but claims {held['remaining']:.2f}s "
                                f"of a {TTL:g}s ttl")
            if row is not None:
                client.call("claim", name=name, row=row)
                client.call("write", name=name, row=row)
            client.call("release", name=name)

        # Black-holed: connections stay open, nothing gets through. Acquire gives up in time.
        for front in proxies:
            front.heal()
            front.blackhole()
        for blocking, limit in ((True, WAIT + ROUND_TRIP_GRACE), (False, ROUND_TRIP_GRACE)):
            failed, took = timed(client, "acquire", name=run.lock_name(), ttl=TTL, timeout=WAIT, blocking=blocking)
            if not isinstance(failed, ClientError) or failed.error != "BackendUnavailable":
                problems.append(f"black-holed acquire (blocking={blocking}) returned {failed}")
            if took > limit + RECOVERY_SLACK:
                problems.append(f"black-holed acquire (blocking={blocking}) took {took:.2f}s, "
                                f"more than {limit:g}s + {RECOVERY_SLACK:g}s")

        # Healed: the proxy dropped bytes while black-holing, so the connections are cut and made anew.
        for front in proxies:
            front.heal()
            front.cut()
        name = run.lock_name()
        held, _ = timed(client, "acquire", name=name, ttl=TTL, timeout=30)
        if isinstance(held, ClientError):
            problems.append(f"acquire after healing failed: {held}")
        else:
            client.call("release", name=name)

        if key == "redlock":
            # A minority of masters black-holed: the majority still grants, within a few node timeouts.
            for front in proxies[:2]:
                front.blackhole()
            name = run.lock_name()
            held, _ = timed(client, "acquire", name=name, ttl=TTL, timeout=WAIT)
            if isinstance(held, ClientError):
                problems.append(f"acquire with 2 of 5 masters black-holed failed: {held}")
            else:
                client.call("release", name=name)
            for front in proxies[:2]:
                front.heal()
                front.cut()
        run.close()
    result = safety.record(run.judge("slow network", target.label, 1, expect_overlap=False))
    result.violations += problems
    assert result.ok, result.violations
