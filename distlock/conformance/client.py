"""A conformance client: one process that takes locks and writes fenced rows on command, recording each step.

    python -m distlock.conformance.client CONFIG_JSON

``CONFIG_JSON`` names the process (``proc``), the ``DISTLOCK`` alias, the history file and the
fenced store (or null). The process reads one JSON command per line on stdin, ``{"id", "op",
"args"}``, runs them one after the other, and answers each with one line on stdout, ``{"id", "ok",
"result"}`` or ``{"id", "ok": false, "error", "message"}``. Commands marked ``"control": true`` run at
once on the reading thread instead, even while a command waits (the test suite's fake wall clock).
The parent pauses (SIGSTOP) and kills (SIGKILL) the process between or during commands; the history
it records is what the checker judges.
"""

import json
import os
import queue
import random
import sys
import threading
import time


class Client:
    """The state of one client process: its leases by lock name, the values its claims read, its history."""

    def __init__(self, config, history):
        import distlock  # noqa: PLC0415 - after django.setup()
        from distlock.conformance.store import FencedStore  # noqa: PLC0415
        from distlock.signals import lock_lost  # noqa: PLC0415

        self.distlock = distlock
        self.proc = config["proc"]
        self.alias = config["alias"]
        self.history = history
        store = config.get("store")
        self.store = FencedStore(store["database"], store["suffix"]) if store else None
        self.leases = {}
        self.read_values = {}
        lock_lost.connect(self._on_lost, weak=False)

    def _on_lost(self, sender, lease, reason, **kwargs):
        self.history.record("lost", lock=lease.name, owner=lease.owner, token=lease.token, reason=reason)

    def _lease(self, name):
        try:
            return self.leases[name]
        except KeyError:
            raise ValueError(f"this client holds no lease on {name!r}; acquire it first") from None

    # -- commands ------------------------------------------------------------------------------------

    def acquire(self, name, ttl, timeout=None, blocking=True, auto_renew=False):
        self.history.record("acquire", phase="invoke", lock=name)
        started = time.monotonic()
        try:
            lease = self.distlock.acquire(name, ttl=ttl, timeout=timeout, blocking=blocking, using=self.alias,
                                          auto_renew=auto_renew)
        except Exception as exc:
            self.history.record("acquire", phase="fail", lock=name, err=type(exc).__name__)
            raise
        elapsed = time.monotonic() - started
        remaining = lease.remaining()
        self.history.record("acquire", phase="ok", lock=name, token=lease.token, owner=lease.owner)
        self.leases[name] = lease
        return {"token": lease.token, "owner": lease.owner, "session_timeout": lease.session_timeout,
                "token_is_safe": lease.token_is_safe, "remaining": remaining, "elapsed": elapsed}

    def release(self, name):
        lease = self.leases.pop(name, None)
        if lease is None:
            return {"released": False}
        try:
            released = lease.release()
        except Exception as exc:
            self.history.record("release", phase="fail", lock=name, owner=lease.owner, err=type(exc).__name__)
            raise
        self.history.record("release", phase="ok", lock=name, owner=lease.owner, released=released)
        return {"released": released}

    def _carried(self, lease, via):
        """The lease itself (checked by the library before any I/O) or its bare token (judged by the store only)."""
        return lease if via == "lease" else lease.token

    def claim(self, name, row, via="lease"):
        lease = self._lease(name)
        outcome, value, current = self.store.claim(row, self._carried(lease, via), token=lease.token,
                                                   owner=lease.owner, proc=self.proc)
        self.history.record("write", kind="claim", lock=name, row=row, token=lease.token, owner=lease.owner,
                            via=via, outcome=outcome, current=current)
        if outcome == "accepted":
            self.read_values[name] = value
        return {"outcome": outcome, "value": value, "current": current}

    def write(self, name, row, delta=1, via="lease"):
        lease = self._lease(name)
        value = self.read_values[name] + delta
        outcome, current = self.store.write(row, value, self._carried(lease, via), delta=delta, token=lease.token,
                                            owner=lease.owner, proc=self.proc)
        self.history.record("write", kind="write", lock=name, row=row, token=lease.token, owner=lease.owner,
                            via=via, outcome=outcome, current=current, value=value)
        if outcome == "accepted":
            self.read_values[name] = value
        return {"outcome": outcome, "current": current}

    def enter(self, name):
        lease = self._lease(name)
        self.history.record("cs_enter", lock=name, owner=lease.owner, token=lease.token)
        return {}

    def exit(self, name):
        lease = self._lease(name)
        self.history.record("cs_exit", lock=name, owner=lease.owner, token=lease.token)
        return {}

    def check(self, name):
        """Return the lease's state as ``check()`` sees it: "valid", "suspended" or "lost"."""
        lease = self._lease(name)
        try:
            lease.check()
        except self.distlock.LockLost:
            return {"state": "lost", "remaining": lease.remaining()}
        except self.distlock.LockError:
            return {"state": "suspended", "remaining": lease.remaining()}
        return {"state": "valid", "remaining": lease.remaining()}

    def watch(self, name, seconds, interval=0.02):
        """Poll ``check()`` for ``seconds``; record and return each change of state with its time."""
        changes, last = [], None
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            state = self.check(name)["state"]
            if state != last:
                event = self.history.record("lease_state", lock=name, state=state)
                changes.append({"state": state, "t": event["t"]})
                last = state
            time.sleep(interval)
        return {"changes": changes}

    def hold_valid(self, name, margin=0.05):
        """Sleep until the lease has ``margin`` seconds of validity left: a critical section that stays in time."""
        lease = self._lease(name)
        while lease.remaining() > margin and not lease.lost:
            time.sleep(min(0.01, lease.remaining()))
        return {"remaining": lease.remaining()}

    def sleep(self, seconds):
        time.sleep(seconds)
        return {}

    def loop(self, name, count, ttl, timeout=None, hold=(0.01, 0.05), gap=(0.0, 0.02), row=None, via="lease",
             seed=0):
        """Contend ``count`` times: acquire, claim ``row``, critical section of ``hold`` seconds, write, release.

        Failures the library documents (not acquired, server unavailable, lease lost) are counted and
        the loop goes on: under faults they are expected, and the checker judges what did happen.
        """
        rng = random.Random(seed)
        counts = {"acquired": 0, "failed": 0, "accepted": 0, "refused": 0}
        expected = (self.distlock.LockNotAcquired, self.distlock.BackendUnavailable)
        for _ in range(count):
            try:
                self.acquire(name, ttl, timeout=timeout)
            except expected:
                counts["failed"] += 1
                continue
            counts["acquired"] += 1
            try:
                claimed = row is None or self.claim(name, row, via)["outcome"] == "accepted"
                self.enter(name)
                time.sleep(rng.uniform(*hold))
                if claimed and row is not None:
                    accepted = self.write(name, row, 1, via)["outcome"] == "accepted"
                    counts["accepted" if accepted else "refused"] += 1
                self.exit(name)
            finally:
                try:
                    self.release(name)
                except self.distlock.BackendUnavailable:
                    pass
            time.sleep(rng.uniform(*gap))
        return counts

    def metrics(self):
        """Return this process's fencing-rejection metric, summed over its labels (None without prometheus_client).

        A write carrying a bare token is counted under the database alias, one carrying a lease under
        the lock alias, so the sum is what compares with the store's log.
        """
        from distlock import metrics  # noqa: PLC0415
        from distlock.metrics import prometheus  # noqa: PLC0415

        if prometheus.instruments() is None:
            return {"rejections": None}
        metrics.this_process.drain()
        total = sum(sample.value for family in prometheus.prometheus_client.REGISTRY.collect()
                    if family.name == "distlock_fencing_rejections" for sample in family.samples
                    if sample.name == "distlock_fencing_rejections_total")
        return {"rejections": int(total)}

    def describe(self):
        """Return what the scenarios need to know of the alias's backend."""
        from distlock.handler import locks  # noqa: PLC0415

        backend = locks[self.alias]
        return {"backend": type(backend).__name__, "token_is_safe": backend.token_is_safe}

    def probe(self, function, **arguments):
        """Call ``function`` (a dotted path) with this client: a hook for tests that inspect a backend."""
        from django.utils.module_loading import import_string  # noqa: PLC0415

        return import_string(function)(self, **arguments)


