"""The locks held on every configured alias, read live from the servers, for the admin page and commands.

One unreachable or broken backend must never hide the others: its failure is reported beside its
alias instead of raised.
"""

import logging
import time
from dataclasses import dataclass, field

from django.core.exceptions import ImproperlyConfigured

from distlock.conf import get_config
from distlock.exceptions import BackendUnavailable
from distlock.handler import locks
from distlock.redaction import redact

__all__ = ["AliasLocks", "PAGE_SIZE", "PingResult", "aliases", "describe_failure", "each_held", "find", "held_locks",
           "ping_all"]

logger = logging.getLogger(__name__)

#: Locks asked for per request when going through an alias's locks page by page (``each_held``).
PAGE_SIZE = 500


@dataclass
class AliasLocks:
    """The held locks of one alias, or why they could not be read."""

    alias: str
    backend: str
    locks: list = field(default_factory=list)
    error: str = ""


@dataclass
class PingResult:
    alias: str
    backend: str
    seconds: float | None = None
    error: str = ""
    #: Records under the alias's namespace that the lock protocol ignores (``foreign_records()``).
    foreign: list = field(default_factory=list)


def describe_failure(exc):
    """The failure as shown by ``distlock check`` and the admin page: with no secret in it."""
    if isinstance(exc, (BackendUnavailable, ImproperlyConfigured, ImportError)):
        return redact(f"{type(exc).__name__}: {exc}")
    # Not a failure a backend is expected to report: a bug, so keep its traceback in the log.
    logger.exception("Backend raised an unexpected error: %s", redact(exc))
    return redact(f"unexpected {type(exc).__name__}: {exc}")


def _backend_path(alias):
    entry = get_config().get(alias)
    return entry.get("BACKEND", "?") if isinstance(entry, dict) else "?"


def aliases(only=None):
    """Return the configured aliases, or just ``only``."""
    return list(get_config()) if only is None else [only]


def held_locks(only=None, *, search=""):
    """Return one ``AliasLocks`` per alias, locks sorted by name; ``search`` keeps names containing it."""
    found = []
    needle = search.casefold()
    for alias in aliases(only):
        entry = AliasLocks(alias, _backend_path(alias))
        try:
            held = locks[alias].held_locks()
        except Exception as exc:  # noqa: BLE001 - reported on the alias's own row, see the module docstring
            entry.error = describe_failure(exc)
        else:
            entry.locks = sorted((info for info in held if needle in info.name.casefold()), key=lambda i: i.name)
        found.append(entry)
    return found


def each_held(alias, *, prefix="", limit=None):
    """Yield the held locks of ``alias`` whose name starts with ``prefix``, ``limit`` at most, page by page.

    However many locks are held, one page of them is in memory at a time. Raises what the backend raises.
    """
    backend, cursor, left = locks[alias], None, limit
    while left is None or left > 0:
        page = backend.held_locks(prefix, limit=PAGE_SIZE if left is None else min(PAGE_SIZE, left), cursor=cursor)
        shown = page if left is None else page[:left]  # a Redis page may run over its limit
        yield from shown
        if left is not None:
            left -= len(shown)
        cursor = page.cursor
        if cursor is None:
            return


def find(alias, name):
    """Return the ``LockInfo`` of lock ``name`` on ``alias``, or None if nobody holds it."""
    for info in locks[alias].held_locks(prefix=name):
        if info.name == name:
            return info
    return None


def ping_all(only=None):
    """Make one round trip to each alias's server; return a ``PingResult`` per alias."""
    results = []
    for alias in aliases(only):
        result = PingResult(alias, _backend_path(alias))
        try:
            backend = locks[alias]
            started = time.perf_counter()
            backend.ping()
            result.seconds = time.perf_counter() - started
            result.foreign = [redact(record) for record in backend.foreign_records()]
        except Exception as exc:  # noqa: BLE001 - reported per alias: a health probe must name every failure
            result.error = describe_failure(exc)
        results.append(result)
    return results
