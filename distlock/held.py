"""The leases held in the current ``contextvars`` context, for ``DISTLOCK_HIERARCHY`` and for reentrancy.

One context per thread, per asyncio task (which starts with a copy of its creator's) and per greenlet.
The record is a tuple of immutable entries replaced by one ``ContextVar.set``, never mutated: an
exception that lands between any two lines (``KeyboardInterrupt``, a Celery time limit) leaves the
old record or the new one, never half of each. A context that starts as a copy of another changes
only its own copy.

Each entry is stamped with the id of the process that made it. A child forked inside a block
inherits its parent's record, but not its parent's leases: they stay the parent's on the server.
The child's record therefore skips every entry stamped with another process, so a child never
re-enters (``reentrant=True``) nor counts for ``DISTLOCK_HIERARCHY`` a lock its parent holds.

Leases are held weakly, so that a lease its caller dropped unreleased is still collected and its
renewal ends (``Renewer`` holds it weakly for the same reason); an entry whose lease was collected
counts no more and is dropped at the next change.
"""

import contextvars
import os
import weakref

__all__ = ["HeldLeases"]


class HeldLeases:
    """A per-context record of held leases, each with a piece of immutable data (or None)."""

    def __init__(self, name, *, keep_released=False):
        self._record = contextvars.ContextVar(name, default=())
        #: False: an entry whose lease is released counts no more (it is skipped, then dropped at the
        #: next change). True: it stays until removed, so its owner can still find it and its data.
        self._keep_released = keep_released

    def entries(self):
        """Return ``(lease, data)`` for each entry that counts, oldest first."""
        return [(lease, data) for ref, data, _ in self._kept() if (lease := ref()) is not None]

    def snapshot(self):
        """Return the record as it is, for ``restore()``."""
        return self._record.get()

    def restore(self, snapshot):
        """Put back a record taken by ``snapshot()`` (one set)."""
        self._record.set(snapshot)

    def add(self, lease, data=None):
        """Record ``lease`` with ``data`` (one set)."""
        self._record.set((*self._kept(), (weakref.ref(lease), data, os.getpid())))

    def replace(self, lease, data):
        """Give the entry of ``lease`` new ``data`` (one set); no-op if it has none."""
        self._record.set(tuple((ref, data if ref() is lease else old, pid) for ref, old, pid in self._kept()))

    def remove(self, lease):
        """Forget ``lease`` (one set)."""
        self._record.set(tuple(entry for entry in self._kept() if entry[0]() is not lease))

    def _kept(self):
        """Return the entries that count: made in this process, lease alive (and unreleased, unless kept)."""
        pid = os.getpid()
        return tuple((ref, data, made_in) for ref, data, made_in in self._record.get()
                     if made_in == pid and (lease := ref()) is not None
                     and (self._keep_released or not lease.released))
