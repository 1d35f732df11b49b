"""The scenarios that disturb only client processes: what ``distlock verify`` runs against a deployment.

- ``contention``: N clients contend for one lock, each acquisition claims and increments a fenced
  row; the parent freezes random clients for short moments (well within the ttl). No overlap, no
  failure, no refused write may happen.
- ``client_pause``: the holder is frozen (SIGSTOP) past its expiry, another client acquires and
  writes, the holder wakes and writes with its old token: the un-fenced critical sections overlap
  (expected, reported), the store must refuse the stale write.
- ``client_crash``: the holder is killed (SIGKILL) in its critical section; a waiting client must get
  the lock once the server has noticed (ttl, or session timeout), and its writes must be accepted.
- ``thread_churn``: clients whose threads start and end all the time (executor generations, a thread
  per request) take locks on five names: no crash, no error, no overlap.
- ``contended_tries``: processes x threads try one name back to back without blocking: no overlap;
  the grant rate is reported.

Each returns a ``Result``; the fault-injection suite of the test tree runs them too, next to the
scenarios that break servers.
"""

import random
import threading
import time

from distlock.conformance.process import ClientDied, ClientError
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


#: Names the thread-churn clients share (``order:{n % 5}``, as a shop's requests would).
CHURN_NAMES = 5


def _died(client):
    """Describe how a client process that stopped answering ended: its exit status and stderr's last lines."""
    try:
        code = client.process.wait(10)
    except Exception:  # noqa: BLE001 - still running: it hung rather than died
        code = None
    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}"
    lines = client.stderr_tail(20000).strip().splitlines()
    # faulthandler's dump: "Fatal Python error: ...", then every thread; the crashing one is "Current thread".
    fatal = [line for line in lines if line.startswith("Fatal Python error")][-1:]
    current = next((index for index in reversed(range(len(lines))) if lines[index].startswith("Current thread")),
                   None)
    shown = fatal + (lines[current:current + 4] if current is not None else lines[-6:])
    return f"client {client.proc} died ({how}): " + " | ".join(line.strip() for line in shown)


def _errors(counts):
    """Return "N TypeName, M OtherName (first: ...)" for the error counts of client commands, or ""."""
    errors = {}
    for count in counts:
        for kind, number in count["errors"].items():
            errors[kind] = errors.get(kind, 0) + number
    if not errors:
        return ""
    first = next(count["first_error"] for count in counts if count["first_error"])
    return ", ".join(f"{number} {kind}" for kind, number in sorted(errors.items())) + f" (first: {first})"


def thread_churn(run, backend, *, seconds=3.0, processes=1, ttl=10.0, timeout=30.0, seed=0):
    """Clients whose threads come and go take locks on ``CHURN_NAMES`` names for ``seconds``.

    ``processes`` clients run executor generations (a ``ThreadPoolExecutor`` of 10 threads doing 40
    acquire/release each, recreated again and again) and as many serve a thread per request (a new
    thread per request, 8 at once, ``with distlock.lock(...)``), all on the same names. A crash,
    an error or an overlap is a violation; so is a client that takes no lock at all.
    """
    modes = ["executor"] * processes + ["request"] * processes
    clients = run.spawn(*[f"{mode}-{i % processes}" for i, mode in enumerate(modes)])
    prefix = f"{run.lock_name()}:order"
    sent = [(client, client.send("churn", prefix=prefix, mode=mode, seconds=seconds, names=CHURN_NAMES, ttl=ttl,
                                 timeout=timeout, seed=seed + i))
            for i, (client, mode) in enumerate(zip(clients, modes))]
    counts, problems, idle = [], [], []
    for client, command in sent:
        try:
            count = client.result(command, wait=seconds + timeout + 120)
        except ClientDied:
            problems.append(_died(client))
            continue
        except (ClientError, TimeoutError) as exc:
            problems.append(f"client {client.proc}: {exc}")
            continue
        counts.append(count)
        if count["acquired"] == 0:
            idle.append(client.proc)
    run.close()
    result = run.judge("threads that come and go", backend, len(sent), expect_overlap=False)
    result.violations += problems
    errors = _errors(counts)
    if errors:
        result.violations.append(f"errors: {errors}")
    if idle:
        result.violations.append(f"no lock taken by {', '.join(idle)}")
    if counts:
        threads = sum(count["threads"] for count in counts)
        result.notes.append(f"{threads} threads started in {seconds:g} s")
    return result


def contended_tries(run, backend, *, processes=2, threads=20, seconds=4.0, ttl=10.0, hold=0.003):
    """``processes`` x ``threads`` threads try one name back to back (``blocking=False``), holding ``hold`` s.

    Every granted try is a critical section: none may overlap another. The grant rate (granted tries
    per second) is measured and reported: a lock that tries keep failing for each other is free most
    of the time and still rarely granted. Errors are reported, not violations.
    """
    clients = run.spawn(*[f"trying-{i}" for i in range(processes)])
    name = run.lock_name()
    start = time.monotonic_ns() + int(0.5e9)  # every client's threads start together
    sent = [(client, client.send("tries", name=name, threads=threads, start=start, seconds=seconds, ttl=ttl,
                                 hold=hold)) for client in clients]
    counts, problems = [], []
    for client, command in sent:
        try:
            counts.append(client.result(command, wait=seconds + 120))
        except ClientDied:
            problems.append(_died(client))
        except (ClientError, TimeoutError) as exc:
            problems.append(f"client {client.proc}: {exc}")
    run.close()
    result = run.judge("contended tries", backend, processes, expect_overlap=False)
    result.violations += problems
    tries = sum(count["tries"] for count in counts)
    result.grants_per_second = result.acquisitions / seconds
    result.tries_per_second = tries / seconds
    result.notes.append(f"{result.grants_per_second:.1f} grants/s: {result.acquisitions} of {tries} tries granted "
                        f"in {seconds:g} s, {processes} processes x {threads} threads")
    errors = _errors(counts)
    if errors:
        result.notes.append(f"errors: {errors}")
    return result
