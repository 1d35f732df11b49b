"""In-process locks, for unit tests and single-process development: they exclude nobody in another process."""

import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from distlock.backends.base import NOTIFICATIONS, SAFE_FENCING_TOKENS, BaseLockBackend, Grant, page_of
from distlock.holder import Holder, current_holder
from distlock.waiting import Wakeups

__all__ = ["LocMemBackend"]

# Like Django's locmem cache: one store per alias, shared by every backend instance of that alias in
# this process, so a backend rebuilt after a settings change still sees the locks and the token.
_stores = {}
_stores_lock = threading.Lock()


@dataclass
class _Record:
    owner: str
    token: int
    expires: float  # time.monotonic()
    acquired_at: datetime
    #: The holder's host, pid and task id, for ``lock_info``.
    holder: Holder


class _Store:
    def __init__(self):
        self.locks = {}
        self.last_token = 0
        #: A plain C lock, never a Condition: see ``distlock.waiting``.
        self.lock = threading.Lock()
        self.releases = 0  # counts releases, for waiters to see one happened
        self.released = Wakeups()


class LocMemBackend(BaseLockBackend):
    """Locks in a dict of this process; tokens from a per-alias counter that only grows.

    Each token is also at least the machine's clock in microseconds (as on SQLite), so tokens keep
    growing across a restart of the process, or from one test process to the next: fenced rows in a
    shared database then refuse an older process's holders, not every holder of a newer process.
    """

    label = "locmem"
    capabilities = frozenset({SAFE_FENCING_TOKENS, NOTIFICATIONS})

    def __init__(self, alias, options):
        super().__init__(alias, options)
        with _stores_lock:
            self._store = _stores.setdefault(alias, _Store())

    def _live(self, name, now):
        record = self._store.locks.get(name)
        if record is not None and record.expires <= now:
            del self._store.locks[name]
            return None
        return record

    def _try_acquire(self, attempt):
        name, owner, ttl = attempt.name, attempt.owner, attempt.ttl
        store = self._store
        with store.lock:
            now = time.monotonic()
            if self._live(name, now) is not None:
                return None
            store.last_token = max(store.last_token + 1, time.time_ns() // 1000)
            store.locks[name] = _Record(owner, store.last_token, now + ttl, datetime.now(timezone.utc),
                                        current_holder())
            return Grant(token=store.last_token)

    def _wait_for_release(self, attempt, remaining):
        store = self._store
        with store.lock:
            record = self._live(attempt.name, time.monotonic())
            if record is None:
                return
            # Wake at the holder's expiry at the latest: nobody notifies when a ttl runs out.
            wait = record.expires - time.monotonic()
            releases = store.releases
        wait = wait if remaining is None else min(wait, remaining)
        store.released.wait_for(lambda: store.releases != releases, wait)

    def _do_extend(self, lease, ttl):
        with self._store.lock:
            record = self._live(lease.name, time.monotonic())
            if record is None or record.owner != lease.owner:
                return False
            record.expires = time.monotonic() + ttl
            return True

    def held_locks(self, prefix="", *, limit=None, cursor=None):
        with self._store.lock:
            now, wall_now = time.monotonic(), datetime.now(timezone.utc)
            return page_of([
                self.lock_info(name, vars(r.holder), owner=r.owner, token=r.token, acquired_at=r.acquired_at,
                               expires_at=wall_now + timedelta(seconds=r.expires - now))
                for name, r in list(self._store.locks.items())
                if name.startswith(prefix) and self._live(name, now) is not None
            ], limit, cursor)

    def release_owned(self, name, owner):
        store = self._store
        with store.lock:
            record = self._live(name, time.monotonic())
            if record is None or record.owner != owner:
                return False
            del store.locks[name]
            store.releases += 1
        store.released.notify_all()
        return True

    def ping(self):
        return None
