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
- ``forks``: a client holding an auto-renewed lock forks children (a pre-fork server); parent and
  children take turns on the same names: no child hangs or fails, no overlap, the held lease lives on.
- ``contended_tries``: processes x threads try one name back to back without blocking: no overlap;
  the grant rate is reported.
- ``interrupts``: a client's acquire, extend and release calls are interrupted at random points (a
  signal handler that raises, as a time limit does): no wrong grant, no misread reply, no hang, no
  lock left past its ttl, and the alias still works afterwards.

Each returns a ``Result``; the fault-injection suite of the test tree runs them too, next to the
scenarios that break servers.
"""

import os
import random
import signal
import subprocess
import threading
import time

from distlock.conformance.process import ClientDied, ClientError
from distlock.conformance.report import InterruptCounts
from distlock.conformance.run import RECOVERY_SLACK, wait_until

__all__ = [
    "CHURN_NAMES",
    "CONTENTION_TTL",
    "STORM_DEADLINE_BASE",
    "STORM_DEADLINE_PER_CALL",
    "client_crash",
    "client_pause",
    "contended_tries",
    "contention",
    "forks",
    "interrupts",
    "take_turn",
    "thread_churn",
]

#: Seconds a lock is held (by ttl) in the contention scenario: far longer than any pause it suffers.
CONTENTION_TTL = 10.0


def _expiry(ttl, acquired):
    """Seconds after which the server frees the lock of a holder that stopped: its session timeout, or the ttl."""
    return acquired.get("session_timeout") or ttl


def contention(run, backend, *, clients=8, iterations=25, ttl=CONTENTION_TTL, seed=0, fault=None,
               scenario="contention", expect_overlap=False):
    """``clients`` processes x ``iterations`` acquisitions of one lock, with short random pauses.

    ``fault`` (a callable) runs once the clients contend, for scenarios that break a server meanwhile:
    acquisitions that fail during it are then reported, not violations. ``expect_overlap``: as
    ``Run.judge`` takes it, why the fault may let critical sections overlap (each overlap must then be
    explained by it or by a lease declared lost); False: none may.
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
    result = run.judge(scenario, backend, clients, expect_overlap=expect_overlap)
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


def forks(run, backend, *, forks=3, rounds=20, names=3):
    """One client holds an auto-renewed lock and forks ``forks`` children; parent and children take turns.

    Each child must build its own backend (the parent's client threads do not run in it, and it does
    not read the parent's connections), take its ``rounds`` turns and exit 0; the parent's turns go
    on meanwhile, and its held lease must outlive the forks. A child that hangs, fails or errs, an
    overlap, or a held lease lost is a violation.
    """
    (client,) = run.spawn("forking")
    prefix = f"{run.lock_name()}:forks"
    command = client.send("forks", prefix=prefix, forks=forks, rounds=rounds, names=names)
    problems = []
    try:
        outcome = client.result(command, wait=180)
    except ClientDied:
        problems.append(_died(client))
        outcome = None
    except (ClientError, TimeoutError) as exc:
        problems.append(f"client {client.proc}: {exc}")
        outcome = None
    run.close()
    result = run.judge("fork with locks held", backend, 1, expect_overlap=False)
    result.violations += problems
    if outcome is not None:
        if any(code != 0 for code in outcome["exits"]):
            result.violations.append(f"children ended {outcome['exits']} (0 each expected)")
        counts = [outcome["parent"], *outcome["children"]]
        errors = _errors(counts)
        if errors:
            result.violations.append(f"errors: {errors}")
        if any(count["acquired"] < rounds for count in counts):
            result.violations.append(f"turns taken {[count['acquired'] for count in counts]}, {rounds} each expected")
        if outcome["held"] != "kept":
            result.violations.append(f"the lease held across the forks: {outcome['held']}")
        result.notes.append(f"{len(outcome['children'])} children forked while a lease was held; "
                            f"{sum(count['acquired'] for count in counts)} turns in all")
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


#: Seconds after which an interrupt storm's client counts as hung: a base plus a bound per call (a short
#: acquire waits 0.05 s; a machine shared with other test runs may make a call take a tenth of a second).
STORM_DEADLINE_BASE = 30.0
STORM_DEADLINE_PER_CALL = 0.1


