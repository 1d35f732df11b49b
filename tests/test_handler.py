"""``locks``, the alias handler: one backend per alias per process, and a fresh start after a fork."""

import os
import threading
import time

import pytest

from distlock.handler import LockHandler, locks


def _wait_for_child(pid, timeout):
    """Return the child's exit status, or None if it was still running after ``timeout`` (then kill it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return None


def test_a_fork_while_another_thread_builds_a_backend_leaves_the_child_usable(monkeypatch):
    building, finish = threading.Event(), threading.Event()
    original = LockHandler.create_backend

    def slow_create_backend(self, alias):
        if threading.current_thread().name == "builder":
            building.set()
            finish.wait(10)
        return original(self, alias)

    monkeypatch.setattr(LockHandler, "create_backend", slow_create_backend)
    locks.close_all()
    builder = threading.Thread(target=lambda: locks["locmem"], name="builder")
    builder.start()
    assert building.wait(10)  # the builder holds the handler's lock now
    try:
        pid = os.fork()
        if pid == 0:  # the child: the builder thread does not exist here
            try:
                locks["locmem"].ping()
                os._exit(0)
            finally:
                os._exit(1)
        assert _wait_for_child(pid, timeout=10) == 0, "the child hung on the lock its parent's thread held"
    finally:
        finish.set()
        builder.join()


@pytest.mark.django_db(transaction=True, databases="__all__")
def test_after_a_fork_the_child_builds_its_own_backends():
    parent_backend = locks["locmem"]
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if locks["locmem"] is not parent_backend else 1)
        finally:
            os._exit(2)
    assert _wait_for_child(pid, timeout=10) == 0
    assert locks["locmem"] is parent_backend
