"""The public entry points: ``acquire()``, ``lock()``, ``lock_many()``, ``read_lock()``, ``write_lock()``, and for
asyncio ``aacquire()`` and ``alock()``."""

import asyncio
import contextlib
import functools
import inspect
import logging
import time

from distlock import hierarchy, metrics, reentrancy
from distlock.backends import offload
from distlock.conf import DEFAULT_ALIAS
from distlock.exceptions import BackendUnavailable, LockNotAcquired
from distlock.handler import locks
from distlock.lease import LeaseSet
from distlock.signals import lock_acquired, send_robustly
from distlock.validation import validate_alias, validate_flag, validate_name, validate_seconds

__all__ = ["aacquire", "acquire", "alock", "lock", "lock_many", "read_lock", "write_lock"]

logger = logging.getLogger(__name__)


def acquire(name, ttl=None, timeout=None, blocking=True, using=DEFAULT_ALIAS, auto_renew=None, max_hold=None,
            *, mode=None):
    """Acquire lock ``name`` and return its ``Lease``.

    :param ttl: seconds the lease stays valid unless renewed (default: the alias's ``DEFAULT_TTL``, 30).
    :param timeout: seconds to wait for a held lock; None (the default) waits without limit.
    :param blocking: False (or ``timeout=0``) tries once and ignores ``timeout``.
    :param using: the ``DISTLOCK`` alias.
    :param auto_renew: keep extending the lease every ttl/3 while held (default: ``OPTIONS["AUTO_RENEW"]``).
    :param max_hold: seconds after which renewal stops and the lock is released and marked lost
        (default: ``OPTIONS["MAX_HOLD"]``); without auto-renewal it caps the ttl.
    :raises LockNotAcquired: the lock is held (non-blocking) or stayed held past ``timeout``.
    :raises BackendUnavailable: the server did not answer within the timeout.
    :raises LockOrderError: ``DISTLOCK_HIERARCHY`` ranks ``name`` coarser than a lock the caller holds.

    There is no ``reentrant`` argument here (``lock(..., reentrant=True)`` has it): each call goes to the server.
    """
    name, ranked, backend, options = _prepare(name, ttl, timeout, blocking, using, auto_renew, max_hold)
    started = time.monotonic()
    try:
        if mode is None:
            lease = backend.acquire(name, **options)
        else:
            lease = backend.acquire_shared(name, mode, **options)
    except (LockNotAcquired, BackendUnavailable) as exc:
        _record_failure(using, name, options, started, exc)
        raise
    # The lock is ours on the server from here. Nothing below may leak it: whatever raises, including
    # a BaseException that arrives between any two lines (Celery's SoftTimeLimitExceeded from a signal
    # handler, gevent.Timeout, KeyboardInterrupt), gives the grant back before it propagates. Renewal
    # starts last, so a lease that never reaches its caller has never been renewed.
    #
    # What is left, each a few bytecodes wide (CPython runs signal handlers where a call returns or a
    # function starts, not between the assignment below and the ``try``): (1) inside the backend call,
    # between the server's grant and its return (the backend's own cleanup covers what it can); (2) as
    # the backend call returns, before ``lease`` is assigned; (3) in the caller, as this function
    # returns, before the caller stores the lease (``lock()`` below stores it at once); (4) a second
    # exception landing inside ``_give_back`` before it cancelled the renewal or deleted the lock. In
    # (1) to (3) either no renewer runs, or the lease is referenced by no frame and its renewer, which
    # holds it weakly, ends at its next wake-up; in (4) the renewal is cancelled first. Either way
    # nothing renews the lock and the server frees it at its ttl, or with the session.
    announced = False
    try:
        metrics.record_acquire(using, name, options["ttl"], time.monotonic() - started, "acquired", lease)
        announced = True
        send_robustly(lock_acquired, "lock_acquired", sender=type(backend), alias=using, lease=lease)
        if lease.renewer is not None:
            lease.renewer.start()
        if ranked:
            hierarchy.hold(lease, ranked)
    except BaseException:
        _give_back(lease, announced)
        raise
    return lease


def _prepare(name, ttl, timeout, blocking, using, auto_renew, max_hold):
    """Check the arguments of an acquisition before any I/O; return the name, the hierarchy, the backend and
    the backend's keyword arguments, defaults filled in."""
    name, ranked = _check(name, ttl, timeout, blocking, using, auto_renew, max_hold)
    backend = locks[using]
    return name, ranked, backend, _backend_options(backend, ttl, timeout, blocking, auto_renew, max_hold)


