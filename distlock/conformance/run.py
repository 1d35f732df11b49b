"""One scenario run: its client processes, fenced store, lock names and history, and the verdict on them."""

import secrets
import time
from itertools import count
from pathlib import Path

from distlock.conformance.checker import check, classify_overlaps, overlap_excerpts
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

    def spawn(self, *procs, alias=None, env=None, module=None, exec_prefix=()):
        """Start one client per name in ``procs`` (in parallel) and return them once all are ready."""
        config = {"alias": alias or self.alias, "store": self.store.config if self.store else None}
        env = {**(self.env or {}), **(env or {})}
        started = [ClientProcess(proc, config, self.directory, nemesis=self.nemesis, env=env,
                                 module=module or self.module, exec_prefix=exec_prefix) for proc in procs]
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

    def history(self, *, lock=None, rows=None):
        """The run's events; with ``lock``, only that lock's, its ``rows``' commits and the nemesis's own."""
        events = load(self.directory)
        if lock is not None:
            events = [event for event in events if event.get("lock", lock) == lock]
        if self.fenced:
            events += self.store.commits(self.rows if rows is None else rows)
        return sorted(events, key=lambda event: event["t"])

    def judge(self, scenario, backend, runs, *, expect_overlap, recovery_bound=None, forgets_grants=False, lock=None,
              rows=None):
        """Return the ``Result`` of the run's history; call it after ``close()``.

        ``expect_overlap``: why un-fenced critical sections may overlap: each overlap must then be
        explained by a fault the nemesis injected or a lease its holder saw lost; or False: any
        overlap is a violation. ``forgets_grants``: why the servers may forget a grant (a restart
        without persistence), so a history that no lock service could have produced (P4) is expected;
        False asserts P4. ``lock`` and ``rows`` judge one lock of a run whose clients go on (a soak's
        episode): its events and its rows only, and before ``close()``, so without the clients'
        rejection metric.
        """
        rows = self.rows if rows is None else rows
        history = self.history(lock=lock, rows=rows)
        values = self.store.values() if self.fenced else {}
        token_is_safe = self.describe()["token_is_safe"]
        verdict = check(history, initial=dict.fromkeys(rows, 0) if values else None,
                        final={pk: values[pk] for pk in rows} if values else None,
                        tokens_must_increase=token_is_safe, forgets_grants=forgets_grants,
                        only_faults_cause_overlaps=bool(expect_overlap))
        result = Result(scenario=scenario, backend=backend, runs=runs, acquisitions=verdict.acquisitions,
                        overlaps=verdict.overlaps, recovery_ms=verdict.recovery_ms)
        problems = result.violations
        if verdict.linearizability_violations and forgets_grants:
            result.notes.append(f"{len(verdict.linearizability_violations)} lock(s) granted twice, as expected: "
                                f"{forgets_grants}")
        elif verdict.linearizability_violations:
            problems.extend(f"not linearizable (P4): {text}" for text in verdict.linearizability_violations)
        if token_is_safe:
            if verdict.duplicate_tokens:
                problems.append(f"{len(verdict.duplicate_tokens)} fencing token(s) issued twice")
            if verdict.regressions:
                problems.append(f"{len(verdict.regressions)} acquisition(s) got a smaller token than an earlier one")
        if self.fenced:
            result.stale_accepted = len(verdict.stale_accepted)
            result.false_rejections = len(verdict.false_rejections)
            result.rejections = verdict.rejections
            result.rejection_rows = self.store.rejection_rows(rows)
            result.rejection_metric = self._metric if lock is None else None
            if verdict.stale_accepted:
                problems.append(f"{len(verdict.stale_accepted)} stale write(s) accepted")
            if verdict.false_rejections:
                problems.append(f"{len(verdict.false_rejections)} write(s) refused without a newer token")
            if verdict.stray_tokens:
                problems.append(f"{len(verdict.stray_tokens)} write(s) accepted with a token not issued to them")
            if verdict.lost_updates:
                problems.append(f"{verdict.lost_updates} acknowledged increment(s) lost")
            problems.extend(f"acknowledged write lost: {text}" for text in verdict.lost_writes)
            problems.extend(f"stale read: {text}" for text in verdict.stale_reads)
            if result.rejection_rows != result.rejections or result.rejection_metric not in (None, result.rejections):
                problems.append("refused writes counted differently by the history, the rejection log and the metric")
        if expect_overlap and verdict.unexplained_overlaps:
            problems.extend(f"overlap no fault explains: {text}" for text in verdict.unexplained_overlaps)
            problems.extend(overlap_excerpts(history))
        elif expect_overlap and verdict.overlaps:
            result.notes.append(f"overlaps expected: {expect_overlap}")
        elif expect_overlap:
            result.notes.append(f"no overlap, although {expect_overlap}")
        elif verdict.overlaps:
            problems.append(f"{verdict.overlaps} overlapping critical section(s) without any fault")
            explained = classify_overlaps(history)[0]
            problems.extend(f"what the nemesis or a lost lease would explain: {text}" for text in explained)
            problems.extend(overlap_excerpts(history))
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
