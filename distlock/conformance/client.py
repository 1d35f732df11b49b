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
import signal
import statistics
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from distlock.conformance.history import History

__all__ = [
    "COMMANDS",
    "Client",
    "InterruptStorm",
    "Interrupted",
    "KEPT_TRACEBACKS",
    "ReleasedNothing",
    "STORM_MARGIN",
    "STORM_WEIGHTS",
    "answer",
    "main",
    "run",
]


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
        self.history_path = Path(config["history"])
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
        self.history.record("acquire", phase="ok", lock=name, token=lease.token, owner=lease.owner, ttl=lease.ttl)
        self.leases[name] = lease
        return {"token": lease.token, "owner": lease.owner, "session_timeout": lease.session_timeout,
                "token_is_safe": lease.token_is_safe, "remaining": remaining, "elapsed": elapsed}

    def release(self, name):
        lease = self.leases.pop(name, None)
        if lease is None:
            return {"released": False}
        self.history.record("release", phase="invoke", lock=name, owner=lease.owner)
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
             seed=0, stop=None):
        """Contend ``count`` times: acquire, claim ``row``, critical section of ``hold`` seconds, write, release.

        Failures the library documents (not acquired, server unavailable, lease lost) are counted and
        the loop goes on: under faults they are expected, and the checker judges what did happen.
        ``stop``: a file path; the loop also ends once the parent has created it.
        """
        rng = random.Random(seed)
        counts = {"acquired": 0, "failed": 0, "accepted": 0, "refused": 0}
        expected = (self.distlock.LockNotAcquired, self.distlock.BackendUnavailable)
        for _ in range(count):
            if stop is not None and Path(stop).exists():
                break
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

    def forks(self, prefix, forks=3, rounds=20, names=3, ttl=5.0, timeout=30.0, held_ttl=1.0, wait=60.0):
        """Fork ``forks`` children while holding ``{prefix}:held`` (auto-renewed); all take turns on the same names.

        As a pre-fork server does (gunicorn ``--preload``, Celery prefork, ``multiprocessing``): each
        child, and the parent meanwhile, makes ``rounds`` acquire/release on ``{prefix}:{n % names}``.
        A child must not run the parent's client threads nor use its connections: it builds its own
        backend, records its turns in a history file of its own, writes its counts to a file and
        exits. The parent's held lease must outlive the forks by 2.5 ttls (renewed, still valid,
        released cleanly). Return the parent's counts, each child's, the children's exit codes and the held
        lease's state.
        """
        held = self.distlock.acquire(f"{prefix}:held", ttl=held_ttl, timeout=timeout, auto_renew=True,
                                     using=self.alias)
        self.history.record("acquire", phase="ok", lock=held.name, token=held.token, owner=held.owner)
        self.history.record("cs_enter", lock=held.name, owner=held.owner, token=held.token)
        parent, children = _Tally(), {}
        rng, forked_at = random.Random(0), time.monotonic()
        for number in range(forks):
            outcome = self.history_path.with_name(f"{self.proc}-fork{number}.json")
            pid = os.fork()
            if pid == 0:
                self._forked_child(number, outcome, prefix, rounds, names, ttl, timeout)  # never returns
            children[pid] = outcome
            for n in range(rounds):
                self._take(parent, f"{prefix}:{n % names}", ttl, timeout, (0.0, 0.002), rng)
        # The held lease must be renewed after the forks, not just valid: it lives at least 2.5 ttls past them.
        time.sleep(max(0.0, forked_at + 2.5 * held_ttl - time.monotonic()))
        exits, deadline = {}, time.monotonic() + wait
        while len(exits) < len(children) and time.monotonic() < deadline:
            for pid in children:
                if pid not in exits and os.waitpid(pid, os.WNOHANG)[0]:
                    exits[pid] = "exited"
            time.sleep(0.02)
        codes, counts = [], []
        for pid, outcome in children.items():
            if pid not in exits:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                codes.append("hung")
                continue
            try:
                counts.append(json.loads(outcome.read_text()))
                codes.append(0)
            except (OSError, ValueError):
                codes.append("no counts")
        try:
            held.check()
            self.history.record("cs_exit", lock=held.name, owner=held.owner, token=held.token)
            state = "kept" if held.release() else "gone at release"
        except self.distlock.LockError as exc:
            state = f"{type(exc).__name__}: {exc}"
        return {"parent": parent.counts(), "children": counts, "exits": codes, "held": state}

    def _forked_child(self, number, outcome, prefix, rounds, names, ttl, timeout):
        """Run a forked child's turns, write its counts to ``outcome`` and exit; never return into the parent's code."""
        code = 1
        try:
            self.proc = f"{self.proc}-fork{number}"
            self.history = History(self.history_path.with_name(f"{self.proc}.jsonl"), self.proc)
            tally, rng = _Tally(), random.Random(number + 1)
            for n in range(rounds):
                self._take(tally, f"{prefix}:{n % names}", ttl, timeout, (0.0, 0.002), rng)
            self.history.close()
            outcome.write_text(json.dumps(tally.counts()))
            code = 0
        finally:
            sys.stderr.flush()
            os._exit(code)

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

    def contend(self, name, stop, ttl, timeout=1.0, hold=(0.005, 0.02), gap=(0.0, 0.01), seconds=600.0, seed=0):
        """Take turns on ``name`` (acquire within ``timeout``, hold it ``hold`` s, release) until ``stop`` exists.

        ``stop`` is a file path the parent creates; ``seconds`` bounds the loop if it never does.
        Misses (``LockNotAcquired``, ``BackendUnavailable``) are counted, not raised. Return the counts.
        """
        rng = random.Random(seed)
        counts = {"acquired": 0, "failed": 0}
        expected = (self.distlock.LockNotAcquired, self.distlock.BackendUnavailable)
        deadline = time.monotonic() + seconds
        while not Path(stop).exists() and time.monotonic() < deadline:
            try:
                self.acquire(name, ttl, timeout=timeout)
            except expected:
                counts["failed"] += 1
                continue
            counts["acquired"] += 1
            try:
                self.enter(name)
                time.sleep(rng.uniform(*hold))
                self.exit(name)
            finally:
                self.release(name)
            time.sleep(rng.uniform(*gap))
        return counts

    def held(self, prefix):
        """Return the locks the backend lists as held under ``prefix``: ``[{"name", "owner", "pid"}]``."""
        from distlock.handler import locks  # noqa: PLC0415

        return [{"name": info.name, "owner": info.owner, "pid": info.pid}
                for info in locks[self.alias].held_locks(prefix)]

    def interrupts(self, names, held, after, ttl=2.0, wait=0.05, operations=200, calibration=8, seed=0):
        """Make ``operations`` lock calls, each with SIGALRM armed to raise ``Interrupted`` at a random point.

        See ``InterruptStorm``: ``names`` are this client's own lock names (``names[0]`` is also
        contended by another process), ``held`` a name another process holds all along, ``after``
        fresh names acquired normally once the storm is over. Return its counts: calls, interrupts
        and where they landed, grants seen while held, unexpected errors with their tracebacks, the
        names still held after the storm, and what failed when using the alias afterwards.
        """
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("the interrupt storm needs the main thread: only it receives signal handlers")
        storm = InterruptStorm(self, names=names, held=held, ttl=ttl, wait=wait, rng=random.Random(seed))
        return storm.run(operations, calibration, after)

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


