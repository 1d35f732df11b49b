"""Client processes that write fenced rows, for ``tests/test_fencing.py``: ``python -m tests.fencing_workers SCENARIO JSON``.

Like ``tests/workers.py``, each scenario prints JSON lines; a scenario that must wait for the parent
(which pauses it with SIGSTOP meanwhile) reads one line from stdin.
"""

import json
import os
import queue
import random
import subprocess
import sys
import threading
import time

from tests.workers import ROOT, child_env, emit, run


class Worker:
    """One scenario process, its events read by a thread so that the parent can wait for one with a timeout."""

    def __init__(self, scenario, env=None, **arguments):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.fencing_workers", scenario, json.dumps(arguments)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=child_env(**(env or {})), cwd=ROOT,
        )
        self.events = []
        self._queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pid(self):
        return self.process.pid

    def _read(self):
        for line in self.process.stdout:
            if line.startswith("{"):
                self._queue.put(json.loads(line))
        self._queue.put(None)

    def next_event(self, timeout=60):
        """Return the next event; fail with the worker's stderr if it exits or stays silent."""
        try:
            event = self._queue.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise AssertionError(f"worker {self.pid} sent nothing for {timeout}s") from None
        if event is None:
            raise AssertionError(f"worker {self.pid} exited early:\n{self._stderr()}")
        self.events.append(event)
        return event

    def go(self):
        """Let a worker waiting on stdin carry on."""
        self.process.stdin.write("go\n")
        self.process.stdin.flush()

    def finish(self, timeout=180):
        """Wait for the worker to exit; return all its events; fail with its stderr if it failed."""
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"worker {self.pid} still running after {timeout}s") from None
        self._reader.join(10)
        while not self._queue.empty():
            event = self._queue.get_nowait()
            if event is not None:
                self.events.append(event)
        if self.process.returncode != 0:
            raise AssertionError(f"worker {self.pid} exited with {self.process.returncode}:\n{self._stderr()}")
        self._close_pipes()
        return self.events

    def _stderr(self):
        try:
            return self.process.stderr.read()[-4000:]
        except ValueError:
            return ""

    def kill(self):
        """Make sure the worker is gone (idempotent; the tests call it in ``finally``)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._reader.join(10)
        self._close_pipes()

    def _close_pipes(self):
        for pipe in (self.process.stdin, self.process.stdout, self.process.stderr):
            if not pipe.closed:
                try:
                    pipe.close()
                except BrokenPipeError:
                    pass


def _count_rejection_signals():
    from distlock.signals import fencing_token_rejected  # noqa: PLC0415 - after django.setup()

    received = []
    fencing_token_rejected.connect(lambda **kwargs: received.append(kwargs["offered_token"]), weak=False)
    return received


def fenced_increment(lock_alias, db, name, pk, ttl, wait, writes, note):
    """Acquire, claim row ``pk`` and read it; wait for the parent if ``wait``; then add 1 with each of ``writes``.

    ``writes`` lists how each attempt carries the token: "token" (``save(fencing_token=...)``) or
    "lease" (``save(lease=...)``). Each attempt reports accepted, or the exception that refused it.
    """
    import distlock  # noqa: PLC0415
    from tests.fencing_app.models import Account  # noqa: PLC0415

    signals = _count_rejection_signals()
    lease = distlock.acquire(name, ttl=ttl, timeout=120, using=lock_alias)
    account = Account.objects.using(db).claim(lease, pk=pk)
    read = account.balance
    emit(event="claimed", token=lease.token, balance=read, pid=os.getpid())
    if wait:
        sys.stdin.readline()
    for via in writes:
        account.balance, account.note = read + 1, note
        try:
            if via == "token":
                account.save(fencing_token=lease.token)
            else:
                account.save(lease=lease)
            outcome = {"outcome": "accepted"}
        except distlock.StaleFencingToken as exc:
            outcome = {"outcome": "StaleFencingToken", "offered": exc.offered_token, "current": exc.current_token,
                       "lock_name": exc.lock_name}
        except distlock.LockLost:
            outcome = {"outcome": "LockLost"}
        emit(event="write", via=via, token=lease.token, **outcome)
    try:
        released = lease.release()
    except distlock.BackendUnavailable as exc:
        # Not what these scenarios test; reported so that the parent can show it.
        released = repr(exc)
    emit(event="done", signals=len(signals), released=released)


def increment_loop(lock_alias, db, name, pk, count, ttl, pause_chance, pause_max, seed):
    """``count`` times: acquire, claim, add 1, save; pause now and then past the ttl, so others take over.

    The claim and the save each carry the lease or its bare token, at random: a lease is refused by
    its own check once expired (outcome "lost"), a bare token only by the store ("stale"). Reports
    every claim and write with its token and outcome, and the value each accepted write stored.
    """
    import distlock  # noqa: PLC0415
    from tests.fencing_app.models import Account  # noqa: PLC0415

    signals = _count_rejection_signals()
    rng = random.Random(seed)

    def maybe_pause():
        if rng.random() < pause_chance:
            time.sleep(rng.uniform(0, pause_max))

    def with_lease_or_token(lease):
        return {"lease": lease, "token": lease.token}[rng.choice(["lease", "token"])]

    for _ in range(count):
        lease = distlock.acquire(name, ttl=ttl, timeout=120, using=lock_alias)
        try:
            maybe_pause()
            try:
                account = Account.objects.using(db).claim(with_lease_or_token(lease), pk=pk)
            except distlock.StaleFencingToken:
                emit(op="claim", token=lease.token, outcome="stale")
                continue
            except distlock.LockLost:
                emit(op="claim", token=lease.token, outcome="lost")
                continue
            emit(op="claim", token=lease.token, outcome="accepted")
            maybe_pause()
            account.balance += 1
            carried = with_lease_or_token(lease)
            try:
                if carried is lease:
                    account.save(lease=lease)
                else:
                    account.save(fencing_token=carried)
                emit(op="write", token=lease.token, value=account.balance, outcome="accepted")
            except distlock.StaleFencingToken:
                emit(op="write", token=lease.token, outcome="stale")
            except distlock.LockLost:
                emit(op="write", token=lease.token, outcome="lost")
        finally:
            lease.release()
    emit(op="done", signals=len(signals))


def transfers(lock_alias, db, source, target, amount, count, ttl, timeout):
    """``count`` times: move ``amount`` from account ``source`` to ``target`` under ``lock_many()``, names in
    that order (the other process gives them the other way round); claim both rows, save both in one transaction.

    Reports "ready", waits for a line on stdin (so both processes start together), then reports when it
    started and finished (``time.monotonic_ns()``, comparable between processes) and its longest wait.
    """
    from django.db import transaction  # noqa: PLC0415

    import distlock  # noqa: PLC0415
    from tests.fencing_app.models import Account  # noqa: PLC0415

    waits = []
    emit(event="ready")
    sys.stdin.readline()
    started = time.monotonic_ns()
    for _ in range(count):
        asked = time.monotonic()
        with distlock.lock_many([f"account:{source}", f"account:{target}"], ttl=ttl, timeout=timeout,
                                using=lock_alias) as leases:
            waits.append(time.monotonic() - asked)
            paying = Account.objects.using(db).claim(leases, pk=source)
            paid = Account.objects.using(db).claim(leases, pk=target)
            paying.balance -= amount
            paid.balance += amount
            with transaction.atomic(using=db):
                paying.save(lease=leases, using=db)
                paid.save(lease=leases, using=db)
    emit(event="done", count=count, started=started, finished=time.monotonic_ns(), max_wait=max(waits),
         pid=os.getpid())


SCENARIOS = {"fenced_increment": fenced_increment, "increment_loop": increment_loop, "transfers": transfers}


if __name__ == "__main__":
    run(SCENARIOS)