def _check(name, ttl, timeout, blocking, using, auto_renew, max_hold):
    """Check the arguments of an acquisition and ``DISTLOCK_HIERARCHY``; return the name and the hierarchy."""
    name = validate_name(name)
    _validate_options(ttl, timeout, blocking, using, auto_renew, max_hold)
    ranked = hierarchy.prefixes()
    if ranked:
        hierarchy.check_order((name,), ranked)
    return name, ranked


def _backend_options(backend, ttl, timeout, blocking, auto_renew, max_hold):
    """Return the keyword arguments of ``backend.acquire()``: the alias's defaults filled in."""
    settings = backend.settings
    ttl = settings["DEFAULT_TTL"] if ttl is None else ttl
    auto_renew = settings["AUTO_RENEW"] if auto_renew is None else auto_renew
    max_hold = settings["MAX_HOLD"] if max_hold is None else max_hold
    if max_hold is not None and not auto_renew:
        ttl = min(ttl, max_hold)
    if timeout == 0:
        blocking = False
    if not blocking:
        timeout = 0
    return dict(ttl=ttl, timeout=timeout, blocking=blocking, auto_renew=auto_renew, max_hold=max_hold)


def _record_failure(using, name, options, started, exc):
    outcome = ("unavailable" if isinstance(exc, BackendUnavailable)
               else "timeout" if options["blocking"] else "busy")
    metrics.record_acquire(using, name, options["ttl"], time.monotonic() - started, outcome)


def _validate_options(ttl, timeout, blocking, using, auto_renew, max_hold):
    validate_alias(using)
    validate_seconds("ttl", ttl, allow_none=True)
    validate_seconds("timeout", timeout, allow_none=True, allow_zero=True)
    validate_seconds("max_hold", max_hold, allow_none=True)
    validate_flag("blocking", blocking)
    validate_flag("auto_renew", auto_renew, allow_none=True)


def _give_back(lease, announced):
    """Release ``lease``, which its caller will never use, for an exception on its way to that caller.

    Its renewal is cancelled first (one flag, nothing that can block), then the lock is deleted. An
    error while giving back is logged, not raised: the exception the caller sees is the original one.
    """
    renewer = lease.renewer
    if renewer is not None:
        renewer.cancel()
    try:
        lease._end(announce=announced)
    except BaseException:
        logger.exception(
            "Could not give back lock %r (alias %r, token %s), acquired by a call that failed; "
            "nothing renews it, so the server frees it when its ttl or session ends.",
            lease.name, lease.alias, lease.token)


async def aacquire(name, ttl=None, timeout=None, blocking=True, using=DEFAULT_ALIAS, auto_renew=None, max_hold=None,
                   *, mode=None):
    """Acquire lock ``name`` from a coroutine and return its ``Lease``: ``lease = await distlock.aacquire(...)``.

    The arguments, defaults and exceptions of ``acquire()``. Each server call runs on a worker thread
    and each wait between tries is the event loop's: a waiting coroutine blocks neither the loop nor
    a thread (see "asyncio" in the README). Cancelled (``asyncio.CancelledError``, a timeout around
    it, a client that disconnected), it leaves nothing held on the server: a try in flight runs to
    its end and what it was granted is released, and the attempt's place in a server-side queue is
    withdrawn, before the ``CancelledError`` propagates.
    """
    name, ranked = _check(name, ttl, timeout, blocking, using, auto_renew, max_hold)
    backend = locks.built(using)
    if backend is None:  # built once per process: an import, maybe a connection; not on the loop
        backend = await offload.finish(offload.submit(locks.__getitem__, using))
    options = _backend_options(backend, ttl, timeout, blocking, auto_renew, max_hold)
    started = time.monotonic()
    try:
        if mode is None:
            lease = await backend.aacquire(name, **options)
        else:
            lease = await backend.aacquire_shared(name, mode, **options)
    except (LockNotAcquired, BackendUnavailable) as exc:
        _record_failure(using, name, options, started, exc)
        raise
    # As in ``acquire()``, nothing below may leak the lock. The ``lock_acquired`` receivers may use
    # the ORM, which Django refuses on an event loop: they run on a worker thread too.
    announcing = offload.submit(_announce, backend, using, name, options["ttl"], started, lease)
    try:
        await asyncio.wrap_future(announcing)
        if lease.renewer is not None:
            lease.renewer.start()
        if ranked:
            hierarchy.hold(lease, ranked)
    except BaseException as exc:
        giving_back = offload.submit(_give_back_announced, lease, announcing)
        if not isinstance(exc, GeneratorExit):  # a closed coroutine may not await: the give-back runs alone
            await offload.finish(giving_back)
        raise
    return lease


