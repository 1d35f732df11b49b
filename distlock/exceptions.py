"""Exceptions raised by distlock; every one of them is a ``LockError`` except configuration errors."""

from django.core.exceptions import ImproperlyConfigured

from distlock.redaction import redact

__all__ = [
    "BackendUnavailable",
    "InvalidLockBackendError",
    "LockError",
    "LockLost",
    "LockNotAcquired",
    "LockOrderError",
    "LockSuspended",
    "LockWouldDeadlock",
    "NotSupported",
    "StaleFencingToken",
    "TokenRegression",
    "UnsafeFencingToken",
]


class LockError(Exception):
    """Base class of every runtime error distlock raises."""


class LockNotAcquired(LockError):
    """The lock is held by someone else: a non-blocking miss or a timeout."""


class LockLost(LockError):
    """The lease is no longer valid: it expired, a renewal failed, or its session died."""


class LockSuspended(LockError):
    """The connection to the lock service is interrupted; whether the lease still holds is unknown.

    Not a ``LockLost``: after the client reconnects, a lease whose lock still exists is valid again.
    Do not start writes while it is raised.
    """


class BackendUnavailable(LockError):
    """The lock server is down or unreachable; raised within the caller's timeout, never a hang.

    Its message is redacted: it quotes server errors and addresses, and is shown on the admin page,
    by ``distlock check`` and in logs.
    """

    def __init__(self, message=""):
        super().__init__(redact(message))


class TokenRegression(BackendUnavailable):
    """The alias's server issued a token (or showed a revision) below one it had shown this process.

    It went back: restored from a backup or snapshot, its data wiped, or its counter lost while its
    clock stood behind. Its tokens may repeat tokens already used, so the process refuses every
    grant on the alias and every fenced write with one of its leases until it restarts; raise the
    alias's ``TOKEN_EPOCH`` by one first (see ``distlock.backends.token_order``).
    """


class NotSupported(LockError, NotImplementedError):
    """The alias's backend does not offer this kind of lock or operation; the message names those that do."""


class LockWouldDeadlock(LockError):
    """Acquiring would wait for the caller itself (its open SQLite transaction may hold the only write slot)."""


class LockOrderError(LockError):
    """Acquiring would take a coarser lock while this thread or task holds a finer one (``DISTLOCK_HIERARCHY``).

    Raised before any I/O; ``name`` is the lock asked for, ``held`` the finer one already held.
    """

    def __init__(self, message, *, name=None, held=None):
        self.name = name
        self.held = held
        super().__init__(message)


class StaleFencingToken(LockError):
    """A write carried a fencing token lower than one the row has already accepted.

    Two holders acted at once: the store refused the older one. Nothing was written.
    """

    def __init__(self, message=None, *, model=None, pk=None, offered_token=None, current_token=None, lock_name=None):
        self.model = model
        self.pk = pk
        self.offered_token = offered_token
        self.current_token = current_token
        self.lock_name = lock_name
        if message is None:
            label = model._meta.label if model is not None else "row"
            message = (
                f"{label} pk={pk!r}: fencing token {offered_token} is older than the stored token "
                f"{current_token}; another holder of lock {lock_name!r} has written since. Nothing was written. (If "
                f"every write is refused, run `manage.py distlock check`: an alias pointed at another backend "
                f"issues tokens below the stored ones until its TOKEN_EPOCH is raised.)"
            )
        super().__init__(message)


class UnsafeFencingToken(LockError):
    """The lease's backend cannot issue safe fencing tokens (Redlock), and the model did not opt in."""


class InvalidLockBackendError(ImproperlyConfigured):
    """An unknown alias or an unusable ``DISTLOCK`` entry (like Django's ``InvalidCacheBackendError``)."""
