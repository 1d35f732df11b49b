"""Exceptions after a grant, in signal receivers, in renewal or in release never leave a lock held or renewed.

``Interrupt`` stands for what a signal handler or a green-thread timeout raises anywhere in the
caller (Celery's ``SoftTimeLimitExceeded``, ``gevent.Timeout``, ``KeyboardInterrupt``): a
``BaseException`` that ``send_robust`` and ``except Exception`` let through.
"""

import gc
import itertools
import logging
import queue
import random
import signal
import sys
import threading
import time
import uuid
from collections import Counter

import pytest

import distlock
from distlock import metrics
from distlock.backends.locmem import LocMemBackend
from distlock.backends import offload
from distlock.backends.offload import signals_can_raise
from distlock.handler import locks
from distlock.renewal import Renewer, renewing
from distlock.signals import lock_acquired, lock_lost, lock_released
from tests import interrupted_waits
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


# -- the callers of the renewal scheduler -----------------------------------------------------------

#: Seconds each extension of the lease under test stays in flight, so that its release meets it there.
IN_FLIGHT = 0.03
#: Seconds the whole probe may take before it counts as hung (a caller or a notifier blocked for good).
PROBE_BOUND = 120


def soon(predicate, timeout, what):
    """``wait_until`` polling every 5 ms: the probe makes hundreds of tries."""
    wait_until(predicate, timeout, what, every=0.005)


@pytest.mark.parametrize("phase", ["acquire", "release"])
def test_a_caller_interrupted_anywhere_in_acquire_or_release_never_wedges_renewal(phase, lock_name, monkeypatch):
    """Interrupt, at each of its lines in turn, ``acquire()`` of an auto-renewed lease, or its ``release()`` while an
    extension of it is in flight: the interrupt comes out as itself, the alias keeps renewing (a new
    lease is extended, within a bound), the interrupted lease's renewal ends and its lock goes, and
    after the probe nothing is held or renewed.

    Regression: the scheduler of 7a2e7ba took its lock and waited on a Condition on the caller's
    thread (``start()``, and ``stop()`` waiting for an extension in flight); an interrupt there left
    the lock held, and every renewal and acquisition of the alias after it blocked for good.
    """
    alias, ttl = "locmem", 0.3
    backend = locks[alias]
    monkeypatch.setattr(Renewer, "interval_ratio", 0.1)  # an extension every 30 ms
    monkeypatch.setattr(interrupted_waits, "PATIENCE", 10.0)
    watched, in_flight, extended = set(), queue.SimpleQueue(), Counter()
    extend_many = backend.extend_many

    def held_extend_many(requests):
        extended.update(lease.owner for lease, _ in requests)
        if any(lease.owner in watched for lease, _ in requests):
            in_flight.put(None)
            time.sleep(IN_FLIGHT)
        return extend_many(requests)

    monkeypatch.setattr(backend, "extend_many", held_extend_many)
    tries = itertools.count()

    def make():
        name = f"{lock_name}:{next(tries)}"
        held = []
        if phase == "acquire":
            def wait():
                held.append(distlock.acquire(name, ttl=ttl, auto_renew=True, using=alias))
        else:
            held.append(distlock.acquire(name, ttl=ttl, auto_renew=True, using=alias))
            watched.clear()
            watched.add(held[0].owner)
            while not in_flight.empty():
                in_flight.get()
            in_flight.get(timeout=5)  # an extension of the lease is on its way: the release meets it
            wait = held[0].release

        def notify():
            watched.clear()
            if held and not held[0].released:
                held[0].release()  # interrupted before the release began: still the caller's to release
            fresh = distlock.acquire(f"{name}:fresh", ttl=ttl, auto_renew=True, using=alias)
            try:
                soon(lambda: extended[fresh.owner] >= 1, 3.0, "an extension of a lease taken after the interrupt")
            finally:
                fresh.release()
            if held:  # a lease that reached its caller: its renewal ends and its lock goes (one that did not
                # gave its lock back, or was left to expire: checked after the probe)
                soon(lambda: not held[0].renewer.running, 3.0, "the end of the interrupted lease's renewal")
                distlock.acquire(name, ttl=ttl, timeout=ttl + 1, using=alias).release()

        return wait, notify

    found = []
    probe = threading.Thread(target=lambda: found.append(lines_that_break(make, most=1000)), daemon=True)
    probe.start()
    probe.join(PROBE_BOUND)
    assert not probe.is_alive(), f"the probe hung: a caller or a notifier blocked for good ({next(tries)} tries)"
    assert found == [[]]
    gc.collect()  # an acquire cut short at its return leaves its lease to the interrupt's traceback, now gone
    soon(lambda: not [lease for lease in renewing(alias) if lease.name.startswith(lock_name)], 5, "renewals ended")
    soon(lambda: not backend.held_locks(lock_name), 2 * ttl + 1, "every lock of the probe gone")


#: Seconds the signal storm lasts.
STORM_SECONDS = 5
#: Seconds added to the aim of each interrupt: what arming the timer itself takes.
TIMER_SLACK = 50e-6
#: Seconds past the storm's end after which a call still running counts as blocked for good.
STORM_GRACE = 5
#: Lock names the storm takes: enough that most acquisitions find theirs free.
NAMES = 64