def _announce(backend, using, name, ttl, started, lease):
    """Worker: record and signal the acquisition of ``lease`` (``acquire()`` does the same inline)."""
    metrics.record_acquire(using, name, ttl, time.monotonic() - started, "acquired", lease)
    send_robustly(lock_acquired, "lock_acquired", sender=type(backend), alias=using, lease=lease)


def _give_back_announced(lease, announcing):
    """Worker: give back ``lease`` once ``announcing`` (its ``_announce``, maybe never started) has ended."""
    announced = not announcing.cancelled() and announcing.exception() is None
    _give_back(lease, announced)


class lock:  # noqa: N801 - used like a function: ``with lock(...)`` and ``@lock(...)``
    """Hold lock ``name`` for a ``with`` block or for each call of a decorated function.

    Takes the same arguments as ``acquire()``. ``with lock(...) as lease`` gives the ``Lease``; the
    lock is released when the block exits, whatever the outcome. As a decorator each call acquires
    its own lease.

    :param reentrant: True lets the thread, asyncio task or greenlet (and Celery task run) that holds
        the lock through a ``reentrant=True`` block enter it again without a server round trip: the
        inner block gets the same ``Lease`` (same token, the outer block's ``ttl``, ``auto_renew`` and
        ``max_hold``), and the lock is released when the outermost block exits. A lost, expired or
        released lease is not re-entered (``LockLost``). Another thread or task, a task started by
        the holder included, and a plain ``lock()`` or ``acquire()`` of the name, wait for the
        server as without reentrancy. See ``distlock.reentrancy`` for the details. Not for
        ``read_lock()`` and ``write_lock()``; ``acquire()`` has no such argument, as the ``Lease``
        it returns ends the lock with one ``release()``, whoever else is using it.
    """

    _mode = None

    def __init__(self, name, ttl=None, timeout=None, blocking=True, using=DEFAULT_ALIAS, auto_renew=None,
                 max_hold=None, *, reentrant=False):
        # Validate at construction too, so a bad decorator argument fails at import, not at the first call.
        name = validate_name(name)
        self._reentrant = validate_flag("reentrant", reentrant)
        if reentrant and self._mode is not None:
            raise TypeError(f"{type(self).__name__}() cannot be reentrant: reentrant=True is for lock() only.")
        self._kwargs = dict(name=name, ttl=ttl, timeout=timeout, blocking=blocking, using=using,
                            auto_renew=auto_renew, max_hold=max_hold)
        if self._mode is not None:
            self._kwargs["mode"] = self._mode
        #: The leases of the blocks in progress; with ``reentrant``, ``[lease]`` per block, in any order.
        self._leases = []

    def __enter__(self):
        if self._reentrant:
            return self._enter_reentrant()
        lease = acquire(**self._kwargs)
        try:
            self._leases.append(lease)
        except BaseException:
            # Interrupted before the ``with`` block began: ``__exit__`` will not run, so release here.
            if self._leases and self._leases[-1] is lease:
                self._leases.pop()
            _give_back(lease, announced=True)
            raise
        return lease

    def __exit__(self, exc_type, exc, tb):
        if self._reentrant:
            self._exit_reentrant()
            return False
        self._leases.pop().release()
        return False

    def __call__(self, func):
        if self._reentrant:
            return self._decorate_reentrant(func)

        @functools.wraps(func)
        def locked(*args, **kwargs):
            # Not ``with acquire(...)``: an exception landing as ``Lease.__enter__`` starts would skip
            # ``__exit__`` while that frame, kept by the traceback, keeps the lease (and its renewal) alive.
            lease = acquire(**self._kwargs)
            try:
                return func(*args, **kwargs)
            finally:
                lease.release()

        return locked

    # -- reentrant=True ------------------------------------------------------------------------
    # One lock object may serve several threads and tasks at once (a module-level ``lock(...)``, a
    # decorator): each block finds its lease in its own context's record, never by position in
    # ``self._leases``, where each block keeps only a strong reference (the record holds leases weakly).
    # Each step that changes the record is one ``ContextVar.set``; see ``distlock.reentrancy``.

    def _enter_reentrant(self):
        lease = _enter_reentrant(self._kwargs)
        hold = [lease]  # built without a call, so no exception lands between the line above and the ``try``
        try:
            self._leases.append(hold)
        except BaseException:
            # Interrupted before the ``with`` block began: ``__exit__`` will not run, so end the block here.
            if any(kept is hold for kept in tuple(self._leases)):
                self._leases.remove(hold)
            _exit_reentrant(reentrancy.held(self._kwargs["using"], self._kwargs["name"]))
            raise
        return lease

    def _exit_reentrant(self):
        found = reentrancy.held(self._kwargs["using"], self._kwargs["name"])
        try:
            _exit_reentrant(found)
        finally:
            # After the record changed: an interrupt in between leaves a strong reference too many
            # (to a lease the record no longer counts, or still counts at the right depth), never one
            # too few, which could let the lease be collected, unreleased, while its blocks run.
            # Every block's hold of one lease is ``[lease]``: removing any one of them is right.
            if found is not None:
                with contextlib.suppress(ValueError):
                    self._leases.remove([found[0]])

    def _decorate_reentrant(self, func):
        @functools.wraps(func)
        def reentered(*args, **kwargs):
            lease = _enter_reentrant(self._kwargs)  # noqa: F841 - this frame's strong reference to it
            try:
                return func(*args, **kwargs)
            finally:
                _exit_reentrant(reentrancy.held(self._kwargs["using"], self._kwargs["name"]))

        return reentered