class Interrupted(BaseException):
    """What the interrupt storm's SIGALRM handler raises, wherever the main thread happens to be.

    A ``BaseException``, as ``gevent.Timeout`` and ``KeyboardInterrupt`` are, and delivered the way
    Celery's soft time limit is (a signal handler that raises): no ``except Exception`` stops it,
    so every cleanup path of the library and its client libraries must cope with it.
    """


@dataclass
class _Holding:
    """A lease the storm holds; its critical section stays open until it is released or found lost."""

    lease: object
    #: ``time.monotonic_ns()`` when the lease was last seen valid (``not lease.lost``).
    seen: int
    #: False once a call on the lease was interrupted or failed: what the server has is then unknown.
    certain: bool = True


#: How often each kind of call is picked when it can be made (see ``InterruptStorm``).
STORM_WEIGHTS = {"acquire": 3, "acquire_wait": 2, "try_held": 1, "wait_held": 1, "try_own": 1, "extend": 3,
                 "release": 3}

#: Seconds of validity a lease must have left for a "gone" answer to its extend or release to count as misread.
STORM_MARGIN = 0.5

#: Full tracebacks kept (every unexpected error is counted and described either way).
KEPT_TRACEBACKS = 5


class InterruptStorm:
    """Lock calls cut short by a timer signal at random points: a time limit landing in acquire, extend, release.

    Before each call ``signal.setitimer(ITIMER_REAL, d)`` arms a one-shot timer whose handler raises
    ``Interrupted`` in the main thread; ``d`` is drawn from 0 to twice the backend's typical duration
    of that kind of call, measured first without interrupts, so the interrupt lands anywhere in it:
    in distlock, in the client library, between a request and its reply, or just after the call.

    The calls: non-blocking and short-timeout (``wait``) acquires of this client's free ``names``
    (``names[0]`` is also taken in turns by another process), tries of ``held`` (held by another
    process all along, so never granted), non-blocking tries of a name this client holds (never
    granted either), extends and releases of held leases, a third of them auto-renewed. A lease
    held for half its ttl, or found lost, is released next, so critical sections stay in validity.

    Every granted lease is recorded with its token and a critical section, from its return to just
    before its release (or to the last moment it was seen valid): the checker counts a grant made
    while another owner held the lock as an overlap. Errors other than ``LockNotAcquired``,
    ``BackendUnavailable`` and the interrupt are misread replies, and so is an extend or release
    that finds a lease gone although it was valid and no call on it had been interrupted.
    """

    def __init__(self, client, *, names, held, ttl, wait, rng):
        self.client = client
        self.distlock = client.distlock
        self.history = client.history
        self.names = list(names)
        self.held = held
        self.ttl = ttl
        self.wait = wait
        self.rng = rng
        self.holdings = {}
        self.typical = {}
        #: True while a call runs with the timer set: the handler raises only then.
        self.armed = False
        self.raised = 0
        self.landing = []
        self.calls = {}
        self.interrupted = {}
        self.landed = {}
        self.outcomes = {}
        self.granted_busy = []
        self.misread = []
        self.tracebacks = []
        self.swallowed = []
        self.finalizers = []
        self.converted = 0
        self.slowest = (0.0, None)

    def run(self, operations, calibration, after):
        """Calibrate, make ``operations`` interrupted calls, release what is held, then check the alias works."""
        previous = signal.signal(signal.SIGALRM, self._on_alarm)
        unraisable_hook = sys.unraisablehook
        sys.unraisablehook = self._on_unraisable
        started = time.monotonic()
        try:
            self._calibrate(calibration)
            for _ in range(operations):
                self._step()
            for holding in list(self.holdings.values()):
                self._release(holding, interrupt=False)
        finally:
            self.armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            sys.unraisablehook = unraisable_hook
        seconds = time.monotonic() - started
        left = self._left_while_alive(started + seconds)
        unusable = self._use_after(after)
        return {
            "operations": sum(self.calls.values()), "calls": self.calls,
            "interrupted": sum(self.interrupted.values()), "interrupted_by_kind": self.interrupted,
            "landed": self.landed, "outcomes": self.outcomes,
            "typical_ms": {kind: round(seconds * 1000, 3) for kind, seconds in self.typical.items()},
            "granted_busy": self.granted_busy, "misread": self.misread, "tracebacks": self.tracebacks,
            "swallowed": self.swallowed, "finalizers": self.finalizers, "converted": self.converted,
            "slowest": {"seconds": self.slowest[0], "call": self.slowest[1]}, "seconds": seconds,
            "left_while_alive": left, "unusable": unusable,
        }

    # -- one call with the timer armed -------------------------------------------------------------

    def _on_alarm(self, signum, frame):
        if self.armed:
            self.armed = False
            self.raised += 1
            # Where it lands, in case something swallows it: the three innermost frames, cheaply.
            self.landing = [f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}"
                            for f in (frame, frame and frame.f_back, frame and frame.f_back and frame.f_back.f_back)
                            if f is not None]
            raise Interrupted(f"interrupt {self.raised}")

    def _on_unraisable(self, unraisable):
        """Note an interrupt Python itself dropped: it landed in a finalizer or a weakref callback (GC)."""
        if isinstance(unraisable.exc_value, Interrupted):
            self.finalizers.append(repr(unraisable.object))
        else:
            sys.__unraisablehook__(unraisable)

    def _call(self, kind, name, function, *, interrupt=True):
        """Run ``function()``, with the timer armed for ``kind`` if ``interrupt``; return (value, outcome, seconds).

        ``value`` is what the call returned, even if the interrupt landed after it returned;
        ``outcome`` is "ok", "interrupted", "not acquired", "unavailable" or "error".
        """
        delay = max(1e-6, self.rng.uniform(0, 2 * self.typical[kind])) if interrupt else None
        self.history.record("call", phase="invoke", kind=kind, lock=name, delay=delay)
        raised, finalized = self.raised, len(self.finalizers)
        value = failure = None
        started = time.monotonic()
        try:
            try:
                if delay is not None:
                    self.armed = True
                    signal.setitimer(signal.ITIMER_REAL, delay)
                value = function()
            finally:
                self.armed = False
                signal.setitimer(signal.ITIMER_REAL, 0)
        except Interrupted as exc:
            failure = exc
        except Exception as exc:  # noqa: BLE001 - sorted below: expected, or a misread reply
            failure = exc
        elapsed = time.monotonic() - started
        if isinstance(failure, Interrupted):
            outcome = "interrupted"
            self.interrupted[kind] = self.interrupted.get(kind, 0) + 1
            site = _landing(failure)
            self.landed[site] = self.landed.get(site, 0) + 1
        elif isinstance(failure, self.distlock.LockNotAcquired):
            outcome = "not acquired"
        elif isinstance(failure, self.distlock.BackendUnavailable):
            outcome = "unavailable"
            if _caused_by(failure, Interrupted):
                self.converted += 1
        elif failure is not None:
            outcome = "error"
            self._misread(f"{type(failure).__name__} in {kind} of {name!r}: {failure}", failure)
        else:
            outcome = "ok"
        if (self.raised != raised and outcome != "interrupted" and not _caused_by(failure, Interrupted)
                and len(self.finalizers) == finalized):
            # The handler raised and the call went on as if nothing happened: the library or a client
            # library caught the interrupt (Python's own drops in finalizers are counted apart).
            self.swallowed.append(f"{kind} of {name!r} ({outcome}), landed at " + " < ".join(self.landing))
        if interrupt:
            self.calls[kind] = self.calls.get(kind, 0) + 1
            counts = self.outcomes.setdefault(kind, {})
            counts[outcome] = counts.get(outcome, 0) + 1
            if elapsed > self.slowest[0]:
                self.slowest = (elapsed, f"{kind} of {name!r} ({outcome})")
        self.history.record("call", phase="end", kind=kind, lock=name, outcome=outcome, seconds=elapsed)
        return value, outcome, elapsed

    def _misread(self, description, exc=None):
        self.misread.append(description)
        if len(self.tracebacks) < KEPT_TRACEBACKS:
            text = "".join(traceback.format_exception(exc)) if exc is not None else ""
            self.tracebacks.append(f"{description}\n{text}")

    # -- the calls ----------------------------------------------------------------------------------

    def _acquire(self, kind, name, *, timeout=None, interrupt=True):
        """Try ``name`` (``timeout`` None: non-blocking); record a grant and open its critical section."""
        auto_renew = self.rng.random() < 1 / 3
        value, outcome, elapsed = self._call(kind, name, lambda: self.distlock.acquire(
            name, ttl=self.ttl, timeout=timeout, blocking=timeout is not None, using=self.client.alias,
            auto_renew=auto_renew), interrupt=interrupt)
        if value is None:
            # "info": an interrupted acquire may have left a grant nobody will use; it must expire.
            self.history.record("acquire", phase="info" if outcome == "interrupted" else "fail", lock=name,
                                err=outcome)
            return None, elapsed
        lease = value
        self.history.record("acquire", phase="ok", lock=name, token=lease.token, owner=lease.owner,
                            interrupted=outcome == "interrupted", ttl=lease.ttl)
        self.history.record("cs_enter", lock=name, owner=lease.owner, token=lease.token)
        holding = _Holding(lease, time.monotonic_ns(), certain=outcome == "ok")
        if name == self.held or name in self.holdings:
            # Granted while another lease holds it: its critical section overlaps that one's already.
            # Given back at once (a compare-and-delete of this lease's own owner).
            holder = ("the holder process" if name == self.held
                      else f"this client's token {self.holdings[name].lease.token}")
            self.granted_busy.append(f"{kind} of {name!r} granted token {lease.token} while {holder} held it")
            self._release(holding, interrupt=False)
        else:
            self.holdings[name] = holding
        return lease, elapsed

    def _close(self, holding):
        """Record the end of ``holding``'s critical section: now, or when its lease was last seen valid."""
        lease = holding.lease
        end = holding.seen if lease.lost else time.monotonic_ns()
        # ``t`` given here replaces the moment of recording (History.record lets fields override it).
        self.history.record("cs_exit", lock=lease.name, owner=lease.owner, token=lease.token, t=end)
        if self.holdings.get(lease.name) is holding:
            del self.holdings[lease.name]

    def _valid(self, holding):
        lease = holding.lease
        return holding.certain and not lease.lost and lease.remaining() > STORM_MARGIN

    def _release(self, holding, *, interrupt=True):
        lease = holding.lease
        valid = self._valid(holding)
        self._close(holding)
        released, outcome, elapsed = self._call("release", lease.name, lease.release, interrupt=interrupt)
        self.history.record("release", phase="ok" if outcome == "ok" else "info", lock=lease.name, owner=lease.owner,
                            released=released)
        if released is False and outcome == "ok" and valid:
            self._misread(f"release of a valid lease on {lease.name!r} (token {lease.token}, never interrupted) "
                          "found it gone")
        return elapsed

    def _extend(self, holding, *, interrupt=True):
        lease = holding.lease
        valid = self._valid(holding)
        extended, outcome, elapsed = self._call("extend", lease.name, lease.extend, interrupt=interrupt)
        if outcome != "ok":
            holding.certain = False
        if extended is False:
            if outcome == "ok" and valid:
                self._misread(f"extend of a valid lease on {lease.name!r} (token {lease.token}, never interrupted) "
                              "found it gone")
            self._close(holding)
        return elapsed

    def _calibrate(self, rounds):
        """Time each kind of call ``rounds`` times without interrupts; keep the median of each."""
        samples = {kind: [] for kind in STORM_WEIGHTS}
        name = self.names[-1]
        for _ in range(rounds):
            # acquire, extend, release; then acquire, try it again, release. A lease found gone (or taken
            # over, on a broken backend) skips the calls that need it.
            for kinds in (("extend", "release"), ("try_own", "release")):
                samples["acquire"].append(self._acquire("acquire", name, interrupt=False)[1])
                for kind in kinds:
                    holding = self.holdings.get(name)
                    if holding is None:
                        break
                    if kind == "extend":
                        samples[kind].append(self._extend(holding, interrupt=False))
                    elif kind == "release":
                        samples[kind].append(self._release(holding, interrupt=False))
                    else:
                        samples[kind].append(self._acquire(kind, name, interrupt=False)[1])
            samples["try_held"].append(self._acquire("try_held", self.held, interrupt=False)[1])
            samples["wait_held"].append(self._acquire("wait_held", self.held, timeout=self.wait, interrupt=False)[1])
        samples["acquire_wait"] = samples["acquire"]
        missing = [kind for kind, values in samples.items() if not values]
        if missing:
            raise RuntimeError(f"calibration could not time {', '.join(missing)}: {self.misread}")
        self.typical = {kind: statistics.median(values) for kind, values in samples.items()}

    def _step(self):
        """Make one call: release a lease held half its ttl (or lost) first, else a random kind of call."""
        self._seen()
        stale = [holding for holding in self.holdings.values()
                 if holding.lease.lost or holding.lease.held_for > self.ttl / 2]
        if stale:
            self._release(stale[0])
            return
        free = [name for name in self.names if name not in self.holdings]
        kinds = ["try_held", "wait_held"] + (["acquire", "acquire_wait"] if free else [])
        if self.holdings:
            kinds += ["try_own", "extend", "release"]
        kind = self.rng.choices(kinds, weights=[STORM_WEIGHTS[kind] for kind in kinds])[0]
        holding = self.rng.choice(list(self.holdings.values())) if self.holdings else None
        if kind == "acquire":
            self._acquire(kind, self.rng.choice(free))
        elif kind == "acquire_wait":
            self._acquire(kind, self.rng.choice(free), timeout=self.wait)
        elif kind == "try_held":
            self._acquire(kind, self.held)
        elif kind == "wait_held":
            self._acquire(kind, self.held, timeout=self.wait)
        elif kind == "try_own":
            self._acquire(kind, holding.lease.name)
        elif kind == "extend":
            self._extend(holding)
        else:
            self._release(holding)
        self._seen()

    def _seen(self):
        now = time.monotonic_ns()
        for holding in self.holdings.values():
            if not holding.lease.lost:
                holding.seen = now

    # -- afterwards, with the timer off -----------------------------------------------------------------

    def _left_while_alive(self, ended):
        """Return the names this process still holds on the server ttl + 1 s after the storm (polled), while alive.

        Every lease this client knew of was released; what is left was granted to a call the
        interrupt cut short, and nothing may renew it: the server must free it at its ttl.
        """
        from distlock.handler import locks  # noqa: PLC0415

        backend = locks[self.client.alias]
        prefix = os.path.commonprefix([*self.names, self.held])
        deadline = ended + self.ttl + 1
        while True:
            mine = sorted({info.name for info in backend.held_locks(prefix) if info.pid == os.getpid()})
            if not mine or time.monotonic() >= deadline:
                return mine
            time.sleep(0.05)

    def _use_after(self, names):
        """Acquire, extend and release each of ``names`` normally; return what went wrong (empty: the alias works)."""
        problems = []
        for name in names:
            try:
                lease = self.distlock.acquire(name, ttl=self.ttl, timeout=10, using=self.client.alias)
                self.history.record("acquire", phase="ok", lock=name, token=lease.token, owner=lease.owner)
                self.history.record("cs_enter", lock=name, owner=lease.owner, token=lease.token)
                extended = lease.extend()
                self.history.record("cs_exit", lock=name, owner=lease.owner, token=lease.token)
                released = lease.release()
                self.history.record("release", phase="ok", lock=name, owner=lease.owner, released=released)
            except Exception as exc:  # noqa: BLE001 - any failure means the alias is broken
                problems.append(f"{type(exc).__name__} on {name!r}: {exc}")
                self.tracebacks.append(f"after the storm, on {name!r}:\n" + "".join(traceback.format_exception(exc)))
                continue
            if extended is not True or released is not True:
                problems.append(f"{name!r}: extend returned {extended!r}, release returned {released!r}")
        return problems


def _landing(exc):
    """Return where ``exc`` (an ``Interrupted``) landed: the module of the frame the signal handler interrupted."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    # The last frame is the handler that raised; the one before it is where the signal arrived.
    frame = frames[-2] if len(frames) > 1 else frames[-1]
    if frame.f_code.co_filename == __file__:
        return "harness (before or after the call)"
    module = frame.f_globals.get("__name__", "?")
    return module if module.startswith("distlock.") else module.split(".")[0]


def _caused_by(exc, kind):
    """Return True if ``exc`` or an exception it was raised from (or during) is a ``kind``."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


COMMANDS = {"acquire", "release", "claim", "write", "enter", "exit", "check", "watch", "hold_valid", "sleep",
            "loop", "churn", "forks", "tries", "contend", "held", "interrupts", "metrics", "describe", "probe"}


def answer(lock, message):
    with lock:
        sys.stdout.write(json.dumps(message, default=str) + "\n")
        sys.stdout.flush()


def run(config, control=None):
    """Serve commands until stdin closes or ``quit`` arrives; ``control`` maps op -> callable run at once."""
    import django  # noqa: PLC0415

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
