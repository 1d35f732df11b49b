"""The ``Lease``: one held lock, whatever the backend, with its fencing token and validity."""

import logging
import threading
import time
from datetime import datetime, timedelta, timezone

from distlock import metrics
from distlock.backends import offload
from distlock.exceptions import LockLost, LockSuspended
from distlock.renewal import Renewer
from distlock.signals import lock_lost, lock_released, send_robustly
from distlock.validation import validate_name, validate_seconds

__all__ = ["Lease", "LeaseSet"]

logger = logging.getLogger(__name__)


class Lease:
    """A lock held by this process until ``release()``, expiry, or loss.

    Validity is counted on ``time.monotonic()`` from the moment the acquire request was sent, so a
    wall-clock jump on this machine neither shortens nor stretches it. ``acquired_at`` and
    ``expires_at`` are wall-clock datetimes for display only.
    """

    def __init__(self, *, backend, name, owner, token, ttl, started, validity, acquired_at=None,
                 handle=None, session_timeout=None, attempts=1, auto_renew=False, max_hold=None):
        self.backend = backend
        self.alias = backend.alias
        self.name = name
        #: Random id stored on the server; release and extend only act while it still matches.
        self.owner = owner
        #: Fencing token: strictly greater than every token the alias issued before (see ``token_is_safe``).
        self.token = token
        #: True if the backend guarantees tokens never go backwards; False for Redlock.
        self.token_is_safe = backend.token_is_safe
        self.ttl = ttl
        #: Session backends (ZooKeeper, etcd): seconds after which the server frees the lock of a dead holder.
        self.session_timeout = session_timeout
        self.handle = handle
        #: Tries ``acquire()`` needed; more than one means it waited for another holder (metrics: contention).
        self.attempts = attempts
        self.acquired_at = acquired_at or datetime.now(timezone.utc)
        self._started = started
        self._valid_until = started + validity
        #: When the request behind ``_valid_until`` was sent (the acquisition, or the latest extension).
        self._validity_sent = started
        self._lost_reason = None
        self._suspended = False
        self._released = False
        self._state_lock = threading.Lock()
        #: Built with the lease, started by ``distlock.api.acquire()`` once the lease reached its caller.
        self._renewer = Renewer(self, max_hold=max_hold) if auto_renew else None

    def __repr__(self):
        state = "lost" if self.lost else "released" if self._released else "held"
        return f"<Lease {self.name!r} alias={self.alias!r} token={self.token} {state}>"

    # -- validity ----------------------------------------------------------------------------

    def remaining(self):
        """Return the seconds of the ttl left (0.0 once expired), by the monotonic clock."""
        return max(0.0, self._valid_until - time.monotonic())

    @property
    def expires_at(self):
        """Wall-clock time at which the lease runs out unless renewed, for display."""
        return self.acquired_at + timedelta(seconds=self._valid_until - self._started)

    @property
    def started(self):
        """``time.monotonic()`` when the acquire request was sent: validity and ``max_hold`` count from it."""
        return self._started

    @property
    def lost_reason(self):
        """Why the lease was marked lost, or None."""
        return self._lost_reason

    @property
    def renewer(self):
        """The ``Renewer`` of an auto-renewed lease, or None."""
        return self._renewer

    @property
    def held_for(self):
        """Seconds since the acquire request was sent."""
        return time.monotonic() - self._started

    @property
    def lost(self):
        """True once the lease is known lost or its validity ran out."""
        if self._lost_reason is not None or time.monotonic() >= self._valid_until:
            return True
        session_until = self.backend.session_valid_until(self)
        return session_until is not None and time.monotonic() >= session_until

    @property
    def released(self):
        return self._released

    @property
    def suspended(self):
        return self._suspended

    def check(self):
        """Raise ``LockLost`` if the lease is lost or expired, ``LockSuspended`` while its session is uncertain.

        Local and cheap: no network round trip. Call it before every write the lock protects. On
        session backends it also raises once the session may have expired on the server (no keepalive
        got through for its timeout): a process frozen past that finds out the moment it wakes, before
        any background thread has run.
        """
        if self._lost_reason is not None:
            raise LockLost(f"Lock {self.name!r} (token {self.token}) was lost: {self._lost_reason}.")
        now = time.monotonic()
        if now >= self._valid_until:
            raise LockLost(f"Lock {self.name!r} (token {self.token}) expired: its ttl of {self.ttl:g}s ran out.")
        session_until = self.backend.session_valid_until(self)
        if session_until is not None and now >= session_until:
            raise LockLost(
                f"Lock {self.name!r} (token {self.token}) expired with its session on alias '{self.alias}': "
                f"no keepalive reached the server within the session timeout of {self.session_timeout:g}s."
            )
        if self._suspended:
            raise LockSuspended(
                f"Lock {self.name!r} (token {self.token}): the connection to alias '{self.alias}' is "
                "suspended; wait for it to reconnect before writing."
            )

    # -- changes of state, called by renewal and by session backends ------------------------------

    def _extended(self, started, validity):
        """Record a successful extension whose request was sent at ``started``.

        The server now frees the lock ``validity`` after ``started``, sooner than before if the new
        ttl is shorter, so the lease follows it, both ways. An extension sent earlier but answered
        later changes nothing: the server applied the later request last.
        """
        with self._state_lock:
            if self._lost_reason is None and started >= self._validity_sent:
                self._validity_sent = started
                self._valid_until = started + validity

    def mark_lost(self, reason):
        """Mark the lease lost (once), then send ``lock_lost``; later ``check()`` calls raise ``LockLost``.

        Called from renewal and backend threads: the lease is marked before any receiver runs, and a
        receiver that raises is logged (``send_robust``), so it stops neither the other receivers nor
        the thread that found the loss.
        """
        with self._state_lock:
            if self._lost_reason is not None or self._released:
                return
            self._lost_reason = reason
        logger.warning("Lost lock %r (alias %r, token %s): %s", self.name, self.alias, self.token, reason)
        metrics.record_lost(self)
        send_robustly(lock_lost, "lock_lost", sender=type(self.backend), alias=self.alias, lease=self, reason=reason)

    def mark_suspended(self, suspended):
        """Flag the lease uncertain (connection suspended) or certain again (reconnected, lock still ours)."""
        self._suspended = suspended

    # -- ending --------------------------------------------------------------------------------

    def extend(self, ttl=None):
        """Make the lease valid for ``ttl`` more seconds (default: its own ttl); return False if it was lost.

        A ``ttl`` shorter than the validity left shortens it. Raise ``TypeError``/``ValueError`` for a
        ``ttl`` that ``acquire()`` would refuse, before any I/O.
        """
        ttl = self.ttl if ttl is None else validate_seconds("ttl", ttl)
        if self._lost_reason is not None or self._released:
            return False
        started = time.monotonic()
        return self._settle_extension(started, ttl, self.backend.extend(self, ttl))

    def _settle_extension(self, started, ttl, extended):
        """Record what an extension to ``ttl`` sent at ``started`` found; return ``extended``.

        Also called by the renewal scheduler, which extends many leases in one call.
        """
        if extended:
            self._extended(started, self.backend.trusted_validity(ttl))
            return True
        self.mark_lost("the lock was gone or owned by someone else when extending it")
        return False

    def release(self):
        """Delete the lock on the server if this lease still owns it; return True if it did.

        Releasing twice, or after another owner took the lock over, deletes nothing and returns False.
        A ``lock_released`` receiver that raises is logged, not raised.
        """
        return self._end(announce=True)

    def _end(self, *, announce):
        """Stop renewal, then delete the lock; send ``lock_released`` if ``announce``.

        The steps are ordered for an exception (a time limit, ``KeyboardInterrupt``) that arrives
        between any two of them: renewal is told to stop in the same step that marks the lease
        released, before anything that can block, so an interrupted release never leaves the lock
        renewed. Nothing here waits for the renewal scheduler: an extension of this lease in flight
        cannot bring the lock back after the delete, nor make the release look like a loss (see
        ``Renewer.stop``). Whatever is cut short after that leaves a lock nobody renews, which the
        server frees at its ttl or with the session. A release interrupted before the delete cannot
        be retried (the lease already counts as released): it expires.
        """
        renewer = self._renewer
        with self._state_lock:
            if self._released:
                return False
            self._released = True
            if renewer is not None:
                renewer.cancel()
        if renewer is not None:
            renewer.stop()
        # Compare-and-delete is safe even for a lease believed lost: it only deletes our own record.
        released = self.backend.release(self)
        metrics.record_release(self)
        if announce:
            send_robustly(lock_released, "lock_released", sender=type(self.backend), alias=self.alias, lease=self,
                          released=released)
        return released

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.release()
        return False

    # -- from a coroutine ------------------------------------------------------------------------
    # The server calls run on a worker thread (``distlock.backends.offload.submit``) and always run
    # to their end: a coroutine cancelled while its release or extension is in flight does not cut it
    # short, so a cancelled release still deletes the lock.

    async def arelease(self):
        """``release()`` from a coroutine: the event loop does not wait for the server."""
        return await offload.finish(offload.submit(self.release))

    async def aextend(self, ttl=None):
        """``extend()`` from a coroutine; a bad ``ttl`` raises before any I/O, as there."""
        ttl = self.ttl if ttl is None else validate_seconds("ttl", ttl)
        return await offload.finish(offload.submit(self.extend, ttl))

    async def acheck(self):
        """``check()`` from a coroutine; it makes no round trip, so it runs on the loop."""
        self.check()

    async def __aenter__(self):
        return self

    async def __aexit__(self, exc_type, exc, tb):
        await self.arelease()
        return False


