"""``distlock verify``: run the client-side scenarios against one configured alias and collect their results.

Nothing here disturbs a server: the scenarios pause and kill only the client processes they start,
use lock names under ``distlock-verify:<random>``, and write to a pair of tables created for the
run on ``database`` and dropped afterwards (with the rejection log entries they caused). Histories
of runs with a violation are kept for inspection; the others are deleted.
"""

import shutil
import tempfile
from pathlib import Path

from distlock.backends.locmem import LocMemBackend
from distlock.conformance import scenarios
from distlock.conformance.bad_input import bad_input
from distlock.conformance.run import Run, new_prefix
from distlock.conformance.store import FencedStore
from distlock.handler import locks

__all__ = ["NotVerifiable", "verify"]


class NotVerifiable(Exception):
    """The alias cannot be verified across processes (a process-local backend)."""


def verify(alias, *, database, clients=8, iterations=25, runs=1, ttl=2.0, progress=None):
    """Return ``(results, kept)``: one ``Result`` per scenario, and the directory of kept histories (or None)."""
    backend = locks[alias]
    if isinstance(backend, LocMemBackend):
        raise NotVerifiable(f"alias '{alias}' uses LocMemBackend, whose locks exclude nobody outside one process; "
                            "there is nothing to verify across processes.")
    label = f"{alias} ({type(backend).__name__})"
    directory = Path(tempfile.mkdtemp(prefix="distlock-verify-"))
    store = FencedStore(database).create()
    results = []
    plan = [
        ("contention", lambda run: scenarios.contention(run, label, clients=clients, iterations=iterations)),
        ("client pause", lambda run: scenarios.client_pause(run, label, ttl=ttl, runs=runs)),
        ("client crash", lambda run: scenarios.client_crash(run, label, ttl=ttl, runs=runs)),
    ]
    try:
        for title, scenario in plan:
            if progress:
                progress(f"{title} ...")
            run = Run(alias, directory / title.replace(" ", "-"), store=store)
            try:
                results.append(scenario(run))
            finally:
                run.close()
        if progress:
            progress("bad input ...")
        results.append(bad_input(alias, label, new_prefix(), store=store))
    finally:
        store.drop()
    if all(result.ok for result in results):
        shutil.rmtree(directory, ignore_errors=True)
        return results, None
    return results, directory
