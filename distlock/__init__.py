"""Distributed locks for Django with fencing tokens, on the backend named in ``settings.DISTLOCK``."""

from distlock.api import acquire, lock, read_lock, write_lock
from distlock.exceptions import (
    BackendUnavailable,
    InvalidLockBackendError,
    LockError,
    LockLost,
    LockNotAcquired,
    LockSuspended,
    LockWouldDeadlock,
    NotSupported,
    StaleFencingToken,
    TokenRegression,
    UnsafeFencingToken,
)
from distlock.handler import locks
from distlock.lease import Lease

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailable",
    "InvalidLockBackendError",
    "Lease",
    "LockError",
    "LockLost",
    "LockNotAcquired",
    "LockSuspended",
    "LockWouldDeadlock",
    "NotSupported",
    "StaleFencingToken",
    "TokenRegression",
    "UnsafeFencingToken",
    "acquire",
    "lock",
    "locks",
    "read_lock",
    "write_lock",
]
