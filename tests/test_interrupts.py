"""Exceptions after a grant, in signal receivers, in renewal or in release never leave a lock held or renewed.

``Interrupt`` stands for what a signal handler or a green-thread timeout raises anywhere in the
caller (Celery's ``SoftTimeLimitExceeded``, ``gevent.Timeout``, ``KeyboardInterrupt``): a
``BaseException`` that ``send_robust`` and ``except Exception`` let through.
"""

import logging
import threading
import uuid

import pytest

import distlock
from distlock import metrics
from distlock.backends.locmem import LocMemBackend
from distlock.handler import locks
from distlock.renewal import Renewer, renewing
from distlock.signals import lock_acquired, lock_lost, lock_released
from tests.conftest import BACKEND_ALIASES, alias_params, require_alias
from tests.interrupted_waits import lines_that_break
from tests.servers import wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


@pytest.fixture(params=alias_params(BACKEND_ALIASES))
def backend_alias(request):
    """Each backend alias in turn (``tests.conftest.backend_alias``), with only the databases it needs."""
    return require_alias(request.param)


#: Seconds to wait for another thread's effect (bounded polls only).
WAIT = 10


class Interrupt(BaseException):
    """Raised where a time limit or ``KeyboardInterrupt`` would land."""


def renewed(name):
    return [lease for lease in renewing() if lease.name == name]


@pytest.fixture
def connect():
    """``connect(signal, receiver)`` for the test's duration."""
    connected = []

    def connect(signal, receiver):
        signal.connect(receiver, weak=False)
        connected.append((signal, receiver))

    yield connect
    for signal, receiver in connected:
        signal.disconnect(receiver)