def _enter_reentrant(kwargs):
    """Re-enter the caller's reentrant hold of the lock (no I/O), or acquire it and hold it at depth 1."""
    found = reentrancy.held(kwargs["using"], kwargs["name"])
    before = reentrancy.snapshot()
    if found is not None:
        try:
            return reentrancy.enter_again(*found)
        except BaseException:
            reentrancy.restore(before)  # an interrupt landing after the depth went up takes it back down
            raise
    lease = acquire(**kwargs)
    try:
        reentrancy.hold(lease)
    except BaseException:
        reentrancy.restore(before)
        _give_back(lease, announced=True)
        raise
    return lease


def _exit_reentrant(found):
    """End one reentrant block of the hold ``found``: one fewer, or for the outermost, release and forget it.

    The outermost block releases before it forgets: ``release()`` marks the lease released before any
    I/O, so an interrupt in between leaves an entry that is never re-entered, never a "held" one.
    """
    if found is None:  # the record was already restored by an interrupted enter
        return
    lease, entry = found
    if entry.depth > 1:
        reentrancy.leave(lease, entry)
        return
    try:
        lease.release()
    finally:
        reentrancy.forget(lease)


class alock:  # noqa: N801 - used like a function: ``async with alock(...)`` and ``@alock(...)``
    """Hold lock ``name`` for an ``async with`` block or for each call of a decorated ``async def``.

    .. code-block:: python

        async with distlock.alock("report:42", ttl=30, timeout=10) as lease:
            ...  # await lease.acheck() before each write the lock protects

        @distlock.alock("nightly-import", timeout=0)
        async def nightly_import(): ...

    The arguments, defaults and exceptions of ``lock()``, ``reentrant`` included (the runner that
    re-enters is the asyncio task); it acquires with ``aacquire()`` and releases with
    ``Lease.arelease()``, whatever the outcome of the block, a cancellation included. One ``alock``
    object may serve many tasks at once (a module-level one, a decorator): each task's blocks find
    their own leases.
    """

    def __init__(self, name, ttl=None, timeout=None, blocking=True, using=DEFAULT_ALIAS, auto_renew=None,
                 max_hold=None, *, reentrant=False):
        # Validate at construction too, so a bad decorator argument fails at import, not at the first call.
        name = validate_name(name)
        self._reentrant = validate_flag("reentrant", reentrant)
        self._kwargs = dict(name=name, ttl=ttl, timeout=timeout, blocking=blocking, using=using,
                            auto_renew=auto_renew, max_hold=max_hold)
        #: The leases of the blocks in progress, per task, innermost last.
        self._leases = {}

    async def __aenter__(self):
        if self._reentrant:
            lease = await _aenter_reentrant(self._kwargs)
        else:
            lease = await aacquire(**self._kwargs)
        # No await from here on: a cancellation cannot land before the block owns the lease.
        self._leases.setdefault(asyncio.current_task(), []).append(lease)
        return lease

    async def __aexit__(self, exc_type, exc, tb):
        task = asyncio.current_task()
        held = self._leases[task]
        lease = held.pop()
        if not held:
            del self._leases[task]
        if self._reentrant:
            await _aexit_reentrant(reentrancy.held(self._kwargs["using"], self._kwargs["name"]))
        else:
            await lease.arelease()
        return False

    def __call__(self, func):
        if not inspect.iscoroutinefunction(func):
            raise TypeError(f"alock() decorates an async def, not {func!r}; for a plain function use lock().")
        kwargs, reentrant = self._kwargs, self._reentrant

        @functools.wraps(func)
        async def locked(*args, **func_kwargs):
            if reentrant:
                lease = await _aenter_reentrant(kwargs)  # noqa: F841 - this frame's strong reference to it
                try:
                    return await func(*args, **func_kwargs)
                finally:
                    await _aexit_reentrant(reentrancy.held(kwargs["using"], kwargs["name"]))
            lease = await aacquire(**kwargs)
            try:
                return await func(*args, **func_kwargs)
            finally:
                await lease.arelease()

        return locked


