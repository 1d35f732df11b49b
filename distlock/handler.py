"""``locks``: alias -> backend, built lazily from ``settings.DISTLOCK`` like ``django.core.cache.caches``."""

import os
import threading

from django.utils.module_loading import import_string

from distlock.backends.green import ForkedChildHook
from distlock.conf import get_config
from distlock.exceptions import InvalidLockBackendError

__all__ = ["LockHandler", "locks"]


#: Every handler: a forked child drops the parent's backends.
_HANDLERS = ForkedChildHook("_forget_after_fork")


class LockHandler:
    """Build one backend per alias per process, on first use, thread-safely.

    Unlike Django's cache handler this is process-wide, not per thread: backends own connection
    pools and ZooKeeper/etcd sessions that every thread should share. After a fork (Celery prefork,
    gunicorn) the child gets fresh backends; the parent's are dropped without closing, because
    closing would shut sockets the parent still uses.
    """

    def __init__(self):
        self._forget_after_fork()
        _HANDLERS.add(self)

    def __getitem__(self, alias):
        if self._pid != os.getpid():
            self._forget_after_fork()
        try:
            return self._backends[alias]
        except KeyError:
            pass
        with self._lock:
            if alias not in self._backends:
                self._backends[alias] = self.create_backend(alias)
            return self._backends[alias]

    def built(self, alias):
        """Return the backend of ``alias`` if this process has built it already, else None (nothing is built)."""
        if self._pid != os.getpid():
            return None
        return self._backends.get(alias)

    def __setitem__(self, alias, backend):
        self._backends[alias] = backend

    def __delitem__(self, alias):
        self._backends.pop(alias, None)

    def __contains__(self, alias):
        return alias in get_config()

    def __iter__(self):
        return iter(get_config())

    def _forget_after_fork(self):
        # Never takes the old lock: a thread of the parent that held it (building a backend) during
        # fork() does not exist in the child, so the child would wait for it forever.
        self._backends = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def create_backend(self, alias):
        config = get_config()
        if not isinstance(config, dict) or alias not in config:
            raise InvalidLockBackendError(
                f"The lock backend alias '{alias}' doesn't exist; add it to settings.DISTLOCK "
                f"(configured: {', '.join(map(repr, config)) if isinstance(config, dict) else 'none'})."
            )
        entry = config[alias]
        if not isinstance(entry, dict) or "BACKEND" not in entry:
            raise InvalidLockBackendError(f"DISTLOCK['{alias}'] must be a dict with a 'BACKEND' dotted path.")
        try:
            backend_cls = import_string(entry["BACKEND"])
        except ImportError as exc:
            raise InvalidLockBackendError(f"Could not find lock backend '{entry['BACKEND']}': {exc}") from exc
        return backend_cls(alias, entry.get("OPTIONS", {}))

    def all(self, initialized_only=False):
        """Return the backends of every alias (only those already built, if ``initialized_only``)."""
        if initialized_only:
            return list(self._backends.values())
        return [self[alias] for alias in get_config()]

    def close_all(self):
        """Close every built backend and forget it (on setting changes and at test teardown)."""
        with self._lock:
            backends, self._backends = self._backends, {}
        if self._pid == os.getpid():
            for backend in backends.values():
                backend.close()


locks = LockHandler()
