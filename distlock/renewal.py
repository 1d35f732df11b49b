"""Auto-renewal: one scheduler per backend alias keeps every auto-renewed lease of the process alive, and stops at
``max_hold``.

A thread per lease does not scale: a worker holding a lock per customer import would run a thousand
threads, each with its stack, all waking to take the GIL at once. A scheduler is a heap of deadlines
served by one daemon thread (a greenlet under gevent) per alias, which exists only while the alias
has leases to renew; a slow or unreachable server delays the renewals of its own alias only.

What a lease's caller runs (``acquire()`` starting renewal, ``release()`` stopping it, a lease dropped
without release) can be cut short between any two lines by a time limit, a ``gevent.Timeout`` or a
signal handler that raises, so it takes no lock and waits on nothing: it sets flags on its
``Renewer`` and posts the renewer to its scheduler's mailbox (``distlock.backends.green.mailbox``,
whose ``put`` never blocks). The heap, the renewers taken in and the renewal clocks belong to the
loop that serves the scheduler, the only code that changes them.

Which loop serves is settled without a lock too. A scheduler has one token; a loop serves only
while it holds it (taken with ``list.pop``, one atomic step). A caller that posts and sees the token
free starts a loop, unless the loop started last is still alive; every loop that stops serving, or
finds another serving, first withdraws as the loop started last, then looks at the mailbox once
more and serves again if something came in. So a renewer posted is always taken in: by the loop
serving (it looks before it gives the token up), by the last one started (it looks before it
ends), or by the one its caller starts. A caller cut short anywhere in this leaves at worst a loop
that was never started, which the next caller replaces; at worst a loop too many, which finds the
token taken and ends.
"""

import heapq
import itertools
import logging
import math
import queue
import time
import weakref

from distlock.backends.green import Daemon, ForkedChildHook, killed, mailbox
from distlock.exceptions import BackendUnavailable

__all__ = ["Renewer", "renewing"]

logger = logging.getLogger(__name__)