async def _aenter_reentrant(kwargs):
    """``_enter_reentrant`` for a task: re-enter its reentrant hold (no I/O), or acquire and hold at depth 1."""
    found = reentrancy.held(kwargs["using"], kwargs["name"])
    if found is not None:
        before = reentrancy.snapshot()
        try:
            return reentrancy.enter_again(*found)
        except BaseException:
            reentrancy.restore(before)
            raise
    lease = await aacquire(**kwargs)
    before = reentrancy.snapshot()
    try:
        reentrancy.hold(lease)
    except BaseException as exc:
        reentrancy.restore(before)
        giving_back = offload.submit(_give_back, lease, True)
        if not isinstance(exc, GeneratorExit):
            await offload.finish(giving_back)
        raise
    return lease


async def _aexit_reentrant(found):
    """``_exit_reentrant`` for a task: one block fewer, or for the outermost, release then forget the lease."""
    if found is None:
        return
    lease, entry = found
    if entry.depth > 1:
        reentrancy.leave(lease, entry)
        return
    try:
        await lease.arelease()
    finally:
        reentrancy.forget(lease)


class read_lock(lock):  # noqa: N801
    """Like ``lock()``, shared: readers hold it together and wait only for earlier writers.

    Backends without the ``read_write`` capability raise ``NotSupported`` (a ``NotImplementedError``)
    naming themselves and the backends that have it.
    """

    _mode = "read"


class write_lock(lock):  # noqa: N801
    """Like ``lock()``, exclusive against readers and writers of the same read/write lock."""

    _mode = "write"