COMMANDS = {"acquire", "release", "claim", "write", "enter", "exit", "check", "watch", "hold_valid", "sleep",
            "loop", "metrics", "describe", "probe"}


def answer(lock, message):
    with lock:
        sys.stdout.write(json.dumps(message, default=str) + "\n")
        sys.stdout.flush()


def run(config, control=None):
    """Serve commands until stdin closes or ``quit`` arrives; ``control`` maps op -> callable run at once."""
    import django  # noqa: PLC0415

    from distlock.conformance.history import History  # noqa: PLC0415

    django.setup()
    history = History(config["history"], config["proc"])
    client = Client(config, history)
    control = control or {}
    out_lock = threading.Lock()
    commands = queue.SimpleQueue()

    def read():
        for line in sys.stdin:
            message = json.loads(line)
            if message.get("control"):
                try:
                    result = control[message["op"]](**message.get("args", {}))
                    answer(out_lock, {"id": message["id"], "ok": True, "result": result})
                except Exception as exc:  # noqa: BLE001 - reported to the parent, which decides
                    answer(out_lock, {"id": message["id"], "ok": False, "error": type(exc).__name__,
                                      "message": str(exc)})
            else:
                commands.put(message)
        commands.put(None)

    threading.Thread(target=read, daemon=True, name="conformance-commands").start()
    answer(out_lock, {"id": 0, "ok": True, "result": {"pid": os.getpid()}})
    while (message := commands.get()) is not None and message["op"] != "quit":
        try:
            if message["op"] not in COMMANDS:
                raise ValueError(f"unknown command {message['op']!r}")
            result = getattr(client, message["op"])(**message.get("args", {}))
            answer(out_lock, {"id": message["id"], "ok": True, "result": result})
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the parent
            answer(out_lock, {"id": message["id"], "ok": False, "error": type(exc).__name__, "message": str(exc)})
    history.close()


def main(control=None):
    run(json.loads(sys.argv[1]), control)


if __name__ == "__main__":
    main()
