"""One scenario run: its client processes, fenced store, lock names and history, and the verdict on them."""

import secrets
import time
from itertools import count
from pathlib import Path

from distlock.conformance.checker import check
from distlock.conformance.history import History, load
from distlock.conformance.process import ClientProcess
from distlock.conformance.report import Result

__all__ = ["LOCK_PREFIX", "RECOVERY_SLACK", "Run", "new_prefix", "wait_until"]

#: Lock names of conformance runs start with this, so operators can tell them apart (``distlock list``).
LOCK_PREFIX = "distlock-verify"

#: Seconds a lock may stay unavailable after its holder died, beyond the time the server needs to
#: notice (the ttl, or the session timeout of ZooKeeper and etcd): detection ticks, a waiter's
#: back-off, and a busy machine.
RECOVERY_SLACK = 3.0


def new_prefix():
    """Return a lock-name prefix no other run uses."""
    return f"{LOCK_PREFIX}:{secrets.token_hex(4)}"


class Run:
    """The clients, store and history of one scenario on one ``DISTLOCK`` alias.

    ``store`` is a created ``FencedStore`` or None (no fenced writes). ``env`` and ``module`` let the
    test suite start clients with its own settings or a wrapper module (a fake wall clock).
    """

    def __init__(self, alias, directory, *, store=None, env=None, module="distlock.conformance.client"):
        self.alias = alias
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.store = store
        self.env = env
        self.module = module
        self.nemesis = History(self.directory / "nemesis.jsonl", "nemesis")
        self.clients = []
        self.rows = []
        self.prefix = new_prefix()
        self._names = count()
        self._metric = 0
        self._description = None

    # -- what a scenario uses -------------------------------------------------------------------------

    def lock_name(self):
        """Return a lock name no other run uses."""
        return f"{self.prefix}:{next(self._names)}"

    def spawn(self, *procs, alias=None, env=None, module=None):
        """Start one client per name in ``procs`` (in parallel) and return them once all are ready."""
        config = {"alias": alias or self.alias, "store": self.store.config if self.store else None}
        env = {**(self.env or {}), **(env or {})}
        started = [ClientProcess(proc, config, self.directory, nemesis=self.nemesis, env=env,
                                 module=module or self.module) for proc in procs]
        self.clients.extend(started)
        for client in started:
            client.wait_ready()
        if self._description is None and started:
            self._description = started[0].call("describe")
        return started

    def describe(self):
        """Return ``{"backend", "token_is_safe"}`` of the alias, as the run's first client saw it."""
        if self._description is None:
            self.spawn(f"describe-{len(self.clients)}")
        return self._description

    @property
    def fenced(self):
        """True if writes go through the store: it exists and the backend's tokens are safe.

        ``FencedModel`` refuses tokens that may go backwards (Redlock), so those runs write nothing.
        """
        return self.store is not None and self.describe()["token_is_safe"]

    def row(self):
        """Insert a counter row for one lock name and return its pk."""
        pk = self.store.add_row()
        self.rows.append(pk)
        return pk

    def finish(self, client):
        """Collect the client's rejection metric and let it exit."""
        if client.alive:
            try:
                reported = client.call("metrics")["rejections"]
            except Exception:  # noqa: BLE001 - a client that cannot report leaves the metric unknown
                reported = None
            self._metric = None if reported is None or self._metric is None else self._metric + reported
        client.quit()

    def close(self):
        for client in self.clients:
            self.finish(client)
        self.nemesis.close()

    # -- the verdict ----------------------------------------------------------------------------------

    def history(self):
        events = load(self.directory)
        if self.fenced:
            events += self.store.commits(self.rows)
        return sorted(events, key=lambda event: event["t"])

    def judge(self, scenario, backend, runs, *, expect_overlap, recovery_bound=None):
        """Return the ``Result`` of the run's history; call it after ``close()``.

        ``expect_overlap``: why un-fenced critical sections are expected to overlap (reported), or
        False: an overlap is then a violation (no fault could explain it).
        """
        history = self.history()
        values = self.store.values() if self.fenced else {}
        verdict = check(history, initial=dict.fromkeys(self.rows, 0) if values else None,
                        final={pk: values[pk] for pk in self.rows} if values else None)
        result = Result(scenario=scenario, backend=backend, runs=runs, acquisitions=verdict.acquisitions,
                        overlaps=verdict.overlaps, recovery_ms=verdict.recovery_ms)
        problems = result.violations
        if self.describe()["token_is_safe"]:
            if verdict.duplicate_tokens:
                problems.append(f"{len(verdict.duplicate_tokens)} fencing token(s) issued twice")
            if verdict.regressions:
                problems.append(f"{len(verdict.regressions)} acquisition(s) got a smaller token than an earlier one")
        if self.fenced:
            result.stale_accepted = len(verdict.stale_accepted)
            result.false_rejections = len(verdict.false_rejections)
            result.rejections = verdict.rejections
            result.rejection_rows = self.store.rejection_rows(self.rows)
            result.rejection_metric = self._metric
            if verdict.stale_accepted:
                problems.append(f"{len(verdict.stale_accepted)} stale write(s) accepted")
            if verdict.false_rejections:
                problems.append(f"{len(verdict.false_rejections)} write(s) refused without a newer token")
            if verdict.stray_tokens:
                problems.append(f"{len(verdict.stray_tokens)} write(s) accepted with a token not issued to them")
            if verdict.lost_updates:
                problems.append(f"{verdict.lost_updates} acknowledged increment(s) lost")
            if result.rejection_rows != result.rejections or result.rejection_metric not in (None, result.rejections):
                problems.append("refused writes counted differently by the history, the rejection log and the metric")
        if expect_overlap and verdict.overlaps:
            result.notes.append(f"overlaps expected: {expect_overlap}")
        elif expect_overlap:
            result.notes.append(f"no overlap, although {expect_overlap}")
        elif verdict.overlaps:
            problems.append(f"{verdict.overlaps} overlapping critical section(s) without any fault")
        if recovery_bound is not None:
            slow = [ms for ms in verdict.recovery_ms if ms > recovery_bound * 1000]
            if slow:
                problems.append(f"lock unavailable for {max(slow) / 1000:.1f}s after its holder died "
                                f"(bound {recovery_bound:g}s)")
        return result


def wait_until(moment):
    """Sleep until ``time.monotonic()`` reaches ``moment``."""
    delay = moment - time.monotonic()
    if delay > 0:
        time.sleep(delay)