def once(exception):
    """Return a function that raises ``exception`` at its first call and returns None after."""
    calls = []

    def raise_once(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise exception

    return raise_once


# -- the steps of acquire() after the grant -----------------------------------------------------------

def interrupt_record_acquire(monkeypatch, connect):
    original = metrics.record_acquire
    fired = []

    def record_acquire(alias, name, ttl, waited, result, lease=None):
        if result == "acquired" and not fired:
            fired.append(name)
            raise Interrupt("inside metrics.record_acquire")
        return original(alias, name, ttl, waited, result, lease)

    monkeypatch.setattr(metrics, "record_acquire", record_acquire)


def interrupt_lock_acquired_receiver(monkeypatch, connect):
    connect(lock_acquired, once(Interrupt("inside a lock_acquired receiver")))


def interrupt_renewer_start(monkeypatch, connect):
    original = Renewer.start

    def start(self):
        original(self)  # the worst case: the thread runs, then the exception lands in start()
        raise Interrupt("inside Renewer.start, after the thread started")

    monkeypatch.setattr(Renewer, "start", start)


AFTER_GRANT_STEPS = {
    "record_acquire": interrupt_record_acquire,
    "lock_acquired": interrupt_lock_acquired_receiver,
    "renewer_start": interrupt_renewer_start,
}


@pytest.mark.parametrize("step", list(AFTER_GRANT_STEPS))
def test_an_interrupt_right_after_the_grant_gives_the_lock_back(backend_alias, lock_name, monkeypatch, connect,
                                                                 step):
    AFTER_GRANT_STEPS[step](monkeypatch, connect)
    with pytest.raises(Interrupt) as interrupted:
        # ttl 30: only a release frees it within this test, not its expiry.
        distlock.acquire(lock_name, ttl=30, auto_renew=True, using=backend_alias)
    # ``interrupted`` keeps the traceback, and with it acquire()'s frame and the lease, as Celery
    # keeps a failed run's: the lease's renewal must stop anyway.
    assert interrupted.traceback
    monkeypatch.undo()
    other = distlock.acquire(lock_name, ttl=10, blocking=False, auto_renew=False, using=backend_alias)
    assert other.release() is True
    wait_until(lambda: not renewed(lock_name), WAIT, "the end of the renewal of the lease never returned")


def test_an_error_while_giving_back_is_logged_and_the_interrupt_still_propagates(lock_name, monkeypatch, caplog):
    alias = "locmem"
    interrupt_renewer_start(monkeypatch, None)
    monkeypatch.setattr(locks[alias], "release", once(RuntimeError("server gone while giving back")))
    with pytest.raises(Interrupt):
        distlock.acquire(lock_name, ttl=30, auto_renew=True, using=alias)
    assert "Could not give back lock" in caplog.text and "server gone while giving back" in caplog.text
    wait_until(lambda: not renewed(lock_name), WAIT, "the end of the renewal of the lease never returned")


# -- signal receivers that raise --------------------------------------------------------------------

def test_a_raising_lock_acquired_receiver_keeps_the_grant(backend_alias, lock_name, connect, caplog):
    def broken_receiver(**kwargs):
        raise RuntimeError("the alert service is down")

    seen = []
    connect(lock_acquired, broken_receiver)
    connect(lock_acquired, lambda lease, **kwargs: seen.append(lease))
    lease = distlock.acquire(lock_name, ttl=10, using=backend_alias)
    try:
        assert seen == [lease], "the receivers after the broken one must run"
        lease.check()
        with pytest.raises(distlock.LockNotAcquired):
            distlock.acquire(lock_name, blocking=False, using=backend_alias)
    finally:
        assert lease.release() is True
    assert "broken_receiver" in caplog.text and "the alert service is down" in caplog.text


def test_a_raising_lock_released_receiver_does_not_fail_the_release(backend_alias, lock_name, connect, caplog):
    def broken_receiver(**kwargs):
        raise RuntimeError("the audit table is locked")

    seen = []
    connect(lock_released, broken_receiver)
    connect(lock_released, lambda released, **kwargs: seen.append(released))
    lease = distlock.acquire(lock_name, ttl=10, using=backend_alias)
    assert lease.release() is True
    assert seen == [True]
    assert "broken_receiver" in caplog.text and "the audit table is locked" in caplog.text
    distlock.acquire(lock_name, ttl=10, blocking=False, using=backend_alias).release()


def test_a_raising_lock_lost_receiver_stops_neither_the_marking_nor_the_other_receivers(
        backend_alias, lock_name, connect, caplog):
    seen = []

    def broken_receiver(lease, **kwargs):
        seen.append(("broken", lease._lost_reason is not None))
        raise RuntimeError("the pager is down")

    connect(lock_lost, broken_receiver)
    connect(lock_lost, lambda lease, **kwargs: seen.append(("next", lease._lost_reason is not None)))
    lease = distlock.acquire(lock_name, ttl=1.5, auto_renew=True, using=backend_alias)
    try:
        assert locks[backend_alias].release_owned(lock_name, lease.owner) is True
        wait_until(lambda: len(seen) == 2, WAIT, "lock_lost sent to both receivers")
    finally:
        lease.release()
    assert seen == [("broken", True), ("next", True)], "the lease is marked lost before any receiver runs"
    with pytest.raises(distlock.LockLost):
        lease.check()
    assert "broken_receiver" in caplog.text and "the pager is down" in caplog.text


# -- renewal ---------------------------------------------------------------------------------------

def test_the_renewer_retries_after_an_unexpected_error(backend_alias, lock_name, monkeypatch, caplog):
    backend = locks[backend_alias]
    extend_many = backend.extend_many
    outcomes = []

    def flaky_extend_many(requests):
        if not outcomes:
            outcomes.append("raised")
            raise TypeError("'int' object is not subscriptable")  # a misread reply
        outcomes.extend(extend_many(requests))
        return outcomes[-len(requests):]

    monkeypatch.setattr(backend, "extend_many", flaky_extend_many)
    lease = distlock.acquire(lock_name, ttl=3, auto_renew=True, using=backend_alias)
    try:
        wait_until(lambda: True in outcomes, WAIT, "an extension after the one that raised")
        lease.check()
        assert lease._renewer.running
    finally:
        assert lease.release() is True
    assert outcomes[0] == "raised"
    assert "not subscriptable" in caplog.text


def test_the_renewer_marks_the_lease_lost_when_extending_keeps_raising(lock_name, monkeypatch, connect):
    alias = "locmem"
    lost = []
    connect(lock_lost, lambda lease, reason, **kwargs: lost.append(reason))

    def broken_extend(lease, ttl):
        raise TypeError("'int' object is not subscriptable")

    monkeypatch.setattr(locks[alias], "extend", broken_extend)
    lease = distlock.acquire(lock_name, ttl=1, auto_renew=True, using=alias)
    try:
        wait_until(lambda: lost, WAIT, "lock_lost after extensions kept raising")
        assert "not subscriptable" in lost[0]
        with pytest.raises(distlock.LockLost, match="was lost"):
            lease.check()
        wait_until(lambda: not lease._renewer.running, WAIT, "the end of the renewal thread of a lost lease")
    finally:
        lease.release()


# -- release ---------------------------------------------------------------------------------------

def test_an_interrupt_inside_release_leaves_nothing_renewing(backend_alias, lock_name, monkeypatch):
    # ttl 60: the renewal thread wakes up by itself only every 20 s, later than this test waits.
    lease = distlock.acquire(lock_name, ttl=60, auto_renew=True, using=backend_alias)
    # Lands as the release starts to stop renewal, before it could set anything.
    monkeypatch.setattr(Renewer, "stop", once(Interrupt("as release() stops renewal")))
    try:
        with pytest.raises(Interrupt):
            lease.release()
        wait_until(lambda: not renewed(lock_name), WAIT, "the end of the renewal thread of a released lease")
        assert lease.released
    finally:
        locks[backend_alias].release_owned(lock_name, lease.owner)


def test_an_interrupt_inside_the_backend_release_leaves_nothing_renewing(backend_alias, lock_name, monkeypatch):
    backend = locks[backend_alias]
    lease = distlock.acquire(lock_name, ttl=30, auto_renew=True, using=backend_alias)
    monkeypatch.setattr(backend, "release", once(Interrupt("inside the backend's release")))
    try:
        with pytest.raises(Interrupt):
            lease.release()
        assert not renewed(lock_name), "renewal stops before the backend is asked to release"
    finally:
        monkeypatch.undo()
        backend.release_owned(lock_name, lease.owner)


# -- metrics ---------------------------------------------------------------------------------------

def test_a_bad_metrics_setting_neither_fails_nor_leaks_the_grant(settings, lock_name, caplog):
    settings.DISTLOCK_METRICS = {"FLUSH_INTERVAL": 0}
    for _ in range(2):
        lease = distlock.acquire(lock_name, ttl=10, using="locmem")
        assert lease.release() is True
    assert metrics.this_process._recording is False
    errors = [record for record in caplog.records
              if record.name.startswith("distlock.metrics") and record.levelno >= logging.ERROR]
    assert len(errors) == 1, "logged once, not at every acquire"
    assert "FLUSH_INTERVAL" in caplog.text


def test_a_locmem_waiter_interrupted_anywhere_never_blocks_the_holder(lock_name):
    # Before: the waiter slept in the store's Condition; an interrupt could leave it held, and every
    # other call on the alias blocked, or come out as RuntimeError instead of itself.
    def make():
        backend = LocMemBackend(f"interrupted-{uuid.uuid4().hex[:8]}", {})
        held = backend.acquire(lock_name, ttl=30, timeout=0, blocking=False)

        def notify():
            assert backend.release(held), "the holder could not release"
            backend.release(backend.acquire(lock_name, ttl=30, timeout=0, blocking=False))

        return (lambda: backend.acquire(lock_name, ttl=30, timeout=0.05, blocking=True)), notify

    assert lines_that_break(make) == []


def test_the_interrupt_probe_catches_threading_event():
    # The canary of ``lines_that_break``: threading.Event keeps its lock in a Python __exit__, where an
    # interrupt can leave it held, so distlock's waits use distlock.waiting instead.
    def make():
        event = threading.Event()
        return (lambda: event.wait(0.05)), event.set

    problems = lines_that_break(make)
    assert any(problem == "the notifier blocked" for _, problem in problems), problems
