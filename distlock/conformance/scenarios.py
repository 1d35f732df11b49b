"""The scenarios that disturb only client processes: what ``distlock verify`` runs against a deployment.

- ``contention``: N clients contend for one lock, each acquisition claims and increments a fenced
  row; the parent freezes random clients for short moments (well within the ttl). No overlap, no
  failure, no refused write may happen.
- ``client_pause``: the holder is frozen (SIGSTOP) past its expiry, another client acquires and
  writes, the holder wakes and writes with its old token: the un-fenced critical sections overlap
  (expected, reported), the store must refuse the stale write.
- ``client_crash``: the holder is killed (SIGKILL) in its critical section; a waiting client must get
  the lock once the server has noticed (ttl, or session timeout), and its writes must be accepted.

Each returns a ``Result``; the fault-injection suite of the test tree runs them too, next to the
scenarios that break servers.
"""

import random
import threading
import time

from distlock.conformance.process import ClientError
from distlock.conformance.run import RECOVERY_SLACK, wait_until

#: Seconds a lock is held (by ttl) in the contention scenario: far longer than any pause it suffers.
CONTENTION_TTL = 10.0


def _expiry(ttl, acquired):
    """Seconds after which the server frees the lock of a holder that stopped: its session timeout, or the ttl."""
    return acquired.get("session_timeout") or ttl


def contention(run, backend, *, clients=8, iterations=25, ttl=CONTENTION_TTL, seed=0, fault=None,
               scenario="contention"):
    """``clients`` processes x ``iterations`` acquisitions of one lock, with short random pauses.

    ``fault`` (a callable) runs once the clients contend, for scenarios that break a server meanwhile:
    acquisitions that fail during it are then reported, not violations.
    """
    procs = run.spawn(*[f"contender-{i}" for i in range(clients)])
    name = run.lock_name()
    row = run.row() if run.fenced else None
    loops = [client.send("loop", name=name, count=iterations, ttl=ttl, timeout=120, row=row, seed=seed + i)
             for i, client in enumerate(procs)]
    stop = threading.Event()
    nemesis = threading.Thread(target=_short_pauses, args=(procs, stop, random.Random(seed)), daemon=True)
    nemesis.start()
    try:
        if fault is not None:
            fault()
        counts = [client.result(loop, wait=60 + iterations * clients * 5) for client, loop in zip(procs, loops)]
    finally:
        stop.set()
        nemesis.join()
    run.close()
    result = run.judge(scenario, backend, clients, expect_overlap=False)
    failed = sum(count["failed"] for count in counts)
    if failed and fault is None:
        result.violations.append(f"{failed} acquisition(s) failed with no fault injected")
    elif failed:
        result.notes.append(f"{failed} acquisition(s) failed during the fault")
    return result


def _short_pauses(procs, stop, rng):
    """Freeze a random client for 50-200 ms every 0.2-0.5 s: scheduling hiccups, far within the ttl."""
    while not stop.wait(rng.uniform(0.2, 0.5)):
        client = rng.choice(procs)
        if not client.alive:
            continue
        client.pause()
        time.sleep(rng.uniform(0.05, 0.2))
        client.resume()


def client_pause(run, backend, *, ttl=2.0, runs=1):
    """Freeze the holder past its expiry; the next holder writes; the old one wakes and writes (Kleppmann)."""
    holder, other = run.spawn("paused-holder", "next-holder")
    for _ in range(runs):
        name = run.lock_name()
        row = run.row() if run.fenced else None
        held = holder.call("acquire", name=name, ttl=ttl, timeout=30)
        pause_for = 2 * max(ttl, held["session_timeout"] or 0) + 1
        if row is not None:
            holder.call("claim", name=name, row=row)
        holder.call("enter", name=name)
        paused_at = time.monotonic()
        holder.pause(owner=held["owner"], lock=name)
        try:
            waiting = other.send("acquire", name=name, ttl=max(ttl, 5), timeout=pause_for + 120)
            try:
                other.result(waiting, wait=max(0.1, paused_at + pause_for - time.monotonic()))
                waiting = None
                take_turn(other, name, row)
            except TimeoutError:
                pass  # the lock outlived the pause: the next holder gets it after the release below
            wait_until(paused_at + pause_for)
        finally:
            holder.resume()
        if row is not None:
            holder.call("write", name=name, row=row, via="token")  # judged by the store alone
            holder.call("write", name=name, row=row, via="lease")  # refused by the lease itself: expired
        holder.call("exit", name=name)
        holder.call("release", name=name)
        if waiting is not None:
            other.result(waiting, wait=180)
            take_turn(other, name, row)
    run.close()
    return run.judge("client pause", backend, runs,
                     expect_overlap="a lock with a ttl cannot exclude a holder paused past it; fencing can")


def take_turn(client, name, row):
    """Claim ``row`` (None: no store), enter, write, leave and release: the rest of a holder's turn."""
    if row is not None:
        client.call("claim", name=name, row=row)
    client.call("enter", name=name)
    if row is not None:
        client.call("write", name=name, row=row)
    client.call("exit", name=name)
    client.call("release", name=name)


def client_crash(run, backend, *, ttl=2.0, runs=1):
    """Kill the holder in its critical section; measure how long until a waiting client gets the lock."""
    doomed = run.spawn(*[f"killed-holder-{i}" for i in range(runs)])
    (waiter,) = run.spawn("waiter")
    bound = None
    for holder in doomed:
        name = run.lock_name()
        row = run.row() if run.fenced else None
        held = holder.call("acquire", name=name, ttl=ttl, timeout=30)
        expiry = _expiry(ttl, held)
        bound = max(bound or 0, expiry + RECOVERY_SLACK)
        if row is not None:
            holder.call("claim", name=name, row=row)
        holder.call("enter", name=name)
        waiting = waiter.send("acquire", name=name, ttl=max(ttl, 5), timeout=expiry * 3 + 60)
        time.sleep(0.3)  # the waiter queues (or polls) before the holder dies
        holder.kill(owner=held["owner"], lock=name)
        try:
            waiter.result(waiting, wait=expiry * 3 + 90)
        except ClientError as exc:
            run.close()
            result = run.judge("client crash", backend, runs, expect_overlap=False)
            result.violations.append(f"the lock of a killed holder was never freed: {exc}")
            return result
        take_turn(waiter, name, row)
    run.close()
    return run.judge("client crash", backend, runs, expect_overlap=False, recovery_bound=bound)