class lock_many:  # noqa: N801 - used like a function: ``with lock_many(...)`` and ``@lock_many(...)``
    """Hold every lock of ``names`` for a ``with`` block or for each call of a decorated function.

    .. code-block:: python

        with distlock.lock_many([f"account:{source}", f"account:{target}"], ttl=10, timeout=5) as leases:
            ...  # leases.token_for("account:7"), Account.objects.claim(leases, pk=7)

    ``with lock_many(...) as leases`` gives a ``LeaseSet``. The distinct names are taken one at a time
    in one canonical order whatever the order given: sorted, and with ``DISTLOCK_HIERARCHY`` coarse
    levels first, then sorted within a level. So two callers wanting overlapping sets never each hold
    a lock the other waits for. A name given twice (in any Unicode spelling) is one lock.

    All or nothing, within one ``timeout`` for the whole set: each acquisition waits for what is left
    of it (with nothing left, it still tries once). If one fails, or any exception arrives while they
    are taken (``KeyboardInterrupt``, a Celery time limit), the leases already taken are released, last
    first, and the exception is raised: ``LockNotAcquired`` on a timeout or a busy lock,
    ``BackendUnavailable``, ``LockOrderError``... as ``acquire()`` raises them. A lease whose ttl ran
    out while the others were awaited fails the set too (``LockNotAcquired``): use a ttl longer than
    the timeout, or ``auto_renew``. Each lease the interrupted cleanup cannot release has its renewal
    cancelled first and is freed by the server at its ttl, as ``acquire()`` does with a grant it
    cannot hand out.

    The other arguments are ``acquire()``'s, applied to every lock of the set, on one alias.
    """

    def __init__(self, names, *, ttl=None, timeout=None, blocking=True, using=DEFAULT_ALIAS, auto_renew=None,
                 max_hold=None):
        self._names = _distinct_names(names)
        _validate_options(ttl, timeout, blocking, using, auto_renew, max_hold)
        self._kwargs = dict(ttl=ttl, timeout=timeout, blocking=blocking, using=using, auto_renew=auto_renew,
                            max_hold=max_hold)
        self._sets = []

    def __repr__(self):
        return f"<lock_many {list(self._names)!r} alias={self._kwargs['using']!r}>"

    def __enter__(self):
        leases = _acquire_many(self._names, **self._kwargs)
        try:
            self._sets.append(leases)
        except BaseException:
            # Interrupted before the ``with`` block began: ``__exit__`` will not run, so release here.
            if self._sets and self._sets[-1] is leases:
                self._sets.pop()
            _give_back_all(leases.leases)
            raise
        return leases

    def __exit__(self, exc_type, exc, tb):
        self._sets.pop().release()
        return False

    def __call__(self, func):
        @functools.wraps(func)
        def locked(*args, **kwargs):
            leases = _acquire_many(self._names, **self._kwargs)
            try:
                return func(*args, **kwargs)
            finally:
                leases.release()

        return locked


def _distinct_names(names):
    """Return the distinct lock names of ``names`` (validated, NFC), in the order given."""
    if isinstance(names, (str, bytes)) or not hasattr(names, "__iter__"):
        raise TypeError(f"lock_many() takes an iterable of lock names (e.g. a list), got {type(names).__name__} "
                        f"{names!r}; for one lock use lock().")
    distinct = tuple(dict.fromkeys(validate_name(name) for name in names))
    if not distinct:
        raise ValueError("lock_many() needs at least one lock name.")
    return distinct


def _acquire_many(names, *, ttl, timeout, blocking, using, auto_renew, max_hold):
    """Acquire the validated, distinct ``names`` in canonical order, all or nothing; return their ``LeaseSet``."""
    ranked = hierarchy.prefixes()
    ordered = sorted(names, key=hierarchy.order_key(ranked)) if ranked else sorted(names)
    if ranked:
        hierarchy.check_order(ordered, ranked)  # every name before any I/O
    if timeout == 0:
        blocking = False
    deadline = None if timeout is None or not blocking else time.monotonic() + timeout
    taken = []
    # From the first grant on, every exit but the return releases what was taken: an exception from
    # acquire(), or any BaseException landing between two acquisitions. A lease on its way out of
    # acquire() when one lands is not in ``taken`` yet: that is acquire()'s own window (3), and the
    # same rule covers it: nothing renews it, the server frees it at its ttl.
    try:
        for name in ordered:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            taken.append(acquire(name, ttl=ttl, timeout=remaining, blocking=blocking, using=using,
                                 auto_renew=auto_renew, max_hold=max_hold))
        expired = next((lease for lease in taken if lease.lost), None)
        if expired is not None:
            raise LockNotAcquired(
                f"Locks {ordered!r} on alias '{using}' not acquired: lock {expired.name!r} ran out of its ttl of "
                f"{expired.ttl:g}s while the others were awaited; use a ttl longer than the timeout, or auto_renew=True."
            )
        leases = LeaseSet(taken)
    except BaseException:
        _give_back_all(taken)
        raise
    return leases


def _give_back_all(taken):
    """Release the leases ``taken`` by a ``lock_many()`` that fails, last first; log, never raise, errors.

    Every renewal is cancelled before the first release, so if another exception cuts the releases
    short, the leases left are renewed no more and the server frees them at their ttl.
    """
    for lease in taken:
        if lease.renewer is not None:
            lease.renewer.cancel()
    for lease in reversed(taken):
        _give_back(lease, announced=True)
