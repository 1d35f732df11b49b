"""A fork in a gevent-patched process after ZooKeeper and etcd locks: ``python -m tests.deployment.fork_gevent PREFIX``.

As gunicorn ``-k gevent --preload`` does: the process is monkey-patched, takes a lock on each alias
(and keeps one held across the forks, auto-renewed), then forks ``FORKS`` children. Each child takes
and gives back locks on both aliases while the parent does the same, and reports what it makes of the
parent's held leases (renewed there? valid there?); then the parent checks its held leases and takes
more locks. Prints JSON lines: one per child (``child``), then the parent's (``parent``).
Anything either process wrote to stderr (a client thread of the parent running in a child and
reading its socket, a metrics thread raising) is the test's to read.
"""

import json
import os
import sys
import time
import traceback

FORKS = 3
ALIASES = ("zookeeper", "etcd")
ROUNDS = 20


def work(distlock, prefix, who):
    """``ROUNDS`` acquire/release cycles on each alias; return the errors (formatted tracebacks)."""
    errors = []
    for alias in ALIASES:
        for n in range(ROUNDS):
            try:
                with distlock.lock(f"{prefix}:{who}:{n % 3}", ttl=5, timeout=10, using=alias) as lease:
                    lease.check()
            except Exception:  # noqa: BLE001 - reported, and the test fails on it
                errors.append(f"{alias}: {traceback.format_exc(limit=6)}")
    return errors


def inherited(held):
    """Return, per alias, whether the parent's held lease is renewed here and how its ``check()`` ends here."""
    report = {}
    for alias, lease in held.items():
        try:
            lease.check()
            verdict = "ok"
        except Exception as exc:  # noqa: BLE001 - reported, and the test fails on any but LockLost
            verdict = type(exc).__name__
        report[alias] = {"renewing": lease._renewer.running, "check": verdict}
    return report


def main(prefix):
    from gevent import monkey

    monkey.patch_all()
    import django

    django.setup()
    import distlock

    held = {alias: distlock.acquire(f"{prefix}:held:{alias}", ttl=3, timeout=10, using=alias, auto_renew=True)
            for alias in ALIASES}
    for alias in ALIASES:
        distlock.acquire(f"{prefix}:before:{alias}", ttl=5, timeout=10, using=alias).release()

    children = []
    for number in range(FORKS):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                errors = work(distlock, prefix, f"child{number}")
                print(json.dumps({"child": number, "pid": os.getpid(), "errors": errors,
                                  "inherited": inherited(held)}), flush=True)
                distlock.locks.close_all()
            except BaseException:  # noqa: BLE001 - the child must never return into the parent's code
                print(json.dumps({"child": number, "pid": os.getpid(), "errors": [traceback.format_exc()]}),
                      flush=True)
                code = 1
            finally:
                sys.stderr.flush()
                os._exit(code)
        children.append(pid)
        errors = work(distlock, prefix, f"parent{number}")  # at the same time as the child
        if errors:
            print(json.dumps({"parent_round": number, "errors": errors}), flush=True)

    exits = {}
    deadline = time.monotonic() + 60
    while len(exits) < len(children) and time.monotonic() < deadline:
        for pid in children:
            if pid not in exits:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    exits[pid] = os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    # The held leases outlived the forks and the parent's work: the parent's renewal kept them.
    checks = {}
    for alias, lease in held.items():
        try:
            lease.check()
            lease.release()
            checks[alias] = "ok"
        except Exception as exc:  # noqa: BLE001
            checks[alias] = repr(exc)
    errors = work(distlock, prefix, "parent-after")
    print(json.dumps({"parent": os.getpid(), "exits": list(exits.values()), "unfinished": len(children) - len(exits),
                      "held_checks": checks, "errors": errors}), flush=True)
    distlock.locks.close_all()


if __name__ == "__main__":
    main(sys.argv[1])