class Renewer:
    """Extend one lease every ``ttl / 3`` seconds, from its alias's scheduler, until it is released.

    The scheduler holds only a weak reference to the lease, so a lease dropped without release stops
    its own renewal and then expires on the server. Renewal stops, and the lock is released and the
    lease marked lost, once ``max_hold`` seconds have passed: a hung worker whose process still renews
    must not hold the lock forever. A server that cannot be reached is retried until the lease's own
    validity runs out; then the lease is marked lost. Any other error of an extension (a bug, a reply
    the client could not read) is logged with its traceback and retried the same way: the scheduler
    never drops a lease that looks held but is no longer renewed. If renewing a lease fails in a way
    nothing above handles, the lease is marked lost.
    """

    #: Fraction of the ttl between two extensions.
    interval_ratio = 1 / 3
    #: Fraction of the interval by which an extension may come early, to share a round trip with others due.
    early_ratio = 1 / 4

    def __init__(self, lease, *, max_hold=None, clock=time.monotonic):
        self._lease_ref = weakref.ref(lease)
        self._ttl = lease.ttl
        self._interval = lease.ttl * self.interval_ratio
        self._early = self._interval * self.early_ratio
        self._hold_deadline = None if max_hold is None else lease.started + max_hold
        self._clock = clock
        # Counted from the acquire request, not from start(): ``acquire()`` starts renewal only after
        # the ``lock_acquired`` receivers ran, and a slow receiver must not delay the first extension
        # past the lease's validity.
        self._due = lease.started + self._interval
        self._scheduler = None
        #: The scheduler state it was posted to (a forked child's scheduler has a state of its own).
        self._posted_to = None
        # Flags: the caller sets ``_cancelled``, the scheduler's loop the others.
        #: Told to stop (released, or given back by an acquire cut short).
        self._cancelled = False
        #: Dropped by its scheduler: the lease ended, or renewal stopped for good.
        self._ended = False
        #: Set during a turn once renewal is over for good (see ``_due_extension``).
        self._finished = False

    def start(self):
        """Post the lease to its alias's scheduler (once), without waiting. A renewer cancelled before never extends."""
        lease = self._lease_ref()
        if self._scheduler is None and lease is not None:
            self._scheduler = _scheduler_of(lease.backend)
            self._scheduler.post(self)

    def cancel(self):
        """Stop renewing at the scheduler's next look, without waiting: one flag, nothing that blocks."""
        self._cancelled = True

    def stop(self):
        """Stop renewing, and tell the scheduler so that it forgets the lease now; never waits.

        An extension of this lease already on its way is not waited for, and needs not be. Before
        each round the scheduler reads the flags (``_cancelled``, and ``released`` on the lease,
        which ``Lease._end`` sets first), so no extension is sent once they are set; one sent before
        is a compare-and-extend on the lease's owner (its node or create revision on ZooKeeper and
        etcd), which never brings a lock back: reaching the server after the compare-and-delete of the
        release, it finds nothing of ours and changes nothing; reaching it before, the release deletes
        the lock all the same. What it found is ignored (``mark_lost`` ignores a released lease
        anyway), so a release is never reported as a loss.
        """
        self._cancelled = True
        state = self._posted_to
        if state is not None and not self._ended:
            state.inbox.put(self)

    @property
    def running(self):
        """True while the lease is renewed: started in this process, and neither cancelled nor dropped."""
        scheduler = self._scheduler
        return (scheduler is not None and self._posted_to is scheduler._state
                and not (self._cancelled or self._ended))

    def _next_at(self):
        """The ``clock()`` time of the next extension, or of max_hold if sooner."""
        if self._hold_deadline is None:
            return self._due
        return min(self._due, self._hold_deadline)

    def _next_wait(self):
        return max(0.0, self._next_at() - self._clock())

    def _due_extension(self):
        """Return the lease if an extension is due now, else None; set ``_finished`` once renewal is over.

        Over when the lease is gone (released, lost, dropped), or at ``max_hold``, where it releases the lock.
        """
        lease = self._lease_ref()
        if lease is None or lease.released or lease.lost_reason is not None:
            self._finished = True
            return None
        if self._hold_deadline is not None and self._clock() >= self._hold_deadline:
            self._stop_at_max_hold(lease)
            self._finished = True
            return None
        if self._clock() < self._due - self._early:
            return None  # woken for max_hold, which is not here yet either
        if self._hold_deadline is not None and lease.remaining() >= self._hold_deadline - self._clock():
            # Valid until max_hold already (the extension before was cut to it): one more, sent so
            # close to it that it may arrive after the lock went, would only report the loss wrongly.
            self._due = self._hold_deadline
            return None
        return lease

    def _extension_ttl(self):
        """Return the ttl to extend to now (read just before the round is sent), or None once past ``max_hold``."""
        if self._hold_deadline is None:
            return self._ttl
        left = self._hold_deadline - self._clock()
        if left <= 0:
            return None  # max_hold came while the round was made up: stop there at the next turn, not extend
        # Never extend past max_hold: the server frees the lock then even if renewal stops.
        return min(self._ttl, max(left, 0.001))

    def _settle(self, lease, ttl, started, outcome):
        """Apply what the extension of ``lease`` sent at ``started`` came to: True, False (lost) or an exception."""
        if isinstance(outcome, BackendUnavailable):
            if lease.remaining() <= 0:
                lease.mark_lost(f"renewal could not reach the server before the lease ran out ({outcome})")
            else:
                logger.warning("Renewing lock %r failed, retrying: %s", lease.name, outcome)
        elif isinstance(outcome, BaseException):
            # Unexpected, so with its traceback; retried like an unreachable server, because the
            # lock may well still be ours until the lease's validity runs out, and not after.
            if lease.remaining() <= 0:
                lease.mark_lost(f"renewal failed until the lease ran out ({outcome!r})")
            else:
                logger.error("Renewing lock %r raised an unexpected error, retrying", lease.name, exc_info=outcome)
        else:
            lease._settle_extension(started, ttl, outcome)
            took = self._clock() - started
            if took > self._interval:
                logger.warning("Renewing lock %r took %.3fs, longer than the renewal interval %.3fs",
                               lease.name, took, self._interval)
        self._finished = lease.lost_reason is not None

    def _stop_at_max_hold(self, lease):
        try:
            lease.backend.release(lease)
        except BackendUnavailable as exc:
            logger.warning("Releasing lock %r at max_hold failed (%s); it expires on the server", lease.name, exc)
        except Exception:
            logger.error("Releasing lock %r at max_hold raised; it expires on the server", lease.name, exc_info=True)
        lease.mark_lost("max_hold reached: renewal stopped and the lock was released")

    def _fail_closed(self, exc):
        """Renewing raised past every handler: the holder's next check() must raise, not trust a lease nobody renews."""
        lease = self._lease_ref()
        if lease is not None and not self._cancelled:
            lease.mark_lost(f"its renewal stopped on an unexpected error ({exc!r})")


