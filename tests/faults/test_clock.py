"""Scenario 7 on every backend: the holder's wall clock jumps +1 h, -1 h and freezes; nothing else changes.

Validity, renewal and timeouts must run on the monotonic clock, and the server's expiry on its own
clock: a client whose wall clock is wrong neither loses its lease early, nor keeps it longer, nor
waits longer or shorter than its timeout. The jumping client runs ``tests.faults.fakeclock``.
"""

import time

import pytest

from distlock.conformance.process import ClientError
from distlock.conformance.run import RECOVERY_SLACK
from tests.conftest import long_only
from tests.faults.conftest import DATABASES
from tests.faults.targets import TARGETS

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]

TTL = 2.0
#: Seconds an acquire waits in part 3; ZooKeeper and etcd may take one more second to give up.
WAIT = 2.0
WAIT_GRACE = 1.0


@pytest.mark.parametrize("key", [key if key == "database" else pytest.param(key, marks=long_only)
                                 for key in TARGETS])
def test_wall_clock_jumps_change_nothing(key, fault_run, safety):
    target = TARGETS[key]
    run = fault_run({"under_test": target.shared_entry()}, module="tests.faults.fakeclock")
    (jumper,) = run.spawn("clock-jumper")
    (steady,) = run.spawn("steady-clock", module="distlock.conformance.client")
    problems = []

    # 1. A renewed lease stays valid, and never claims more than its ttl, through +1 h, -1 h and a freeze.
    name = run.lock_name()
    row = run.row() if run.fenced else None
    jumper.call("acquire", name=name, ttl=TTL, timeout=30, auto_renew=True)
    if row is not None:
        jumper.call("claim", name=name, row=row)
    jumper.call("enter", name=name)
    for setting in ({"offset": 3600}, {"offset": -3600}, {"freeze": True}):
        jumper.call("clock", control=True, **setting)
        seen = jumper.call("probe", function="tests.faults.probes.wall_clock")
        if "offset" in setting:
            assert abs(seen["time"] - time.time() - setting["offset"]) < 60, "the fake clock did not move"
            assert abs(seen["datetime"] - seen["time"]) < 60, "datetime.now() does not follow the fake clock"
        states = [change["state"] for change in jumper.call("watch", name=name, seconds=TTL * 1.2)["changes"]]
        if states != ["valid"]:
            problems.append(f"clock {setting}: the renewed lease went {' -> '.join(states)}")
        remaining = jumper.call("check", name=name)["remaining"]
        if remaining > TTL:
            problems.append(f"clock {setting}: the lease claims {remaining:.2f}s, more than its ttl")
    if row is not None and jumper.call("write", name=name, row=row)["outcome"] != "accepted":
        problems.append("the renewed holder's write was refused")
    jumper.call("exit", name=name)
    if not jumper.call("release", name=name)["released"]:
        problems.append("the renewed lease was gone at release")

    # 2. The lock of a holder an hour ahead is freed after its ttl, neither sooner nor later.
    jumper.call("clock", control=True, offset=3600)
    name = run.lock_name()
    asked = time.monotonic_ns()
    held = jumper.call("acquire", name=name, ttl=TTL, timeout=30)
    started = time.monotonic()
    steady.call("acquire", name=name, ttl=TTL, timeout=TTL * 5 + 10)
    freed_after = time.monotonic() - started
    # The server ended the lease by its ttl, not a release: the checker needs that evidence (P4).
    run.nemesis.record("expired", lock=name, owner=held["owner"], since=asked + int(TTL * 1e9))
    if not TTL - 0.5 <= freed_after <= TTL + RECOVERY_SLACK:
        problems.append(f"a {TTL:g}s lock held under a clock 1 h ahead was freed after {freed_after:.2f}s")
    if jumper.call("check", name=name)["state"] != "lost":
        problems.append("the lease still claims validity after its ttl ran out")
    steady.call("release", name=name)
    jumper.call("release", name=name)

    # 3. An acquire gives up after its timeout with the clock frozen, and with the clock set back mid-wait.
    name = run.lock_name()
    steady.call("acquire", name=name, ttl=60, timeout=30)
    jumper.call("clock", control=True, freeze=True)
    for jump in (None, -3600):
        started = time.monotonic()
        waiting = jumper.send("acquire", name=name, ttl=TTL, timeout=WAIT)
        if jump is not None:
            time.sleep(WAIT / 4)
            jumper.call("clock", control=True, offset=jump)
        try:
            jumper.result(waiting, wait=60)
            problems.append("acquired a lock another client holds")
        except ClientError as exc:
            if exc.error != "LockNotAcquired":
                problems.append(f"a timed-out acquire raised {exc}")
        waited = time.monotonic() - started
        if not WAIT - 0.1 <= waited <= WAIT + WAIT_GRACE + RECOVERY_SLACK:
            problems.append(f"an acquire with timeout {WAIT:g}s (clock jump {jump}) gave up after {waited:.2f}s")
    steady.call("release", name=name)

    run.close()
    result = safety.record(run.judge("client wall-clock jump", target.label, 1, expect_overlap=False))
    result.violations += problems
    assert result.ok, result.violations
