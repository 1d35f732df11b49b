"""Distributed locks for Django with fencing tokens, on the backend named in ``settings.DISTLOCK``."""

from distlock.api import aacquire, acquire, alock, lock, lock_many, read_lock, write_lock
from distlock.exceptions import (
    BackendUnavailable,
    InvalidLockBackendError,
    LockError,
    LockLost,
    LockNotAcquired,
    LockOrderError,
    LockSuspended,
    LockWouldDeadlock,
    NotSupported,
    StaleFencingToken,
    TokenRegression,
    UnsafeFencingToken,
)
from distlock.handler import locks
from distlock.lease import Lease, LeaseSet

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailable",
    "InvalidLockBackendError",
    "Lease",
    "LeaseSet",
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
    "aacquire",
    "acquire",
    "alock",
    "lock",
    "lock_many",
    "locks",
    "read_lock",
    "write_lock",
]
