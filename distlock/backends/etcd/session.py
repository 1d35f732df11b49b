"""The session lease of an etcd alias and the background work around it.

One etcd lease per backend per process carries every key the process owns (like etcd's
``concurrency.Session``): granted at the first acquisition, kept alive every TTL/3 by a background
loop, which also deletes leftovers (keys an attempt or a release could not delete while the
cluster did not answer). The per-call ttl of each held key is a deadline of a ``DeadlineTimer``:
once it passes, unless an extension is in flight, the key becomes a leftover the loop deletes.
"""

import logging
import math
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import NamedTuple

from distlock.backends.deadlines import DeadlineTimer, request_deadline
from distlock.backends.etcd._transport import MIN_REQUEST_SECONDS, RequestFailed, SessionGone
from distlock.backends.etcd.transactions import release_txn
from distlock.backends.green import Daemon, killed

logger = logging.getLogger(__name__)

__all__ = ["Held", "Keeper", "Session"]

#: Seconds between two rounds of deleting leftovers while some are left.
_LEFTOVER_RETRY = 0.5


class Session:
    """One etcd lease shared by every key a backend owns in this process.

    Its slots (see the protocol in ``transactions``) belong to it: keys of another session have other names.
    """

    def __init__(self, lease_id, ttl, sent):
        self.id = lease_id
        #: The TTL etcd granted: at least its minimum (1.5 x election timeout), whatever LEASE_TTL asked.
        self.ttl = ttl
        #: Until then etcd keeps the lease even if no keepalive gets through: the last one that did was
        #: *sent* at ``valid_until - ttl``, and etcd restarted the TTL when it arrived, later.
        self.valid_until = sent + ttl
        self.next_keepalive = sent + ttl / 3
        #: Why it was declared lost, or None while alive.
        self.lost = None
        self.leases = weakref.WeakSet()
        #: Slots in use, per lock name: {name: {slot: owner of the acquire call using it}}.
        self.slots = {}
        #: The process that holds it: a forked child inherits the object, not the session.
        self.pid = os.getpid()

    def usable(self, now):
        """Return True if locks may be granted on this session at ``now`` (monotonic): not lost, not run out."""
        return self.lost is None and now < self.valid_until

    @property
    def ours(self):
        """True in the process that was granted the session; False in a forked child."""
        return self.pid == os.getpid()

    def valid_until_here(self):
        """``valid_until``, or -inf once lost or in a forked child (which does not hold the parent's session)."""
        return self.valid_until if self.lost is None and self.ours else -math.inf


class Held(NamedTuple):
    """``Lease.handle``: the key that holds the lock, its create revision (its identity), its session and slot.

    Also a leftover to delete: ``create_revision`` None then means whatever incarnation the key has.
    """

    key: bytes
    create_revision: int | None
    session: Session
    name: str
    slot: int
    owner: str


@dataclass
class _Expiry:
    """When a held key's per-call ttl runs out, and the extensions in flight that may still push it back."""

    deadline: float  # time.monotonic()
    extending: int = 0


