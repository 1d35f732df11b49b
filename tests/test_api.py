"""The public API's arguments, the alias handler and the renewal thread, on the in-process backend."""

import json
import os
import subprocess
import socket
import sys
import threading
import time
import unicodedata

import pytest

import distlock
from distlock import holder
from distlock.handler import LockHandler, locks
from distlock.renewal import Renewer
from distlock.validation import validate_name
from tests.servers import wait_until
from tests.workers import ROOT

ALIAS = "locmem"


def test_locks_returns_one_backend_per_alias_and_is_thread_safe():
    handler = LockHandler()
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(handler[ALIAS])) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(backend) for backend in seen}) == 1


def test_names_are_refused_for_exactly_the_control_and_format_characters_and_lone_surrogates():
    refused = []
    for code_point in range(sys.maxunicode + 1):
        try:
            validate_name(f"a{chr(code_point)}b")
        except ValueError:
            refused.append(code_point)
    assert refused == [code_point for code_point in range(sys.maxunicode + 1)
                       if unicodedata.category(chr(code_point)) in ("Cc", "Cf", "Cs")]


@pytest.mark.parametrize("spoof", ["invoice:\u202e1234", "invoice:\u200b1234", "invoice:1234\u2060"])
def test_names_with_invisible_format_characters_are_refused(spoof):
    with pytest.raises(ValueError, match="format characters"):
        distlock.acquire(spoof, ttl=5, using="locmem")


@pytest.mark.django_db(transaction=True, databases="__all__")
def test_one_name_spelled_composed_or_decomposed_is_one_lock(backend_alias):
    composed, decomposed = "caf\u00e9:order", "cafe\u0301:order"
    lease = distlock.acquire(composed, ttl=5, blocking=False, using=backend_alias)
    try:
        assert lease.name == composed
        with pytest.raises(distlock.LockNotAcquired):
            distlock.acquire(decomposed, ttl=5, blocking=False, using=backend_alias)
        with pytest.raises(distlock.LockNotAcquired), distlock.lock(decomposed, ttl=5, blocking=False,
                                                                   using=backend_alias):
            pass
    finally:
        lease.release()


def test_the_holder_record_follows_the_celery_task_and_a_fork(monkeypatch):
    def record():
        return json.loads(holder.holder_record(owner="o\"wner", created_at="now"))

    token = holder.current_task_id.set("task-1")
    try:
        assert record() == {"owner": 'o"wner', "created_at": "now", "host": socket.gethostname(),
                            "pid": os.getpid(), "task_id": "task-1"}
        holder.current_task_id.set("task-2")
        assert record()["task_id"] == "task-2"
    finally:
        holder.current_task_id.reset(token)
    monkeypatch.setattr(os, "getpid", lambda: 4242)
    assert record()["pid"] == 4242


def test_unknown_alias_is_an_improperly_configured():
    from django.core.exceptions import ImproperlyConfigured  # noqa: PLC0415

    with pytest.raises(ImproperlyConfigured, match="'missing' doesn't exist"):
        LockHandler()["missing"]


def test_settings_change_rebuilds_backends(settings):
    before = locks[ALIAS]
    settings.DISTLOCK = {**settings.DISTLOCK, ALIAS: {"BACKEND": "distlock.backends.locmem.LocMemBackend",
                                                      "OPTIONS": {"DEFAULT_TTL": 7}}}
    after = locks[ALIAS]
    assert after is not before and after.settings["DEFAULT_TTL"] == 7
    with distlock.lock("defaults", using=ALIAS) as lease:
        assert lease.ttl == 7


def test_timeout_zero_means_one_try():
    with distlock.lock("t0", ttl=5, using=ALIAS):
        started = time.monotonic()
        with pytest.raises(distlock.LockNotAcquired, match="non-blocking"):
            distlock.acquire("t0", timeout=0, using=ALIAS)
        assert time.monotonic() - started < 0.1


def test_max_hold_without_auto_renew_caps_the_ttl():
    with distlock.lock("cap", ttl=30, max_hold=2, using=ALIAS) as lease:
        assert lease.ttl == 2


