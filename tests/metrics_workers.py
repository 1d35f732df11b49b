"""Child processes for the metrics tests: ``python -m tests.metrics_workers SCENARIO JSON``.

Each records real lock events through the public API in its own process, so the parent can check
that the shared store sums every process. Environment and settings as in ``tests.workers``.
"""

import json
import os
import subprocess
import sys
import time

from tests.workers import ROOT, child_env, emit, run


def spawn(scenario, env=None, **arguments):
    """Start one child running ``scenario``; its stdout is a pipe of JSON lines."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.metrics_workers", scenario, json.dumps(arguments)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(**(env or {})), cwd=ROOT,
    )


def acquisitions(alias, prefix, count, misses, hold_ms=0):
    """Acquire and release ``{prefix}:job`` ``count`` times, then miss it ``misses`` times (held)."""
    import distlock  # noqa: PLC0415 - after django.setup()

    for _ in range(count):
        with distlock.lock(f"{prefix}:job", ttl=10, timeout=10, using=alias):
            time.sleep(hold_ms / 1000)
    with distlock.lock(f"{prefix}:held", ttl=10, using=alias):
        for _ in range(misses):
            try:
                # Another lease on the same name in this process: a real non-blocking miss.
                distlock.acquire(f"{prefix}:held", blocking=False, using=alias)
            except distlock.LockNotAcquired:
                pass
    emit(pid=os.getpid(), done=True)


def contend(alias, name, count, hold_ms, start_at, ttl=10):
    """From ``start_at`` (``time.monotonic()``: one clock for every process on Linux, which no clock step
    moves), so that every child starts together, hold ``name`` ``count`` times."""
    import distlock  # noqa: PLC0415

    time.sleep(max(0.0, start_at - time.monotonic()))
    for _ in range(count):
        with distlock.lock(name, ttl=ttl, timeout=60, using=alias):
            time.sleep(hold_ms / 1000)
    emit(pid=os.getpid(), done=True)


def acquisitions_then_wait(alias, prefix, count, misses):
    """Like ``acquisitions``, then stay alive: only the periodic flush can deliver the counts."""
    acquisitions(alias, prefix, count, misses)
    time.sleep(3600)


SCENARIOS = {"acquisitions": acquisitions, "acquisitions_then_wait": acquisitions_then_wait, "contend": contend}


if __name__ == "__main__":
    run(SCENARIOS)
