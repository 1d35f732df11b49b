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
    """One page of the held locks of one alias, or why it could not be read."""

    alias: str
    backend: str
    locks: list = field(default_factory=list)
    error: str = ""
    #: The cursor of the alias's next page; None on its last page (or on an error).
    cursor: str | None = None
    #: True if ``error`` is the backend refusing the page asked for: a cursor it never gave.
    bad_page: bool = False


@dataclass
class PingResult:
    alias: str
    backend: str
    seconds: float | None = None
    error: str = ""
    #: Records under the alias's namespace that the lock protocol ignores (``foreign_records()``).
    foreign: list = field(default_factory=list)


def describe_failure(exc, *, cursor=None):
    """The failure as shown by ``distlock check`` and the admin page: with no secret in it.

    With the ``cursor`` the call was given, a ``TypeError``/``ValueError`` is the backend refusing
    that page before any I/O (``check_page``, a cursor it cannot parse): the caller's input, not a bug.
    """
    if isinstance(exc, (BackendUnavailable, ImproperlyConfigured, ImportError)):
        return redact(f"{type(exc).__name__}: {exc}")
    if _refused_page(exc, cursor):
        return redact(f"no page at cursor {cursor!r} ({type(exc).__name__}: {exc})")
    # Not a failure a backend is expected to report: a bug, so keep its traceback in the log.
    logger.exception("Backend raised an unexpected error: %s", redact(exc))
    return redact(f"unexpected {type(exc).__name__}: {exc}")


def _refused_page(exc, cursor):
    """Return True if ``exc`` is a backend refusing the page at ``cursor`` before any I/O (``check_page``)."""
    return cursor is not None and isinstance(exc, (TypeError, ValueError))


def _backend_path(alias):
    entry = get_config().get(alias)
    return entry.get("BACKEND", "?") if isinstance(entry, dict) else "?"


def aliases(only=None):
    """Return the configured aliases, or just ``only``."""
    return list(get_config()) if only is None else [only]


def held_locks(only=None, *, prefix="", limit=None, cursor=None):
    """Return one ``AliasLocks`` per alias: one page of its locks whose name starts with ``prefix``.

    ``limit`` and ``cursor`` as a backend's ``held_locks()`` takes them: one page of each alias comes
    back, filtered by the server where the backend can (see each backend's ``held_locks()``). A cursor
    belongs to one alias's pages, so it needs ``only``. The page comes as the backend returns it
    (Redis: possibly a few more than ``limit``, as the last ``SCAN`` brought).
    """
    if cursor is not None and only is None:
        raise ValueError("a cursor is one alias's: pass the alias as only")
    found = []
    for alias in aliases(only):
        entry = AliasLocks(alias, _backend_path(alias))
        try:
            page = locks[alias].held_locks(prefix, limit=limit, cursor=cursor)
        except Exception as exc:  # noqa: BLE001 - reported on the alias's own row, see the module docstring
            entry.error = describe_failure(exc, cursor=cursor)
            entry.bad_page = _refused_page(exc, cursor)
        else:
            entry.locks, entry.cursor = list(page), page.cursor
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