def test_option_defaults_apply_per_alias(settings):
    settings.DISTLOCK = {**settings.DISTLOCK, ALIAS: {"BACKEND": "distlock.backends.locmem.LocMemBackend",
                                                      "OPTIONS": {"AUTO_RENEW": True, "DEFAULT_TTL": 0.6}}}
    with distlock.lock("renewed-by-default", using=ALIAS) as lease:
        time.sleep(1.5)
        lease.check()


def test_read_write_locks_name_the_backend_that_lacks_them():
    expected = rf"^Lock alias '{ALIAS}' \(locmem\) does not support read/write locks .*use an alias whose backend does: ZooKeeper\.$"
    for shape in (distlock.read_lock, distlock.write_lock):
        with pytest.raises(distlock.NotSupported, match=expected) as refused:
            with shape("rw", using=ALIAS):
                pass
        assert isinstance(refused.value, NotImplementedError) and isinstance(refused.value, distlock.LockError)


def test_decorator_acquires_per_call_and_validates_at_decoration():
    with pytest.raises(ValueError, match="empty"):
        distlock.lock("", using=ALIAS)
    calls = []

    @distlock.lock("per-call", ttl=5, using=ALIAS)
    def work(x):
        calls.append(distlock.locks[ALIAS].held_locks("per-call")[0].token)
        return x * 2

    assert work(2) == 4 and work(3) == 6
    assert calls[1] > calls[0]


def test_validity_ignores_the_wall_clock(monkeypatch):
    with distlock.lock("wall", ttl=5, using=ALIAS) as lease:
        monkeypatch.setattr(time, "time", lambda: 0.0)
        assert 4 < lease.remaining() <= 5
        lease.check()


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_renewer_releases_and_marks_lost_at_max_hold():
    lease = distlock.acquire("watchdog", ttl=0.9, using=ALIAS)
    renewer = Renewer(lease, max_hold=0.5)
    assert renewer._next_wait() <= 0.5
    lease._renewer = renewer
    renewer.start()
    # The lease's own validity runs out at 0.9 s whether or not the thread acted: wait for its mark.
    wait_until(lambda: lease.lost_reason is not None, 10, "the renewal thread stopping at max_hold")
    assert lease.lost
    with pytest.raises(distlock.LockLost, match="max_hold"):
        lease.check()
    assert distlock.locks[ALIAS].held_locks("watchdog") == []


def test_renewer_never_extends_past_max_hold():
    clock = FakeClock()
    lease = distlock.acquire("capped", ttl=3, using=ALIAS)
    renewer = Renewer(lease, max_hold=4, clock=clock)
    renewer._hold_deadline = 4.0
    clock.now = 3.5
    assert renewer._next_wait() == pytest.approx(0.5)
    assert renewer._extension_ttl() == pytest.approx(0.5)
    lease.release()


def test_the_first_extension_is_due_a_third_of_the_ttl_after_the_acquire_request():
    # acquire() starts the renewal thread after the lock_acquired receivers ran: time they take must
    # not push the first extension towards the end of the lease's validity.
    lease = distlock.acquire("due", ttl=3, using=ALIAS)
    clock = FakeClock()
    clock.now = lease._started + 0.9
    renewer = Renewer(lease, clock=clock)
    assert renewer._next_wait() == pytest.approx(0.1)
    clock.now = lease._started + 2
    assert renewer._next_wait() == 0
    lease.release()


def test_locmem_tokens_keep_growing_in_a_new_process():
    """A process's counter starts afresh; its tokens must still exceed those of the process before."""
    before = distlock.acquire("restart", ttl=5, using="locmem")
    before.release()
    code = ("import django, os; os.environ['DJANGO_SETTINGS_MODULE'] = 'tests.settings'; django.setup(); "
            "import distlock; lease = distlock.acquire('restart', ttl=5, using='locmem'); print(lease.token)")
    after = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                               cwd=ROOT).stdout)
    assert after > before.token
