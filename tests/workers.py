"""Client processes for multi-process tests: ``python -m tests.workers SCENARIO JSON``.

Each scenario writes JSON lines to stdout (or to the file named in its arguments) so the parent can
check tokens and critical sections. Timestamps are ``time.monotonic_ns()``: CLOCK_MONOTONIC is shared
system-wide on Linux, so intervals from different processes compare directly.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child_env(**extra):
    """The environment of a child process: the parent's test settings, pointed at the test databases."""
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="tests.settings", DISTLOCK_TEST_CHILD="1", PYTHONPATH=str(ROOT))
    env.update(extra)
    return env


def spawn(scenario, env=None, **arguments):
    """Start one worker process running ``scenario``, with ``env`` added to its environment; its stdout is a pipe
    of JSON lines."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.workers", scenario, json.dumps(arguments)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=child_env(**(env or {})), cwd=ROOT,
    )


def read_events(process, timeout=120):
    """Wait for ``process`` and return its JSON events; fail loudly with its stderr if it failed."""
    out, err = process.communicate(timeout=timeout)
    if process.returncode != 0:
        raise AssertionError(f"worker exited with {process.returncode}:\n{err[-4000:]}")
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def emit(**event):
    print(json.dumps(event), flush=True)


def hammer(alias, name, count, ttl, hold_ms=0):
    """Acquire ``name`` ``count`` times; report each token and critical section."""
    import distlock  # noqa: PLC0415 - after django.setup()

    for _ in range(count):
        with distlock.lock(name, ttl=ttl, timeout=120, using=alias) as lease:
            enter = time.monotonic_ns()
            if hold_ms:
                time.sleep(hold_ms / 1000)
            exit_ = time.monotonic_ns()
            emit(token=lease.token, enter=enter, exit=exit_, pid=os.getpid())


def hold(alias, name, ttl):
    """Acquire ``name``, report it, then sleep until killed."""
    import distlock  # noqa: PLC0415

    lease = distlock.acquire(name, ttl=ttl, timeout=30, using=alias)
    emit(token=lease.token, owner=lease.owner, pid=os.getpid(), session_timeout=lease.session_timeout)
    time.sleep(3600)


def hold_then_check(alias, name, ttl, options=None):
    """Acquire ``name`` (on ``alias`` with extra backend ``options``), report, then on a line from stdin
    report what ``lease.check()`` says at once: a process frozen meanwhile checks before anything else runs."""
    from django.conf import settings  # noqa: PLC0415

    import distlock  # noqa: PLC0415

    entry = settings.DISTLOCK[alias]
    settings.DISTLOCK = {**settings.DISTLOCK, alias: {**entry, "OPTIONS": {**entry["OPTIONS"], **(options or {})}}}
    lease = distlock.acquire(name, ttl=ttl, timeout=30, using=alias)
    emit(token=lease.token, session_timeout=lease.session_timeout, pid=os.getpid())
    sys.stdin.readline()
    try:
        lease.check()
        emit(check="ok")
    except distlock.LockError as exc:
        emit(check=type(exc).__name__, message=str(exc))


def try_hammer(alias, name, ready_path, recipe="distlock", threads=20, seconds=8.0, hold_ms=3):
    """Once connected, touch ``ready_path``; on a line from stdin, try ``name`` back to back with
    ``blocking=False`` from ``threads`` threads for ``seconds``, holding ``hold_ms`` when granted.

    ``recipe`` "distlock" tries ``distlock.acquire`` on ``alias``; "kazoo" tries kazoo's own recipe,
    ``KazooClient.Lock(name).acquire(blocking=False)`` (``name`` a znode path), on the ensemble of
    ``alias``, with one client per process as distlock has. Reports each granted critical section
    (recorded by the threads, emitted at the end so lines never interleave), then the number of tries
    and every unexpected error.
    """
    import threading  # noqa: PLC0415

    from django.conf import settings  # noqa: PLC0415
    from kazoo.client import KazooClient  # noqa: PLC0415

    import distlock  # noqa: PLC0415

    if recipe == "kazoo":
        client = KazooClient(hosts=settings.DISTLOCK[alias]["OPTIONS"]["HOSTS"])
        client.start(timeout=30)

        def attempt():
            lock = client.Lock(name)
            return lock if lock.acquire(blocking=False) else None

        def describe(lock):
            return lock.node, None
    else:
        distlock.acquire(f"{name}:warm-up", ttl=10, timeout=30, using=alias).release()  # connect first

        def attempt():
            try:
                return distlock.acquire(name, ttl=10, blocking=False, using=alias)
            except distlock.LockNotAcquired:
                return None

        def describe(lease):
            return lease.owner, lease.token

    Path(ready_path).touch()
    sys.stdin.readline()
    end = time.monotonic() + seconds
    grants, tries, errors = [], [], []

    def contend():
        count = 0
        while time.monotonic() < end:
            count += 1
            try:
                held = attempt()
            except Exception as exc:  # noqa: BLE001 - reported, and the test fails on it
                errors.append(repr(exc))
                continue
            if held is None:
                continue
            enter = time.monotonic_ns()
            time.sleep(hold_ms / 1000)
            exit_ = time.monotonic_ns()
            owner, token = describe(held)
            grants.append({"owner": owner, "token": token, "enter": enter, "exit": exit_})
            held.release()
        tries.append(count)

    workers = [threading.Thread(target=contend) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    for grant in grants:
        emit(pid=os.getpid(), **grant)
    emit(tries=sum(tries), errors=errors)
    if recipe == "kazoo":
        client.stop()
        client.close()


def interrupt_storm(alias, prefix, operations, ttl, names=4, max_interval_ms=None, seed=None):  # noqa: C901
    """Non-blocking acquires and releases of ``names`` locks, each call with ``SIGALRM`` armed to raise at a
    random point within ``max_interval_ms`` (what Celery's soft time limit does), ``operations`` times.
    By default the interval starts at twice the median call time measured first, then follows the calls:
    it grows by 5% after each interrupted call and shrinks by 5% after each completed one, so interrupts
    land all over the calls and about half of them complete, however loaded the machine is.

    Then release what is known held, report the counts and the monotonic time, and on a line from
    stdin show the alias still works: every name acquired (non-blocking) and released again. The
    process stays alive in between, so its session (and anything leaked under it) stays too.
    """
    import random  # noqa: PLC0415
    import signal  # noqa: PLC0415

    import distlock  # noqa: PLC0415

    class Interrupted(Exception):  # noqa: N818 - named after what happened
        pass

    def interrupt(signum, frame):
        raise Interrupted()

    rng = random.Random(seed)
    distlock.acquire(f"{prefix}:warm-up", ttl=ttl, timeout=30, using=alias).release()  # connect first
    adapt = max_interval_ms is None
    if adapt:  # aim at the calls: start at twice the median time of an acquire or release
        timings = []
        for _ in range(20):
            started = time.monotonic()
            lease = distlock.acquire(f"{prefix}:warm-up", ttl=ttl, blocking=False, using=alias)
            timings.append(time.monotonic() - started)
            started = time.monotonic()
            lease.release()
            timings.append(time.monotonic() - started)
        max_interval_ms = 2000 * sorted(timings)[len(timings) // 2]
    signal.signal(signal.SIGALRM, interrupt)
    held, counts = {}, {"granted": 0, "refused": 0, "released": 0, "interrupted": 0, "errors": []}
    for _ in range(operations):
        interrupted_before = counts["interrupted"]
        try:
            name = f"{prefix}:{rng.randrange(names)}"
            try:
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.0001, max_interval_ms / 1000))
                if name in held:
                    lease = held.pop(name)
                    lease.release()
                    counts["released"] += 1
                else:
                    held[name] = distlock.acquire(name, ttl=ttl, blocking=False, using=alias)
                    counts["granted"] += 1
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except Interrupted:
            counts["interrupted"] += 1
        except distlock.LockNotAcquired:
            counts["refused"] += 1
        except Exception as exc:  # noqa: BLE001 - reported, and the test fails on it
            counts["errors"].append(repr(exc))
        if adapt:
            max_interval_ms *= 1.05 if counts["interrupted"] > interrupted_before else 0.95
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    for lease in held.values():
        lease.release()
    emit(storm=counts, end=time.monotonic(), pid=os.getpid(), max_interval_ms=max_interval_ms)
    sys.stdin.readline()
    usable = []
    for i in range(names):
        lease = distlock.acquire(f"{prefix}:{i}", ttl=ttl, blocking=False, using=alias)
        usable.append(lease.release())
    emit(usable=usable)


def green_cycles(alias, prefix, threads=10, cycles=60, hot_names=3):
    """In a process monkey-patched by gevent or eventlet (see ``tests.backends.test_zookeeper``):
    ``threads`` green threads each take and give back one of ``hot_names`` locks ``cycles`` times.

    Reports the kazoo handler in use, every error, what is still held under ``prefix``, and that the
    alias closed.
    """
    import threading  # noqa: PLC0415 - patched by now: these are green threads

    import distlock  # noqa: PLC0415
    from distlock.handler import locks  # noqa: PLC0415

    backend = locks[alias]
    counts, errors = {"cycles": 0}, []

    def run(i):
        for n in range(cycles):
            try:
                with distlock.lock(f"{prefix}:{(i + n) % hot_names}", ttl=10, timeout=30, using=alias):
                    counts["cycles"] += 1
            except Exception as exc:  # noqa: BLE001 - reported, and the test fails on it
                errors.append(repr(exc))

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    emit(handler=type(backend._session.client.handler).__name__, cycles=counts["cycles"], errors=errors[:20],
         error_count=len(errors), held=[info.name for info in backend.held_locks(prefix)])
    backend.close()
    emit(closed=True)


def etcd_fork(alias, prefix, forks=8, child_deadline=10.0):
    """Hold an etcd lock, keep the alias busy from other threads (a hammer of acquire/release, a waiter
    queued behind the held lock), and fork ``forks`` times; each child takes and releases another lock
    and exits 0 (``SIGALRM`` kills a child that hangs past ``child_deadline``).

    Reports each child's exit status and how long it took, then whether the parent still works: the
    held lease extends and checks, the session is the one it had, new locks are granted, and the
    busy threads saw no error.
    """
    import signal  # noqa: PLC0415
    import threading  # noqa: PLC0415

    import distlock  # noqa: PLC0415

    held = distlock.acquire(f"{prefix}:held", ttl=60, timeout=30, using=alias)
    session_id = held.handle.session.id
    stop, errors, cycles = threading.Event(), [], [0]

    def hammer_loop():
        while not stop.is_set():
            try:
                with distlock.lock(f"{prefix}:hammer", ttl=10, timeout=30, using=alias):
                    cycles[0] += 1
            except Exception as exc:  # noqa: BLE001 - reported, and the test fails on it
                errors.append(repr(exc))

    def waiter_loop():
        while not stop.is_set():
            try:
                distlock.acquire(f"{prefix}:held", ttl=10, timeout=0.3, using=alias).release()
                errors.append("the waiter got the held lock")
            except distlock.LockNotAcquired:
                pass
            except Exception as exc:  # noqa: BLE001 - reported, and the test fails on it
                errors.append(repr(exc))

    busy = [threading.Thread(target=hammer_loop), threading.Thread(target=waiter_loop)]
    for thread in busy:
        thread.start()
    children = []
    for i in range(forks):
        time.sleep(0.05)  # let the busy threads get back into gRPC calls
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:
            signal.alarm(int(child_deadline))
            try:
                with distlock.lock(f"{prefix}:child-{i}", ttl=10, timeout=child_deadline, using=alias) as lease:
                    code = 0 if lease.handle.session.id != session_id else 4
            except BaseException:  # noqa: BLE001 - reported through the exit status
                code = 3
            os._exit(code)
        status = None
        while time.monotonic() - started < child_deadline + 2:
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:
                status = os.waitstatus_to_exitcode(raw)
                break
            time.sleep(0.02)
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        children.append({"status": status, "seconds": round(time.monotonic() - started, 2)})
    stop.set()
    for thread in busy:
        thread.join(30)
    extended = held.extend()
    try:
        held.check()
        check = "ok"
    except distlock.LockError as exc:
        check = repr(exc)
    fresh = distlock.acquire(f"{prefix}:after", ttl=10, blocking=False, using=alias)
    emit(children=children, extended=extended, check=check, same_session=held.handle.session.id == session_id,
         fresh_session=fresh.handle.session.id == session_id, released=[fresh.release(), held.release()],
         cycles=cycles[0], errors=errors[:10], error_count=len(errors))


def etcd_green(alias, prefix, threads=10, cycles=5, ttl=2.0, hold_for=8.0):
    """In a gevent-patched process: ``threads`` greenlets x ``cycles`` lock/unlock cycles, a lease held
    with ``auto_renew`` for ``hold_for`` seconds, and a heartbeat greenlet ticking every 50 ms.

    Reports the longest gap between heartbeats (a blocked hub shows as a gap), errors, whether the
    held lease stayed valid, and gRPC's gevent flag.
    """
    import threading  # noqa: PLC0415 - patched by now: green threads

    import distlock  # noqa: PLC0415
    from distlock.handler import locks  # noqa: PLC0415

    beats, errors, done = [], [], threading.Event()

    def heartbeat():
        while not done.is_set():
            beats.append(time.monotonic())
            time.sleep(0.05)

    def run(i):
        for n in range(cycles):
            try:
                with distlock.lock(f"{prefix}:{(i + n) % 3}", ttl=10, timeout=30, using=alias):
                    time.sleep(0.01)
            except Exception as exc:  # noqa: BLE001 - reported, and the test fails on it
                errors.append(repr(exc))

    ticker = threading.Thread(target=heartbeat)
    ticker.start()
    lease = distlock.acquire(f"{prefix}:held", ttl=ttl, auto_renew=True, timeout=30, using=alias)
    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    end = time.monotonic() + hold_for
    while time.monotonic() < end:
        time.sleep(0.1)
    try:
        lease.check()
        check = "ok"
    except distlock.LockError as exc:
        check = repr(exc)
    released = lease.release()
    done.set()
    ticker.join()
    from grpc._cython import cygrpc  # noqa: PLC0415

    gaps = [later - earlier for earlier, later in zip(beats, beats[1:])]
    emit(max_gap=max(gaps), beats=len(beats), check=check, released=released, errors=errors[:10],
         error_count=len(errors), gevent_activated=bool(getattr(cygrpc, "g_gevent_activated", False)),
         held=[info.name for info in locks[alias].held_locks(prefix)])


def etcd_eventlet_refused(alias, name):
    """In an eventlet-patched process: report what acquiring on the etcd ``alias`` raises, and the
    system-check errors about it."""
    import distlock  # noqa: PLC0415
    from distlock.checks import check_distlock_setting  # noqa: PLC0415

    try:
        distlock.acquire(name, ttl=5, blocking=False, using=alias).release()
        outcome = "acquired"
    except Exception as exc:  # noqa: BLE001 - reported
        outcome = f"{type(exc).__name__}: {exc}"
    emit(acquire=outcome, check_errors=[message.msg for message in check_distlock_setting()
                                        if message.is_serious() and f"'{alias}'" in message.msg])


SCENARIOS = {"hammer": hammer, "hold": hold, "hold_then_check": hold_then_check, "try_hammer": try_hammer,
             "interrupt_storm": interrupt_storm, "green_cycles": green_cycles, "etcd_fork": etcd_fork,
             "etcd_green": etcd_green, "etcd_eventlet_refused": etcd_eventlet_refused}


def run(scenarios):
    """Entry point of a worker module: ``python -m <module> SCENARIO JSON`` calls ``scenarios[SCENARIO](**JSON)``."""
    import django  # noqa: PLC0415

    scenario, arguments = sys.argv[1], json.loads(sys.argv[2])
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    scenarios[scenario](**arguments)


if __name__ == "__main__":
    run(SCENARIOS)