def interrupts(run, backend, *, operations=200, ttl=2.0, wait=0.05, names=3, seed=0):
    """Interrupt ``operations`` lock calls of one client at random points; judge grants, errors, hangs, leftovers.

    One client makes the calls (``Client.interrupts``: SIGALRM raises in it at a random point of
    each acquire, extend and release, aimed at the backend's own call durations); a holder process
    keeps one name held all along and takes turns on the client's first name; an observer lists
    what is held afterwards. Violations: a grant while another owner held the lock (overlapping
    critical sections), an unexpected exception or a valid lease found gone (a misread reply), a
    client that does not finish by its deadline (a hang, killed), a name still held ttl + 1 s (+ the
    session timeout) after the client exited or not acquirable then, an alias that no longer works
    once the timer is off. The result carries ``InterruptCounts``.
    """
    client, holder, observer = run.spawn("interrupted", "holder", "observer")
    base = run.lock_name()
    own = [f"{base}:own-{i}" for i in range(names)]
    held = f"{base}:held"
    after = [f"{base}:after-{i}" for i in range(3)]
    stop = run.directory / "stop-contending"
    counts = InterruptCounts()
    problems = []

    taken = holder.call("acquire", name=held, ttl=10, timeout=30, auto_renew=True)
    holder.call("enter", name=held)
    contending = holder.send("contend", name=own[0], stop=str(stop), ttl=ttl, timeout=1.0, seed=seed)
    deadline = STORM_DEADLINE_BASE + operations * STORM_DEADLINE_PER_CALL
    storm = None
    command = client.send("interrupts", names=own, held=held, after=after, ttl=ttl, wait=wait,
                          operations=operations, seed=seed)
    try:
        storm = client.result(command, wait=deadline)
    except TimeoutError:
        counts.hangs += 1
        problems.append(f"the client did not finish {operations} calls within {deadline:g} s: "
                        f"{_hang_dump(client)}")
        counts.tracebacks.append(client.stderr_tail(20000))
    except ClientDied:
        problems.append(_died(client))
        counts.tracebacks.append(client.stderr_tail(20000))
    except ClientError as exc:
        problems.append(f"the storm failed: {exc}")
    run.finish(client)
    exited = time.monotonic()

    stop.touch()
    try:
        holder.result(contending, wait=60)
        state = holder.call("check", name=held)["state"]
        if state != "valid":
            problems.append(f"the holder's lock on {held!r} was {state} after the storm")
        holder.call("exit", name=held)
        holder.call("release", name=held)
    except (ClientError, ClientDied, TimeoutError) as exc:
        problems.append(f"the holder failed: {exc}")
    run.finish(holder)

    bound = ttl + 1 + (taken["session_timeout"] or 0)
    left, freed_after = _locks_left(observer, f"{base}:", [*own, held, *after], exited + bound)
    counts.locks_left = len(left)
    if left:
        problems.append(f"{len(left)} lock(s) still held {bound:g} s after the client exited: {', '.join(left)}")
    run.close()

    result = run.judge("interrupts mid-call", backend, 1, expect_overlap=False)
    counts.wrong_grants = result.overlaps
    if storm is not None:
        counts.operations = storm["operations"]
        counts.interrupted = storm["interrupted"]
        counts.misread_replies = len(storm["misread"])
        counts.seconds = storm["seconds"]
        counts.tracebacks = storm["tracebacks"] + counts.tracebacks
        if storm["misread"]:
            problems.append(f"{len(storm['misread'])} misread repl(ies): " + "; ".join(storm["misread"][:3]))
        if storm["granted_busy"]:
            problems.append("granted while held: " + "; ".join(storm["granted_busy"][:3]))
        if storm["unusable"]:
            problems.append("the alias no longer worked after the storm: " + "; ".join(storm["unusable"]))
        result.notes += _storm_notes(storm)
        if storm["left_while_alive"]:
            result.notes.append(f"{len(storm['left_while_alive'])} lock(s) still held ttl + 1 s after the storm "
                                f"while the client lived: {', '.join(storm['left_while_alive'])}")
    if freed_after is not None:
        result.notes.append(f"every name free {freed_after:.1f} s after the client exited")
    result.interrupts = counts
    result.violations += problems
    return result


def _hang_dump(client):
    """Make a hung client dump its threads' stacks (faulthandler, on SIGABRT), kill it, return the main stack."""
    try:
        os.kill(client.pid, signal.SIGABRT)
        client.process.wait(10)
    except (OSError, subprocess.TimeoutExpired):
        pass
    client.kill()
    lines = client.stderr_tail(20000).strip().splitlines()
    main = next((index for index in reversed(range(len(lines))) if lines[index].startswith(("Current thread",
                                                                                            "Thread 0x"))), None)
    shown = lines[main:main + 8] if main is not None else lines[-8:]
    return " | ".join(line.strip() for line in shown)


def _locks_left(observer, prefix, names, deadline):
    """Poll until nothing is held under ``prefix`` and each of ``names`` can be acquired afresh, or ``deadline``.

    A name may be listed as free and still refuse a non-blocking acquire for a while (a waiter's
    queue entry that has not expired yet), so each is tried until it is granted or the deadline
    passes. Return (each name still held or not acquirable at the deadline, with why; seconds until
    every name was free, or None).
    """
    started = time.monotonic()
    listed = observer.call("held", prefix=prefix)
    while listed and time.monotonic() < deadline:
        time.sleep(0.1)
        listed = observer.call("held", prefix=prefix)
    left = {info["name"]: "listed as held" for info in listed}
    for name in names:
        while name not in left:
            try:
                observer.call("acquire", name=name, ttl=5, blocking=False)
            except ClientError as exc:
                if time.monotonic() >= deadline:
                    left[name] = f"not listed as held, but a non-blocking acquire: {exc.error}"
                else:
                    time.sleep(0.1)
                continue
            observer.call("release", name=name)
            break
    freed = None if left else time.monotonic() - started
    return [f"{name} ({why})" for name, why in sorted(left.items())], freed


def _storm_notes(storm):
    """Return what the storm measured but does not judge: where interrupts landed, what they turned into."""
    landed = sorted(storm["landed"].items(), key=lambda item: -item[1])
    notes = [f"{storm['operations']} calls in {storm['seconds']:.1f} s, {storm['interrupted']} interrupted, landing in "
             + ", ".join(f"{site} {count}" for site, count in landed[:5])]
    if storm["converted"]:
        notes.append(f"{storm['converted']} interrupt(s) turned into BackendUnavailable")
    if storm["swallowed"]:
        notes.append(f"{len(storm['swallowed'])} interrupt(s) swallowed, the call going on: "
                     + ", ".join(storm["swallowed"][:3]))
    if storm["finalizers"]:
        notes.append(f"{len(storm['finalizers'])} interrupt(s) dropped by Python in a finalizer or weakref callback")
    slowest = storm["slowest"]
    if slowest["seconds"] > 1:
        notes.append(f"slowest call {slowest['seconds']:.1f} s: {slowest['call']}")
    return notes