class Keeper:
    """The session lease of one backend, the per-call ttls of its held keys, and its background loop.

    ``lock`` guards the session pointer, the slots, the expiries and the leftovers; it is never held
    during I/O.
    """

    def __init__(self, alias, connection, lease_ttl):
        self._alias = alias
        self._connection = connection
        self._lease_ttl = lease_ttl
        self._timer = DeadlineTimer(_weakly(self._expired), name=f"distlock-etcd-ttl:{alias}")
        self._reset()

    def _reset(self):
        self.lock = threading.Lock()
        #: Serialises granting a session lease, so concurrent first acquisitions share one.
        self._grant_lock = threading.Lock()
        self.session = None
        self._expiries = {}  # Held -> _Expiry
        self._leftovers = {}  # key -> Held
        self._leftover_leases = set()
        self._daemon = self._wake = self._stop = None

    def after_fork_in_child(self):
        """Forget the parent's session: its keys are the parent's; this process gets its own.

        The parent's threads do not exist here; under gevent its greenlets do, and its loop is ended
        (the timer forgets its deadlines on its own).
        """
        if self._daemon is not None:
            self._stop.set()
            self._daemon.end_in_child()
        self._reset()

    # -- the session lease -------------------------------------------------------------------------

    def live_session(self, caller_deadline):
        """Return the session lease, granting one if there is none (one round trip, the first time only)."""
        session = self.session
        if session is not None and session.usable(time.monotonic()):
            return session
        with self._grant_lock:
            session = self.session
            if session is not None and session.usable(time.monotonic()):
                return session  # granted by the call that held the grant lock before us
            if session is not None:
                self.session_lost(session, "its keepalive did not get through in time")
            sent = time.monotonic()
            response = self._connection.grant_lease(self._lease_ttl, request_deadline(
                self._connection.timeout, caller_deadline, minimum=MIN_REQUEST_SECONDS))
            if response.error:
                raise RequestFailed(f"etcd refused a session lease: {response.error}")
            session = Session(response.ID, response.TTL, sent)
            if response.TTL != self._lease_ttl:
                logger.info("etcd alias '%s' granted a session lease of %ss instead of LEASE_TTL=%ss (its minimum)",
                            self._alias, response.TTL, self._lease_ttl)
            with self.lock:
                self.session = session
            self._ensure_daemon()
            return session

    def _keep_alive(self, session):
        sent = time.monotonic()
        try:
            ttl = self._connection.keep_alive(session.id, min(session.valid_until, sent + self._connection.timeout))
        except RequestFailed as exc:
            logger.warning("etcd alias '%s': session lease keepalive failed (%s); %.1fs left before it expires",
                           self._alias, exc, session.valid_until - time.monotonic())
            session.next_keepalive = time.monotonic() + min(0.5, session.ttl / 6)
            return
        if ttl <= 0:
            self.session_lost(session, "etcd no longer has it (it expired or was revoked)")
            return
        session.valid_until = sent + ttl
        session.next_keepalive = sent + ttl / 3

    def session_lost(self, session, reason):
        """Mark every lease held on ``session`` lost (once) and forget the session; revoke it when reachable.

        Setting ``session.lost`` makes every one of its leases fail ``check()`` at once (see
        ``Session.valid_until_here``), before the first ``lock_lost`` is sent.
        """
        with self.lock:
            if session.lost is not None:
                return
            session.lost = reason
            leases = list(session.leases)
            if self.session is session:
                self.session = None
            # Revoking makes etcd drop the keys now, in case it still has the lease we gave up on.
            self._leftover_leases.add(session.id)
            for lease in leases:
                self._forget_expiry(lease.handle)
        try:
            self._announce_lost(leases, f"its etcd session lease {session.id:x} was lost: {reason}")
        finally:
            self._wake_daemon()

    def _announce_lost(self, leases, reason):
        """Mark each lease lost and send ``lock_lost``: a receiver that raises stops neither the rest nor us.

        On the background loop anything a receiver raises is logged; on a caller's thread an exception
        that is not an ``Exception`` (``KeyboardInterrupt``, a time limit) is raised again once every
        lease was announced.
        """
        pending = None
        for lease in leases:
            try:
                lease.mark_lost(reason)
            except BaseException as exc:  # noqa: BLE001 - every lease must be reported, whatever a receiver does
                logger.exception("Reporting the loss of lock %r (alias %r) raised; the other leases are still "
                                 "reported.", lease.name, self._alias)
                pending = pending or exc
        daemon = self._daemon
        if pending is not None and (daemon is None or not daemon.is_current()):
            raise pending

    # -- slots (see the protocol) ---------------------------------------------------------------------

    def take_slot(self, contender, session):
        """Give ``contender`` a key of ``session``: the lowest slot of its lock no acquire call here is using."""
        with self.lock:
            if contender.session is not None:
                self._free_slot(contender)
            taken = session.slots.get(contender.name)
            if taken is None:  # the usual case: nobody else here wants this lock
                session.slots[contender.name] = taken = {}
                slot = 0
            else:
                slot = next(number for number in range(len(taken) + 1) if number not in taken)
            taken[slot] = contender.owner
        contender.session, contender.slot = session, slot
        contender.key = contender.lock_prefix + f"{session.id:x}-{slot}".encode()

    def free_slot(self, user):
        """Let later acquire calls reuse the slot of ``user`` (a contender or ``Held``), whose key is gone."""
        with self.lock:
            self._free_slot(user)

    @staticmethod
    def _free_slot(user):
        """``free_slot`` with ``lock`` held.

        Only the acquire call that took the slot frees it (``user.owner``): a lease released after
        its ttl ran out must not free the slot a later call is using. A contender that has not
        queued on a session yet has no slot.
        """
        taken = user.session.slots.get(user.name) if user.session is not None else None
        if taken is not None and taken.get(user.slot) == user.owner:
            del taken[user.slot]
            if not taken:
                del user.session.slots[user.name]

    def leave_behind(self, held):
        """Have the background loop delete ``held``'s key (its slot stays taken until then)."""
        with self.lock:
            self._leftovers[held.key] = held
        self._wake_daemon()

    # -- held keys and their per-call ttl ----------------------------------------------------------------

    def hold(self, lease):
        """Register a granted lease and its ttl; return False if its session can no longer be trusted."""
        handle = lease.handle
        with self.lock:
            if not handle.session.usable(time.monotonic()):
                return False
            handle.session.leases.add(lease)
            deadline = lease.started + lease.ttl
            self._expiries[handle] = _Expiry(deadline)
            self._timer.schedule(handle, deadline)
        return True

    def forget(self, lease):
        """Stop tracking ``lease`` (being released): no loss to report, no ttl to enforce."""
        with self.lock:
            lease.handle.session.leases.discard(lease)
            self._forget_expiry(lease.handle)

    def _forget_expiry(self, handle):
        if self._expiries.pop(handle, None) is not None:
            self._timer.cancel(handle)

    def begin_extension(self, handle, started):
        """Return the expiry of ``handle`` held off until ``end_extension``, or None if its ttl ran out already."""
        with self.lock:
            expiry = self._expiries.get(handle)
            if expiry is None or started >= expiry.deadline:
                return None  # ran out (or released, or its session was lost): renewing comes too late
            expiry.extending += 1
            return expiry

    def end_extension(self, handle, expiry, until):
        """Let the ttl of ``handle`` run again, to ``until`` (monotonic) if the extension succeeded (else None)."""
        with self.lock:
            expiry.extending -= 1
            if until is not None:
                expiry.deadline = max(expiry.deadline, until)
            if self._expiries.get(handle) is expiry:
                self._timer.schedule(handle, expiry.deadline)

    def _expired(self, handle):
        """The timer's callback: the ttl of ``handle`` ran out; the background loop deletes its key."""
        with self.lock:
            expiry = self._expiries.get(handle)
            if expiry is None or expiry.extending:
                return  # released meanwhile, or an extension in flight schedules it again when it ends
            del self._expiries[handle]
            self._leftovers[handle.key] = handle
        self._wake_daemon()

    def released_by_operator(self, key, create_revision):
        """Mark this process's lease on that key incarnation lost at once, if it has one, not at its next renewal."""
        with self.lock:
            session = self.session
            leases = [lease for lease in (session.leases if session else ())
                      if (lease.handle.key, lease.handle.create_revision) == (key, create_revision)]
            for lease in leases:
                self._forget_expiry(lease.handle)
        self._announce_lost(leases, "an operator released it")

    # -- the background loop --------------------------------------------------------------------------

    def _ensure_daemon(self):
        """Start the background loop, or wake it: a new session must get its first keepalive in time
        (the loop may be asleep for up to a minute after the previous session was lost)."""
        with self.lock:
            if self._daemon is not None and self._daemon.is_alive():
                self._wake.set()
                return
            self._wake, self._stop = threading.Event(), threading.Event()
            self._daemon = Daemon(_run, weakref.ref(self), self._wake, self._stop,
                                  name=f"distlock-etcd-keeper:{self._alias}")
            self._daemon.start()

    def _wake_daemon(self):
        wake = self._wake
        if wake is not None:
            wake.set()

    def _keep(self):
        """Do the background work that is due; return the seconds until more is due.

        Keepalive first, with a budget that ends at the session's expiry, so that slow deletions
        cannot make the session expire.
        """
        session = self.session
        if session is not None and session.lost is None:
            if time.monotonic() >= session.valid_until:
                self.session_lost(session, f"its keepalive did not get through for {session.ttl}s")
            elif time.monotonic() >= session.next_keepalive:
                self._keep_alive(session)
        session = self.session
        next_keepalive = session.next_keepalive if session is not None else math.inf
        self._delete_leftovers(min(time.monotonic() + self._connection.timeout,
                                   max(next_keepalive, time.monotonic() + 0.2)))
        due = [next_keepalive]
        with self.lock:
            if self._leftovers or self._leftover_leases:
                due.append(time.monotonic() + _LEFTOVER_RETRY)
        if session is not None:
            due.append(session.valid_until)
        return max(0.0, min(min(due) - time.monotonic(), 60.0))

    def _delete_leftovers(self, deadline):
        with self.lock:
            keys, lease_ids = list(self._leftovers.values()), list(self._leftover_leases)
        for held in keys:
            try:
                if held.create_revision is None:
                    self._connection.delete(held.key, deadline)
                else:
                    self._connection.txn(release_txn(held.key, held.create_revision), deadline)
            except RequestFailed as exc:
                logger.info("etcd alias '%s': could not delete the leftover key %r yet (%s)", self._alias,
                            held.key, exc)
                return
            with self.lock:
                if self._leftovers.get(held.key) is held:
                    del self._leftovers[held.key]
                self._free_slot(held)
        for lease_id in lease_ids:
            try:
                self._connection.revoke_lease(lease_id, deadline)
            except SessionGone:
                pass  # expired already: nothing left to free
            except RequestFailed:
                return
            with self.lock:
                self._leftover_leases.discard(lease_id)

    def close(self):
        """Stop the background work and revoke the session lease: every lock held through it is freed and lost."""
        with self.lock:
            daemon, stop, wake = self._daemon, self._stop, self._wake
            self._daemon = self._stop = self._wake = None
        if daemon is not None:
            stop.set()
            wake.set()
            if not daemon.is_current():
                daemon.join()
        self._timer.stop()
        session = self.session
        if session is not None:
            try:
                self._connection.revoke_lease(session.id, request_deadline(
                    min(self._connection.timeout, MIN_REQUEST_SECONDS), minimum=MIN_REQUEST_SECONDS))
            except RequestFailed as exc:
                logger.warning("etcd alias '%s': could not revoke the session lease on close (%s); "
                               "its locks are freed when it expires", self._alias, exc)
            self.session_lost(session, "the backend was closed")
        with self.lock:
            self._leftover_leases.clear()
            self._leftovers.clear()
            for handle in list(self._expiries):
                self._forget_expiry(handle)


def _weakly(method):
    """Return a function calling ``method`` as long as its object lives: the timer does not keep it alive."""
    reference = weakref.WeakMethod(method)

    def call(*args):
        bound = reference()
        if bound is not None:
            bound(*args)

    return call


def _run(keeper_ref, wake, stop):
    """The background loop; it holds the keeper only weakly, so a dropped backend stops it."""
    while not stop.is_set():
        keeper = keeper_ref()
        if keeper is None:
            return
        wake.clear()
        try:
            wait = keeper._keep()
        except BaseException as exc:  # noqa: BLE001 - the loop that keeps the session alive must outlive anything
            if killed(exc):
                raise  # the greenlet was ended on purpose (a forked child)
            logger.exception("etcd background work failed; retrying")
            wait = _LEFTOVER_RETRY
        del keeper
        wake.wait(wait)