class LeaseSet:
    """The leases ``lock_many()`` took, one per distinct name, in the order it took them.

    Released together, in reverse order, by ``release()`` or at the end of its ``with`` block. Its
    repr shows names and tokens, never the owner ids (which release and extend compare).
    """

    def __init__(self, leases):
        #: The member ``Lease`` objects in the canonical order they were taken.
        self.leases = tuple(leases)
        self._by_name = {lease.name: lease for lease in self.leases}

    def __repr__(self):
        state = "lost" if self.lost else "released" if self.released else "held"
        members = ", ".join(f"{lease.name!r} token={lease.token}" for lease in self.leases)
        alias = self.leases[0].alias if self.leases else None
        return f"<LeaseSet alias={alias!r} [{members}] {state}>"

    def __len__(self):
        return len(self.leases)

    def __iter__(self):
        return iter(self.leases)

    @property
    def names(self):
        """The lock names, in the order the leases were taken."""
        return tuple(self._by_name)

    def lease_for(self, name):
        """Return the member ``Lease`` on lock ``name``; raise ``KeyError`` naming the set if there is none."""
        lease = self._by_name.get(validate_name(name))
        if lease is None:
            raise KeyError(f"{name!r} is not one of the locks of {self!r}.")
        return lease

    def token_for(self, name):
        """Return the fencing token of the member lease on lock ``name`` (``KeyError`` if there is none)."""
        return self.lease_for(name).token

    @property
    def lost(self):
        """True if any member lease is lost (see ``Lease.lost``)."""
        return any(lease.lost for lease in self.leases)

    @property
    def released(self):
        """True once every member lease is released."""
        return all(lease.released for lease in self.leases)

    def check(self):
        """Raise ``LockLost`` or ``LockSuspended`` for the first member lease that would (``Lease.check()``)."""
        for lease in self.leases:
            lease.check()

    def release(self):
        """Release every member lease, last taken first; return True if each still owned its lock.

        Renewal of every member is cancelled first (one flag each, nothing that blocks), so an
        exception arriving during the releases (a time limit, ``KeyboardInterrupt``) leaves the rest
        to expire at their ttl, never renewed. An error releasing one lease does not stop the others;
        the first one is raised after them.
        """
        for lease in self.leases:
            if lease.renewer is not None:
                lease.renewer.cancel()
        released, error = True, None
        for lease in reversed(self.leases):
            try:
                released = lease.release() and released
            except Exception as exc:  # noqa: BLE001 - raised after the other releases
                released = False
                error = error or exc
        if error is not None:
            raise error
        return released

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.release()
        return False
