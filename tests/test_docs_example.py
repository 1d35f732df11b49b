"""The worked example of docs/ARCHITECTURE.md, run as written: a new backend needs only its hooks."""

import re
import sys
import threading
import time
import types
from pathlib import Path

import pytest
from django.core.checks import run_checks

import distlock
from distlock.handler import locks

DOC = Path(__file__).resolve().parent.parent / "docs" / "ARCHITECTURE.md"
MODULE = "docs_example_backend"


def load_example():
    """Return the module made of the example's code block, importable as ``MODULE`` (for ``BACKEND``)."""
    text = DOC.read_text()
    [code] = re.findall(r"<!-- example: versioned-store backend -->\n```python\n(.*?)```", text, re.S)
    module = types.ModuleType(MODULE)
    exec(compile(code, str(DOC), "exec"), module.__dict__)  # noqa: S102 - our own documentation
    sys.modules[MODULE] = module
    return module


class MemoryStore:
    """A versioned object store in memory: conditional writes and deletes, generations that only grow."""

    def __init__(self, precondition_failed):
        self._precondition_failed = precondition_failed
        self._objects = {}
        self._generation = 0
        self._lock = threading.Lock()
        self.down = False

    def now(self):
        self._check()
        return time.monotonic()

    def _check(self):
        if self.down:
            raise ConnectionError("Connection refused")

    def read(self, key):
        self._check()
        with self._lock:
            return self._objects.get(key)

    def write(self, key, data, *, if_generation):
        self._check()
        with self._lock:
            current = self._objects.get(key, (None, 0))[1]
            if current != if_generation:
                raise self._precondition_failed(key)
            self._generation += 1
            self._objects[key] = (data, self._generation)
            return self._generation

    def delete(self, key, *, if_generation):
        self._check()
        with self._lock:
            if self._objects.get(key, (None, 0))[1] != if_generation:
                return False
            del self._objects[key]
            return True

    def keys(self, prefix):
        self._check()
        with self._lock:
            return [key for key in self._objects if key.startswith(prefix)]


@pytest.fixture
def store(settings):
    example = load_example()
    store = MemoryStore(example.PreconditionFailed)
    settings.DISTLOCK = {**settings.DISTLOCK, "example": {
        "BACKEND": f"{MODULE}.VersionedStoreBackend", "OPTIONS": {"STORE": store}}}
    yield store
    locks.close_all()
    sys.modules.pop(MODULE, None)


def test_the_example_backend_passes_the_system_checks(store):
    assert [message for message in run_checks() if "DISTLOCK['example']" in message.msg] == []


def test_the_example_backend_grants_excludes_and_releases(store):
    with distlock.lock("orders:42", ttl=5, using="example") as lease:
        with pytest.raises(distlock.LockNotAcquired, match="not acquired: it is held"):
            distlock.acquire("orders:42", blocking=False, using="example")
        [info] = locks["example"].held_locks("orders")
        assert (info.name, info.owner, info.token) == ("orders:42", lease.owner, lease.token)
        assert lease.extend(5)
    assert locks["example"].held_locks() == []
    with distlock.lock("orders:42", ttl=5, using="example") as again:
        assert again.token > lease.token


def test_the_example_backend_waits_and_takes_over_an_expired_lock_with_a_higher_token(store):
    first = distlock.acquire("orders:42", ttl=0.3, using="example")
    started = time.monotonic()
    with distlock.lock("orders:42", ttl=5, timeout=5, using="example") as second:
        assert time.monotonic() - started < 5
        assert second.token > first.token
    assert first.release() is False, "its lock expired and was taken over"


def test_the_example_backend_says_when_its_store_is_down(store):
    store.down = True
    with pytest.raises(distlock.BackendUnavailable,
                       match=r"^Lock alias 'example' \(versioned store\) could not acquire lock 'x': Connection refused\.$"):
        distlock.acquire("x", timeout=0, using="example")
