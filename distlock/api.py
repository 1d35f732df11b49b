"""The public entry points: ``acquire()``, ``lock()``, ``read_lock()`` and ``write_lock()``."""

import functools
import logging
import time

from distlock import metrics
from distlock.conf import DEFAULT_ALIAS
from distlock.exceptions import BackendUnavailable, LockNotAcquired
from distlock.handler import locks
from distlock.signals import lock_acquired, send_robustly
from distlock.validation import validate_alias, validate_flag, validate_name, validate_seconds

__all__ = ["acquire", "lock", "read_lock", "write_lock"]

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
    """
    name = validate_name(name)
    validate_alias(using)
    validate_seconds("ttl", ttl, allow_none=True)
    validate_seconds("timeout", timeout, allow_none=True, allow_zero=True)
    validate_seconds("max_hold", max_hold, allow_none=True)
    validate_flag("blocking", blocking)
    validate_flag("auto_renew", auto_renew, allow_none=True)
    backend = locks[using]
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

    started = time.monotonic()
    try:
        if mode is None:
            lease = backend.acquire(name, ttl=ttl, timeout=timeout, blocking=blocking, auto_renew=auto_renew,
                                    max_hold=max_hold)
        else:
            lease = backend.acquire_shared(name, mode, ttl=ttl, timeout=timeout, blocking=blocking,
                                           auto_renew=auto_renew, max_hold=max_hold)
    except LockNotAcquired:
        metrics.record_acquire(using, name, ttl, time.monotonic() - started, "timeout" if blocking else "busy")
        raise
    except BackendUnavailable:
        metrics.record_acquire(using, name, ttl, time.monotonic() - started, "unavailable")
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
        metrics.record_acquire(using, name, ttl, time.monotonic() - started, "acquired", lease)
        announced = True
        send_robustly(lock_acquired, "lock_acquired", sender=type(backend), alias=using, lease=lease)
        if lease.renewer is not None:
            lease.renewer.start()
    except BaseException:
        _give_back(lease, announced)
        raise
    return lease


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


class lock:  # noqa: N801 - used like a function: ``with lock(...)`` and ``@lock(...)``
    """Hold lock ``name`` for a ``with`` block or for each call of a decorated function.

    Takes the same arguments as ``acquire()``. ``with lock(...) as lease`` gives the ``Lease``; the
    lock is released when the block exits, whatever the outcome. As a decorator each call acquires
    its own lease.
    """

    _mode = None

    def __init__(self, name, ttl=None, timeout=None, blocking=True, using=DEFAULT_ALIAS, auto_renew=None,
                 max_hold=None):
        # Validate at construction too, so a bad decorator argument fails at import, not at the first call.
        name = validate_name(name)
        self._kwargs = dict(name=name, ttl=ttl, timeout=timeout, blocking=blocking, using=using,
                            auto_renew=auto_renew, max_hold=max_hold)
        if self._mode is not None:
            self._kwargs["mode"] = self._mode
        self._leases = []

    def __enter__(self):
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
        self._leases.pop().release()
        return False

    def __call__(self, func):
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


class read_lock(lock):  # noqa: N801
    """Like ``lock()``, shared: readers hold it together and wait only for earlier writers.

    Backends without the ``read_write`` capability raise ``NotSupported`` (a ``NotImplementedError``)
    naming themselves and the backends that have it.
    """

    _mode = "read"


class write_lock(lock):  # noqa: N801
    """Like ``lock()``, exclusive against readers and writers of the same read/write lock."""

    _mode = "write"