def test_a_signal_storm_on_the_callers_of_auto_renewed_leases_leaves_renewal_working_and_nothing_held(
        lock_name, monkeypatch):
    """SIGALRM raises in the main thread at random points of acquire() and release() of auto-renewed leases (as
    Celery's soft time limit does), thousands of times: afterwards the alias still renews, and nothing
    the storm took is held or renewed once its ttl has passed."""
    alias, ttl = "locmem", 0.3
    backend = locks[alias]
    monkeypatch.setattr(Renewer, "interval_ratio", 0.1)  # an extension every 30 ms: releases meet them
    extended = Counter()
    extend_many = backend.extend_many

    def counting_extend_many(requests):
        extended.update(lease.owner for lease, _ in requests)
        return extend_many(requests)

    monkeypatch.setattr(backend, "extend_many", counting_extend_many)
    rng = random.Random(16)
    armed, held, counts, over = [False], [], Counter(), [False]

    def on_alarm(signum, frame):
        if armed[0] and not over[0]:
            armed[0] = False
            raise Interrupt("SIGALRM")

    timings = {"acquire": [], "release": []}
    for _ in range(20):  # how long each call takes, to aim the interrupts anywhere in it
        started = time.monotonic()
        lease = distlock.acquire(f"{lock_name}:calibrate", ttl=ttl, auto_renew=True, using=alias)
        timings["acquire"].append(time.monotonic() - started)
        started = time.monotonic()
        lease.release()
        timings["release"].append(time.monotonic() - started)
    typical = {kind: sorted(seconds)[len(seconds) // 2] for kind, seconds in timings.items()}
    unraisablehook = sys.unraisablehook

    def on_unraisable(unraisable):
        # Python drops an interrupt that lands in a finalizer or a weakref callback (GC): its own limit.
        if isinstance(unraisable.exc_value, Interrupt):
            counts["dropped by Python"] += 1
        else:
            unraisablehook(unraisable)

    deadline = time.monotonic() + STORM_SECONDS
    main = threading.main_thread().ident

    def watchdog():
        # A call that swallowed its interrupt and then blocked would block the test for good: interrupt it again.
        while not over[0]:
            time.sleep(0.1)
            if not over[0] and time.monotonic() > deadline + STORM_GRACE:
                counts["blocked"] += 1
                armed[0] = True
                signal.pthread_kill(main, signal.SIGALRM)

    monkeypatch.setattr(sys, "unraisablehook", on_unraisable)
    previous = signal.signal(signal.SIGALRM, on_alarm)
    watching = threading.Thread(target=watchdog, daemon=True)
    watching.start()
    try:
        while time.monotonic() < deadline:
            kind = "release" if held and (len(held) > 3 or rng.random() < 0.5) else "acquire"
            try:
                try:
                    armed[0] = True
                    signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-6, 2 * typical[kind] + TIMER_SLACK))
                    if kind == "release":
                        held.pop(rng.randrange(len(held))).release()
                    else:
                        held.append(distlock.acquire(f"{lock_name}:{rng.randrange(NAMES)}", ttl=ttl, blocking=False,
                                                     auto_renew=True, using=alias))
                finally:
                    armed[0] = False
                    signal.setitimer(signal.ITIMER_REAL, 0)
                counts[kind] += 1
            except Interrupt:
                counts["interrupted"] += 1
            except distlock.LockNotAcquired:
                counts["busy"] += 1
    finally:
        over[0] = True
        watching.join()  # before the handler goes: a late SIGALRM must still find ours, which ignores it now
        signal.signal(signal.SIGALRM, previous)
    assert not counts["blocked"], f"a call blocked for good during the storm ({dict(counts)})"
    assert counts["interrupted"] > 100, counts

    def still_renewing():
        while held:
            held.pop().release()
        fresh = distlock.acquire(f"{lock_name}:fresh", ttl=ttl, auto_renew=True, using=alias)
        try:
            soon(lambda: extended[fresh.owner] >= 1, 5.0, "an extension of a lease taken after the storm")
        finally:
            fresh.release()
        gc.collect()
        soon(lambda: not [lease for lease in renewing(alias) if lease.name.startswith(lock_name)], 5, "renewals ended")
        soon(lambda: not backend.held_locks(lock_name), 2 * ttl + 1, "every lock of the storm gone")

    failures = []
    checking = threading.Thread(target=lambda: failures.append(catch(still_renewing)), daemon=True)
    checking.start()
    checking.join(30)
    assert not checking.is_alive(), f"renewal blocked for good after the storm ({dict(counts)})"
    assert failures == [None], counts


def catch(function):
    """Return what ``function()`` raised, or None."""
    try:
        function()
    except Exception as exc:  # noqa: BLE001 - the test reports it
        return exc
    return None


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


def test_only_a_python_level_handler_other_than_ctrl_c_s_counts_as_a_signal_that_can_raise(monkeypatch):
    """Checked on SIGINT and SIGALRM alone: the process running the suite may have set others (nohup ignores SIGINT)."""
    monkeypatch.setattr(offload, "_SIGNALS", (signal.SIGINT, signal.SIGALRM))
    saved = {signum: signal.getsignal(signum) for signum in offload._SIGNALS}
    seen = {}
    try:
        for label, sigint, sigalrm in [
            ("Ctrl-C's own handler, SIGALRM ignored", signal.default_int_handler, signal.SIG_IGN),
            ("SIGINT ignored, SIGALRM default", signal.SIG_IGN, signal.SIG_DFL),
            ("a SIGALRM handler", signal.default_int_handler, lambda signum, frame: None),
            ("a SIGINT handler of the application's", lambda signum, frame: None, signal.SIG_DFL),
        ]:
            signal.signal(signal.SIGINT, sigint)
            signal.signal(signal.SIGALRM, sigalrm)
            seen[label] = signals_can_raise()
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
    assert seen == {"Ctrl-C's own handler, SIGALRM ignored": False, "SIGINT ignored, SIGALRM default": False,
                    "a SIGALRM handler": True, "a SIGINT handler of the application's": True}
