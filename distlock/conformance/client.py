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

import faulthandler
import json
import os
import queue
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor


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

    # -- many threads in one process -----------------------------------------------------------------

    def _turn(self, tally, lease, hold, rng):
        """Record a granted ``lease``'s critical section of ``rng.uniform(*hold)`` seconds; release is the caller's."""
        name, owner = lease.name, lease.owner
        self.history.record("acquire", phase="ok", lock=name, token=lease.token, owner=owner)
        self.history.record("cs_enter", lock=name, owner=owner, token=lease.token)
        if hold[1] > 0:
            time.sleep(rng.uniform(*hold))
        self.history.record("cs_exit", lock=name, owner=owner, token=lease.token)
        tally.add("acquired")

    def _take(self, tally, name, ttl, timeout, hold, rng):
        """acquire, critical section, ``Lease.release()``: one call of an executor thread; failures are tallied."""
        try:
            lease = self.distlock.acquire(name, ttl=ttl, timeout=timeout, using=self.alias)
            try:
                self._turn(tally, lease, hold, rng)
            finally:
                released = lease.release()
            self.history.record("release", phase="ok", lock=name, owner=lease.owner, released=released)
            if not released:
                raise ReleasedNothing(f"the lease of {lease.owner} was no longer on the server at its release")
        except Exception as exc:  # noqa: BLE001 - every failure counts, whatever its type
            tally.error(exc, name)

    def _serve(self, tally, name, ttl, timeout, hold, rng):
        """``with distlock.lock(name)``: one request of a thread-per-request server; failures are tallied."""
        try:
            with self.distlock.lock(name, ttl=ttl, timeout=timeout, using=self.alias) as lease:
                self._turn(tally, lease, hold, rng)
            self.history.record("release", phase="ok", lock=name, owner=lease.owner)
        except Exception as exc:  # noqa: BLE001
            tally.error(exc, name)

    def churn(self, prefix, mode, seconds, names=5, ttl=10.0, timeout=30.0, hold=(0.0, 0.002), seed=0):
        """Take locks ``{prefix}:{n % names}`` from threads that start and end all the time, for ``seconds``.

        ``mode`` "executor": a ``ThreadPoolExecutor`` of 10 threads, each making 40 acquire/release
        (fewer once ``seconds`` are over), shut down and recreated, again and again (what
        ``asyncio.to_thread`` and ``sync_to_async(thread_sensitive=False)`` do to their threads).
        ``mode`` "request": a new thread per request, 8 at once, each ``with distlock.lock(...)``
        (what ``runserver`` does). Thread idents are reused as soon as a thread ends, so any state a
        backend keys by thread is put to the test. Return the counts: acquisitions, errors by type,
        the first error, threads started.
        """
        tally = _Tally()
        deadline = time.monotonic() + seconds
        rng = random.Random(seed)
        started = 0
        if mode == "executor":
            def rounds(first):
                local = random.Random(rng.random())
                for n in range(first, first + 40):
                    if time.monotonic() >= deadline:
                        return
                    self._take(tally, f"{prefix}:{n % names}", ttl, timeout, hold, local)

            generation = 0
            while time.monotonic() < deadline:
                with ThreadPoolExecutor(max_workers=10, thread_name_prefix=f"churn-{generation}") as pool:
                    for worker in range(10):
                        pool.submit(rounds, worker * 40)
                started += 10
                generation += 1
        elif mode == "request":
            at_once = threading.BoundedSemaphore(8)
            running = []
            n = 0

            def serve(number, local):
                try:
                    self._serve(tally, f"{prefix}:{number % names}", ttl, timeout, hold, local)
                finally:
                    at_once.release()

            while time.monotonic() < deadline:
                if not at_once.acquire(timeout=max(deadline - time.monotonic(), 0.001)):
                    break
                thread = threading.Thread(target=serve, args=(n, random.Random(rng.random())), name=f"request-{n}")
                thread.start()
                running.append(thread)
                running = [thread for thread in running if thread.is_alive()]
                n += 1
            started = n
            for thread in running:
                thread.join()
        else:
            raise ValueError(f"unknown churn mode {mode!r}; use 'executor' or 'request'")
        return {**tally.counts(), "threads": started}

    def tries(self, name, threads, start, seconds, ttl=10.0, hold=0.003):
        """``threads`` threads try ``name`` back to back (``blocking=False``) from ``start`` for ``seconds``.

        ``start`` is a ``time.monotonic_ns()`` moment, the same for every process on the machine. A
        granted try is recorded (acquire, critical section of ``hold`` seconds, release); a missed
        one only counted. Return tries, acquisitions, errors by type and the first error.
        """
        tally = _Tally()
        end = start + int(seconds * 1e9)
        not_acquired = self.distlock.LockNotAcquired

        def loop():
            delay = (start - time.monotonic_ns()) / 1e9
            if delay > 0:
                time.sleep(delay)
            tries = 0
            rng = random.Random(0)
            while time.monotonic_ns() < end:
                tries += 1
                try:
                    lease = self.distlock.acquire(name, ttl=ttl, blocking=False, using=self.alias)
                except not_acquired:
                    continue
                except Exception as exc:  # noqa: BLE001 - every failure counts, whatever its type
                    tally.error(exc, name)
                    continue
                try:
                    self._turn(tally, lease, (hold, hold), rng)
                    released = lease.release()
                    self.history.record("release", phase="ok", lock=name, owner=lease.owner, released=released)
                    if not released:
                        raise ReleasedNothing(f"the lease of {lease.owner} was no longer on the server at its release")
                except Exception as exc:  # noqa: BLE001
                    tally.error(exc, name)
            tally.add("tries", tries)

        workers = [threading.Thread(target=loop, name=f"tries-{index}") for index in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        return tally.counts()

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


class ReleasedNothing(Exception):
    """``Lease.release()`` returned False for a lease held well within its ttl: the server no longer had it."""


class _Tally:
    """Counts shared by the threads of one command: acquisitions, tries, errors by type and the first error."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts = {"acquired": 0, "tries": 0}
        self._errors = {}
        self._first = None

    def add(self, what, amount=1):
        with self._lock:
            self._counts[what] += amount

    def error(self, exc, name):
        with self._lock:
            kind = type(exc).__name__
            self._errors[kind] = self._errors.get(kind, 0) + 1
            if self._first is None:
                self._first = f"{kind} on {name!r}: {exc}"

    def counts(self):
        with self._lock:
            return {**self._counts, "errors": dict(self._errors), "first_error": self._first}


COMMANDS = {"acquire", "release", "claim", "write", "enter", "exit", "check", "watch", "hold_valid", "sleep",
            "loop", "churn", "tries", "metrics", "describe", "probe"}


def answer(lock, message):
    with lock:
        sys.stdout.write(json.dumps(message, default=str) + "\n")
        sys.stdout.flush()


def run(config, control=None):
    """Serve commands until stdin closes or ``quit`` arrives; ``control`` maps op -> callable run at once."""
    import django  # noqa: PLC0415

    from distlock.conformance.history import History  # noqa: PLC0415

    # A crash (SIGSEGV in a C extension) leaves every thread's stack in the client's stderr file.
    faulthandler.enable()
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
