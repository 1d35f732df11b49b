"""The plumbing every backend shares: the request-deadline rule, the deadline timer and ``Daemon``."""

import os
import threading
import time

import pytest

from distlock.backends.deadlines import DeadlineTimer, request_deadline, request_seconds
from distlock.backends.green import Daemon
from tests.servers import wait_until

WAIT = 10


def test_a_request_gets_the_limit_cut_to_the_callers_time_but_never_below_the_minimum():
    now = time.monotonic()
    assert request_seconds(5, None, minimum=1) == 5
    assert request_seconds(None, None, minimum=1) is None
    assert request_seconds(5, now + 2, minimum=1, now=now) == pytest.approx(2)
    assert request_seconds(5, now + 0.2, minimum=1, now=now) == 1, "never below the backend's minimum"
    assert request_seconds(5, now - 3, minimum=0.1, now=now) == 0.1, "a caller out of time still gets the minimum"
    assert request_seconds(None, now + 2, minimum=1, now=now) == pytest.approx(2)
    assert request_deadline(5, None, minimum=1) == pytest.approx(time.monotonic() + 5, abs=0.1)
    assert request_deadline(None, None, minimum=1) is None


@pytest.fixture
def fired():
    """A timer whose callback records each key it fires for; stopped after the test."""
    keys = []
    timer = DeadlineTimer(keys.append, name="test-timer")
    yield timer, keys
    timer.stop()


def test_each_key_fires_once_at_its_deadline_in_deadline_order(fired):
    timer, keys = fired
    now = time.monotonic()
    timer.schedule("late", now + 0.3)
    timer.schedule("early", now + 0.1)
    wait_until(lambda: keys == ["early", "late"], WAIT, "both keys fired, the earlier first")
    assert time.monotonic() - now >= 0.3
    assert len(timer) == 0


def test_a_moved_deadline_fires_at_its_new_time_and_a_cancelled_one_never(fired):
    timer, keys = fired
    now = time.monotonic()
    timer.schedule("moved", now + 60)
    timer.schedule("cancelled", now + 0.3)  # fires only if this thread stalls 0.3 s before cancel() below
    timer.schedule("marker", now + 0.4)
    assert timer.move("moved", now + 0.2) is True
    timer.cancel("cancelled")
    wait_until(lambda: "marker" in keys, WAIT, "the marker key fired")
    assert keys == ["moved", "marker"]
    assert timer.move("moved", now + 1) is False, "a key that fired cannot be moved"


def test_stale_heap_entries_are_compacted_so_long_deadlines_cannot_pile_them_up(fired):
    timer, _ = fired
    far = time.monotonic() + 3600
    timer.schedule("kept", far)
    for step in range(10 * DeadlineTimer.COMPACT_SLACK):
        timer.move("kept", far + step)
    assert len(timer._heap) <= 2 * len(timer) + DeadlineTimer.COMPACT_SLACK + 1


def test_a_callback_that_raises_is_logged_and_the_timer_carries_on(caplog):
    keys = []

    def callback(key):
        if key == "broken":
            raise RuntimeError("the callback failed")
        keys.append(key)

    timer = DeadlineTimer(callback, name="test-timer")
    try:
        now = time.monotonic()
        timer.schedule("broken", now)
        timer.schedule("next", now + 0.1)
        wait_until(lambda: keys == ["next"], WAIT, "the key after the failing one fired")
        assert "the callback failed" in caplog.text
    finally:
        timer.stop()


def test_under_lock_no_callback_runs_for_a_key_once_its_cancel_returned():
    """The database backend's guarantee: a connection handed to a later call is never cut off."""
    running, fired_after_cancel = threading.Event(), []
    cancelled = set()

    def callback(key):
        running.set()
        time.sleep(0.05)  # a slow callback: a cancel() arriving meanwhile must wait for it
        if key in cancelled:
            fired_after_cancel.append(key)

    timer = DeadlineTimer(callback, name="test-timer", under_lock=True)
    try:
        for round_ in range(20):
            key = f"key-{round_}"
            timer.schedule(key, time.monotonic() + 0.01)
            time.sleep(0.01)
            timer.cancel(key)
            cancelled.add(key)
        assert fired_after_cancel == []
    finally:
        timer.stop()


def test_a_stopped_timer_starts_again_on_the_next_schedule(fired):
    timer, keys = fired
    timer.schedule("first", time.monotonic())
    wait_until(lambda: keys == ["first"], WAIT, "the first key fired")
    timer.stop()
    timer.schedule("second", time.monotonic())
    wait_until(lambda: keys == ["first", "second"], WAIT, "the timer started again")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_forgets_the_parents_deadlines(fired):
    timer, keys = fired
    timer.schedule("parent's", time.monotonic() + 0.3)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing of the parent's fires here
        try:
            time.sleep(0.6)
            os.write(write, b"%d" % len(timer))
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        assert pipe.read() == "0"
    os.waitpid(pid, 0)
    wait_until(lambda: keys == ["parent's"], WAIT, "the parent's key fired in the parent")


def test_a_daemon_thread_reports_itself_alive_from_start_until_its_loop_ends():
    release = threading.Event()
    daemon = Daemon(release.wait, name="test-daemon")
    daemon.start()
    assert daemon.is_alive(), "alive as soon as start() returns, even before the thread ran"
    assert not daemon.is_current()
    assert "test-daemon" in [thread.name for thread in threading.enumerate()]
    release.set()
    daemon.join(WAIT)
    assert not daemon.is_alive()
    assert "test-daemon" not in [thread.name for thread in threading.enumerate()]


def test_starting_a_daemon_waits_on_nothing_an_interrupt_could_break(monkeypatch):
    """``threading.Thread.start()`` waits on an Event until the thread runs: an interrupt landing in that
    wait (a time limit as a renewal starts) came out as ``RuntimeError: release unlocked lock``."""
    ran = []
    started = Daemon(lambda: ran.append(True), name="test-daemon")

    def interrupted_wait(self, timeout=None):
        raise KeyboardInterrupt("an interrupt inside Event.wait")

    with monkeypatch.context() as patched:
        patched.setattr(threading.Event, "wait", interrupted_wait)
        started.start()  # returns at once, without waiting for the thread to run
    wait_until(lambda: ran, WAIT, "the daemon's loop ran")
    started.join(WAIT)
    assert not started.is_alive()
