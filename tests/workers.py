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


def spawn(scenario, **arguments):
    """Start one worker process running ``scenario``; its stdout is a pipe of JSON lines."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.workers", scenario, json.dumps(arguments)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT,
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
    emit(token=lease.token, owner=lease.owner, pid=os.getpid())
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


SCENARIOS = {"hammer": hammer, "hold": hold, "hold_then_check": hold_then_check, "try_hammer": try_hammer}


def run(scenarios):
    """Entry point of a worker module: ``python -m <module> SCENARIO JSON`` calls ``scenarios[SCENARIO](**JSON)``."""
    import django  # noqa: PLC0415

    scenario, arguments = sys.argv[1], json.loads(sys.argv[2])
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    scenarios[scenario](**arguments)


if __name__ == "__main__":
    run(SCENARIOS)