class _State:
    """One scheduler's mailbox, token and renewers; a forked child's scheduler starts with new ones."""

    def __init__(self):
        #: Renewers posted by their callers: by ``start()`` to be taken in, by ``stop()`` to be forgotten.
        self.inbox = mailbox()
        #: The token: one item while no loop serves, none while one does (see the module docstring).
        self.free = [True]
        #: The loop started last, until it withdraws (it stopped serving, or found another serving).
        self.launched = None
        #: The loop holding the token, for a forked child to end (under gevent it runs on there).
        self.serving = None
        # Owned by the loop that holds the token.
        self.heap = []  # (clock time, sequence, renewer)
        #: Every renewer taken in and not ended: in the heap, or taken out of it for its turn.
        self.renewers = set()
        #: The renewal clock of each interval: {interval: the time of one of its rounds} (``_round_after``).
        self.anchors = {}
        self.sequence = itertools.count()


class _Scheduler:
    """The renewers of one backend alias: a heap of their next deadlines, served by one daemon loop.

    Callers only ``post()``; the loop holding the state's token does everything else. The loop
    starts with the first renewer posted and ends when none is left.
    """

    #: Heap entries of stopped renewers allowed beyond twice the live ones before the heap is rebuilt
    #: (a released lease's entry otherwise stays until its deadline comes).
    COMPACT_SLACK = 1024

    def __init__(self, alias):
        self.alias = alias
        self._state = _State()
        _FORKED.add(self)

    def _end_in_forked_child(self):
        """Forget the parent's renewals: its leases are not this process's to extend, nor to mark lost."""
        state, self._state = self._state, _State()  # first: a parent's loop running on here finds itself stale
        for daemon in (state.serving, state.launched):
            if daemon is not None:
                daemon.end_in_child()

    # -- the callers' side: no lock, no wait ------------------------------------------------------

    def post(self, renewer):
        """Hand ``renewer`` to the loop, starting one if none serves or is starting."""
        state = self._state
        renewer._posted_to = state
        state.inbox.put(renewer)
        if state.free:
            launched = state.launched
            if launched is None or not launched.is_alive():
                self._launch(state)

    def _launch(self, state):
        ticket = []  # the loop's own Daemon, for it to know itself in ``launched``
        daemon = Daemon(self._run, state, ticket, name=f"distlock-renew:{self.alias}")
        ticket.append(daemon)
        state.launched = daemon
        daemon.start()

    # -- the loop ------------------------------------------------------------------------------

    def _run(self, state, ticket):
        """Serve ``state`` while this loop holds its token; end after a last look at the mailbox."""
        me = ticket[0]
        while state is self._state:
            try:
                state.free.pop()
            except IndexError:
                pass  # another loop serves: it looks at the mailbox before it gives the token up
            else:
                try:
                    state.serving = me
                    self._serve(state)
                finally:
                    state.serving = None
                    state.free.append(True)
            if state.launched is me:
                state.launched = None
            # A renewer posted before this look is ours to serve if the token is free; posted after,
            # its caller sees no loop launched (or one that will look again) and starts one.
            if not state.free or state.inbox.empty():
                return

    def _serve(self, state):
        """Take in the renewers posted and extend the due ones, until none is left and the mailbox is empty."""
        while state is self._state:
            try:
                if not self._turn(state):
                    return
            except BaseException as exc:
                if killed(exc):
                    raise  # the parent's loop, ended on purpose in a forked child
                # Every renewer of a round went back to the heap or ended (``_round``'s finally): carry on.
                logger.exception("The renewal scheduler of alias %r failed a round; it carries on", self.alias)

    def _turn(self, state):
        """Wait for the next deadline or a post, then serve what is due; return False once nothing is left."""
        wait = max(state.heap[0][0] - time.monotonic(), 0.0) if state.renewers and state.heap else 0.0
        self._take_posted(state, wait)
        if not state.renewers:
            state.heap.clear()
            return not state.inbox.empty()
        if len(state.heap) > 2 * len(state.renewers) + self.COMPACT_SLACK:
            self._compact(state)
        due = self._take_due(state)
        if due and state is self._state:
            self._round(state, due)
        return True

    def _compact(self, state):
        """Drop the heap entries of renewers stopped since they were pushed, which it keeps until they surface."""
        for _, _, renewer in state.heap:
            if renewer._cancelled or renewer._ended:
                self._end(state, renewer)
        state.heap = [entry for entry in state.heap if entry[2] in state.renewers]
        heapq.heapify(state.heap)

    def _take_posted(self, state, wait):
        """Take what callers posted, waiting up to ``wait`` seconds for the first."""
        try:
            renewer = state.inbox.get(timeout=wait) if wait > 0 else state.inbox.get(block=False)
            while True:
                self._take(state, renewer)
                renewer = state.inbox.get(block=False)
        except queue.Empty:
            pass

    def _take(self, state, renewer):
        """Take in a renewer posted by ``start()``; forget one posted by ``stop()``."""
        if renewer._cancelled:
            self._end(state, renewer)
        elif not renewer._ended and renewer not in state.renewers:
            renewer._due = self._round_after(state, renewer._interval, renewer._due - renewer._interval)
            heapq.heappush(state.heap, (renewer._next_at(), next(state.sequence), renewer))
            state.renewers.add(renewer)

    @staticmethod
    def _round_after(state, interval, moment):
        """Return the first round of the renewal clock of ``interval`` after ``moment``: at most ``interval`` later.

        Leases of one ttl are extended on one clock, a round every interval from the first such
        lease's first extension: however spread their acquisitions were, a round extends all of
        them in one call. A lease joins at the round after its acquisition, so its first extension
        comes sooner than ``interval`` after it, never later.
        """
        anchor = state.anchors.setdefault(interval, moment + interval)
        return anchor + math.floor((moment + interval - anchor) / interval) * interval

    def _take_due(self, state):
        """Pop the renewers whose deadline has come, and with them those due within their ``_early`` margin: the
        leases renewed together stay due together, so a round of many leases becomes one call. Drop the
        cancelled ones."""
        heap, due, now = state.heap, [], time.monotonic()
        if not heap or heap[0][0] > now:
            now = -math.inf  # nothing due yet: pop only the cancelled ones at the head
        while heap and (heap[0][0] <= now + heap[0][2]._early or heap[0][2]._cancelled or heap[0][2]._ended):
            _, _, renewer = heapq.heappop(heap)
            if renewer._cancelled or renewer._ended:
                self._end(state, renewer)
            else:
                due.append(renewer)
        return due

    def _round(self, state, due):
        """Extend the leases of the due renewers in one ``extend_many`` call (one round trip where the backend
        batches). A renewer cancelled before the call is left out, one cancelled during it is not
        settled (``Renewer.stop``)."""
        extending = []
        round_time = time.monotonic()
        try:
            leases = []
            for renewer in due:
                if not renewer._cancelled:
                    lease = self._guarded(renewer, renewer._due_extension)
                    if lease is not None:
                        leases.append((renewer, lease))
            # The ttls are read last (releases at max_hold above take time), with a last look at the flags.
            for renewer, lease in leases:
                ttl = None if renewer._cancelled else self._guarded(renewer, renewer._extension_ttl)
                if ttl is not None:
                    extending.append((renewer, lease, ttl))
            if extending:
                started = time.monotonic()
                backend = extending[0][1].backend
                try:
                    outcomes = backend.extend_many([(lease, ttl) for _, lease, ttl in extending])
                    if len(outcomes) != len(extending):
                        raise RuntimeError(f"{type(backend).__name__}.extend_many() returned {len(outcomes)} "
                                           f"outcomes for {len(extending)} leases")
                except Exception as exc:  # noqa: BLE001 - the same for every lease of the call
                    outcomes = [exc] * len(extending)
                for (renewer, lease, ttl), outcome in zip(extending, outcomes, strict=True):
                    if not renewer._cancelled:
                        self._guarded(renewer, renewer._settle, lease, ttl, started, outcome)
        finally:
            for renewer, _, _ in extending:
                renewer._due = self._round_after(state, renewer._interval, round_time)
            for renewer in due:
                if renewer._finished or renewer._cancelled:
                    self._end(state, renewer)
                else:
                    heapq.heappush(state.heap, (renewer._next_at(), next(state.sequence), renewer))

    @staticmethod
    def _guarded(renewer, step, *args):
        """Run one renewer's ``step``: what raises past its handlers marks that lease lost and ends its renewal
        only; the loop serves the others."""
        try:
            return step(*args)
        except BaseException as exc:
            if killed(exc):
                raise  # the parent's loop, ended on purpose in a forked child
            logger.exception("Renewing lock %r raised past its handlers; the lease is marked lost",
                             getattr(renewer._lease_ref(), "name", "?"))
            renewer._finished = True
            renewer._fail_closed(exc)
            return None

    @staticmethod
    def _end(state, renewer):
        """Drop ``renewer`` for good."""
        renewer._ended = True
        state.renewers.discard(renewer)

    def leases(self):
        """Return the leases renewed (one just started is listed once the loop has taken it in, at its next wake)."""
        # ``set.copy`` copies in one step that the loop's changes cannot interleave: no lock needed to read.
        renewers = self._state.renewers.copy()
        return [lease for lease in (renewer._lease_ref() for renewer in renewers if renewer.running)
                if lease is not None]


#: The scheduler of each backend that renews leases in this process.
_SCHEDULERS = weakref.WeakKeyDictionary()
_FORKED = ForkedChildHook("_end_in_forked_child")


def renewing(alias=None):
    """Return the leases this process renews right now (of ``alias``, or of every alias): for diagnostics."""
    while True:
        try:
            schedulers = [scheduler for scheduler in _SCHEDULERS.values() if alias in (None, scheduler.alias)]
            break
        except RuntimeError:  # a scheduler made by another thread meanwhile: look again
            continue
    return [lease for scheduler in schedulers for lease in scheduler.leases()]


def _scheduler_of(backend):
    """Return ``backend``'s scheduler, made on first use: callers making one at once keep the same (``setdefault``)."""
    scheduler = _SCHEDULERS.get(backend)
    if scheduler is None:
        scheduler = _SCHEDULERS.setdefault(backend, _Scheduler(backend.alias))
    return scheduler
