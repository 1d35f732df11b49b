"""``lock(name, reentrant=True)``: depth counting, one round trip for any depth, the same lease, who re-enters."""

import asyncio
import os
import threading

import pytest
from django.db import connections

import distlock
from distlock import LockLost, LockNotAcquired, LockOrderError, reentrancy
from distlock.handler import locks
from distlock.holder import current_task_id
from tests.conftest import free, require_alias
from tests.servers import wait_until


@pytest.fixture
def round_trips(backend_alias, monkeypatch):
    """How many times the alias's backend is asked to acquire and to release a lock."""
    backend = locks[backend_alias]
    counts = {"acquire": 0, "release": 0}
    real_acquire, real_release = backend.acquire, backend.release

    def acquire(name, **kwargs):
        counts["acquire"] += 1
        return real_acquire(name, **kwargs)

    def release(lease):
        counts["release"] += 1
        return real_release(lease)

    monkeypatch.setattr(backend, "acquire", acquire)
    monkeypatch.setattr(backend, "release", release)
    return counts


def depth(alias, name):
    return reentrancy.depth(name, alias)


def test_nested_blocks_count_their_depth_and_hold_the_lock_until_the_outermost_exits(backend_alias, lock_name):
    with distlock.lock(lock_name, ttl=30, using=backend_alias, reentrant=True) as outer:
        assert depth(backend_alias, lock_name) == 1
        # blocking=False: a re-entry never waits, and without reentrancy this fails at once instead of hanging.
        with distlock.lock(lock_name, blocking=False, using=backend_alias, reentrant=True) as inner:
            assert inner is outer
            assert depth(backend_alias, lock_name) == 2
            with distlock.lock(lock_name, blocking=False, using=backend_alias, reentrant=True) as innermost:
                assert innermost is outer
                assert depth(backend_alias, lock_name) == 3
            assert depth(backend_alias, lock_name) == 2
        assert depth(backend_alias, lock_name) == 1
        assert not outer.released
        assert not free(backend_alias, lock_name), "the lock was freed when an inner block exited"
    assert depth(backend_alias, lock_name) == 0
    assert outer.released
    assert free(backend_alias, lock_name)


def test_any_depth_costs_one_acquire_and_one_release(backend_alias, lock_name, round_trips):
    tokens = []

    @distlock.lock(lock_name, ttl=30, blocking=False, using=backend_alias, reentrant=True)
    def walk(level):
        with distlock.lock(lock_name, blocking=False, using=backend_alias, reentrant=True) as lease:
            tokens.append(lease.token)
            if level:
                walk(level - 1)

    walk(9)  # 20 nested blocks: 10 decorated calls, each with a ``with`` inside
    assert round_trips == {"acquire": 1, "release": 1}
    assert len(tokens) == 10 and len(set(tokens)) == 1
    assert depth(backend_alias, lock_name) == 0
    assert free(backend_alias, lock_name)


def test_one_lock_object_serves_nesting_and_other_threads(backend_alias, lock_name):
    guard = distlock.lock(lock_name, ttl=30, timeout=30, using=backend_alias, reentrant=True)
    seen = {}

    def other_thread():
        try:
            with guard as lease:
                seen["outer_released"] = mine.released
                seen["token"] = lease.token
        finally:
            connections.close_all()

    with guard as mine, guard as again:
        assert again is mine
        thread = threading.Thread(target=other_thread)
        thread.start()
        assert not free(backend_alias, lock_name)
    wait_until(lambda: "token" in seen, 30, "the other thread's lease")
    thread.join(30)
    assert seen["outer_released"] is True, "the other thread entered while this one held the lock"
    assert seen["token"] > mine.token
    assert guard._leases == []


def test_another_thread_does_not_reenter(backend_alias, lock_name):
    outcome = []

    def other_thread():
        try:
            with distlock.lock(lock_name, blocking=False, using=backend_alias, reentrant=True):
                outcome.append("entered")
        except LockNotAcquired:
            outcome.append("busy")
        finally:
            connections.close_all()

    with distlock.lock(lock_name, ttl=30, using=backend_alias, reentrant=True):
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join(30)
    assert outcome == ["busy"]


def test_a_task_started_by_the_holder_does_not_reenter_and_the_holder_task_does(backend_alias, lock_name,
                                                                                 monkeypatch):
    # The lock calls are synchronous; the database backend refuses them inside a loop unless told.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

    async def child():
        # Starts with a copy of the holder's context, record included: it must still not re-enter.
        with distlock.lock(lock_name, blocking=False, using=backend_alias, reentrant=True):
            return "entered"

    async def holder():
        with distlock.lock(lock_name, ttl=30, using=backend_alias, reentrant=True) as outer:
            with pytest.raises(LockNotAcquired):
                await asyncio.create_task(child())
            await asyncio.sleep(0)
            with distlock.lock(lock_name, blocking=False, using=backend_alias, reentrant=True) as inner:
                assert inner is outer
                assert depth(backend_alias, lock_name) == 2
        return outer

    try:
        outer = asyncio.run(holder())
    finally:
        connections.close_all()
    assert outer.released
    assert free(backend_alias, lock_name)


def test_another_celery_task_run_in_the_same_thread_does_not_reenter(backend_alias, lock_name):
    token = current_task_id.set("task-1")
    try:
        with distlock.lock(lock_name, ttl=30, using=backend_alias, reentrant=True):
            current_task_id.set("task-2")
            with pytest.raises(LockNotAcquired):
                with distlock.lock(lock_name, blocking=False, using=backend_alias, reentrant=True):
                    pass
            current_task_id.set("task-1")
            with distlock.lock(lock_name, blocking=False, using=backend_alias, reentrant=True):
                assert depth(backend_alias, lock_name) == 2
    finally:
        current_task_id.reset(token)
    assert free(backend_alias, lock_name)


def test_a_plain_lock_of_a_name_held_reentrantly_goes_to_the_server(backend_alias, lock_name, round_trips):
    with distlock.lock(lock_name, ttl=30, using=backend_alias, reentrant=True):
        with pytest.raises(LockNotAcquired):
            with distlock.lock(lock_name, blocking=False, using=backend_alias):
                pass
        with pytest.raises(LockNotAcquired):
            distlock.acquire(lock_name, blocking=False, using=backend_alias)
        assert round_trips["acquire"] == 3
    with distlock.lock(lock_name, ttl=30, using=backend_alias):
        with pytest.raises(LockNotAcquired):  # held without reentrant=True: not re-entered either
            with distlock.lock(lock_name, blocking=False, using=backend_alias, reentrant=True):
                pass


def test_a_lost_or_released_lease_is_not_reentered(backend_alias, lock_name, round_trips):
    with distlock.lock(lock_name, ttl=30, using=backend_alias, reentrant=True) as outer:
        outer.mark_lost("lost for the test")
        with pytest.raises(LockLost, match="lost for the test"):
            with distlock.lock(lock_name, blocking=False, using=backend_alias, reentrant=True):
                pass
        assert round_trips["acquire"] == 1, "a re-entry of a lost lease went to the server"
    assert depth(backend_alias, lock_name) == 0
    assert free(backend_alias, lock_name)

    with distlock.lock(lock_name, ttl=30, using=backend_alias, reentrant=True) as outer:
        with distlock.lock(lock_name, blocking=False, using=backend_alias, reentrant=True):
            outer.release()
            assert depth(backend_alias, lock_name) == 0
            with pytest.raises(LockLost, match="release"):
                with distlock.lock(lock_name, blocking=False, using=backend_alias, reentrant=True):
                    pass
    assert free(backend_alias, lock_name)


def test_an_expired_lease_is_not_reentered(backend_alias, lock_name):
    with distlock.lock(lock_name, ttl=0.3, using=backend_alias, auto_renew=False, reentrant=True) as outer:
        wait_until(lambda: outer.lost, 10, "the lease's expiry")
        with pytest.raises(LockLost, match="expired"):
            with distlock.lock(lock_name, blocking=False, using=backend_alias, reentrant=True):
                pass


def test_an_exception_in_the_inner_block_propagates_and_the_outer_still_holds(backend_alias, lock_name):
    with distlock.lock(lock_name, ttl=30, using=backend_alias, reentrant=True) as outer:
        with pytest.raises(ValueError, match="inner"):
            with distlock.lock(lock_name, blocking=False, using=backend_alias, reentrant=True):
                raise ValueError("inner")
        assert depth(backend_alias, lock_name) == 1
        outer.check()
        assert not free(backend_alias, lock_name)
    assert free(backend_alias, lock_name)


def test_the_outer_blocks_settings_win(backend_alias, lock_name):
    with distlock.lock(lock_name, ttl=30, using=backend_alias, auto_renew=False, reentrant=True) as outer:
        with distlock.lock(lock_name, ttl=300, using=backend_alias, auto_renew=True, reentrant=True) as inner:
            assert inner is outer
            assert inner.ttl == 30 and inner.renewer is None


def test_a_keyboard_interrupt_landing_in_a_reentry_leaves_the_depth_right(backend_alias, lock_name, monkeypatch):
    real = reentrancy.enter_again
    interrupts = []

    def interrupted_once(lease, entry):
        entered = real(lease, entry)  # the depth went up: now the interrupt lands
        if not interrupts:
            interrupts.append(entered)
            raise KeyboardInterrupt
        return entered

    monkeypatch.setattr(reentrancy, "enter_again", interrupted_once)
    guard = distlock.lock(lock_name, blocking=False, using=backend_alias, reentrant=True)
    with distlock.lock(lock_name, ttl=30, using=backend_alias, reentrant=True) as outer:
        with pytest.raises(KeyboardInterrupt):
            with guard:
                pytest.fail("the block ran although its entry was interrupted")
        assert depth(backend_alias, lock_name) == 1
        with guard as inner:
            assert inner is outer
            assert depth(backend_alias, lock_name) == 2
        assert depth(backend_alias, lock_name) == 1
    assert outer.released
    assert free(backend_alias, lock_name)


def test_a_keyboard_interrupt_landing_as_the_outermost_block_records_its_lease_gives_it_back(
        backend_alias, lock_name, monkeypatch):
    real = reentrancy.hold
    held = []

    def interrupted(lease):
        real(lease)
        held.append(lease)
        raise KeyboardInterrupt

    monkeypatch.setattr(reentrancy, "hold", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with distlock.lock(lock_name, ttl=30, using=backend_alias, reentrant=True):
            pytest.fail("the block ran although its entry was interrupted")
    assert held[0].released
    assert depth(backend_alias, lock_name) == 0
    assert free(backend_alias, lock_name)


def test_reentering_is_never_a_hierarchy_violation(backend_alias, lock_name, settings):
    settings.DISTLOCK_HIERARCHY = ["bank:", "account:"]
    bank, account = f"bank:{lock_name}", f"account:{lock_name}"
    with distlock.lock(bank, ttl=30, using=backend_alias, reentrant=True) as outer:
        with distlock.lock(account, ttl=30, using=backend_alias):
            with distlock.lock(bank, blocking=False, using=backend_alias, reentrant=True) as inner:
                assert inner is outer
            with pytest.raises(LockOrderError):  # a plain lock of the coarser name is still checked
                distlock.acquire(bank, blocking=False, using=backend_alias)


def test_bad_reentrant_arguments_are_refused_before_any_io():
    with pytest.raises(TypeError, match="reentrant must be True or False"):
        distlock.lock("x", reentrant="yes")
    with pytest.raises(TypeError, match="read_lock\\(\\) cannot be reentrant"):
        distlock.read_lock("x", reentrant=True)
    with pytest.raises(TypeError):
        distlock.acquire("x", reentrant=True)


def _in_a_forked_child(probe):
    """Run ``probe`` in a child forked here; return what it wrote (its result's repr, or the exception's type)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then end without running any test teardown
        try:
            os.close(read)
            try:
                outcome = repr(probe())
            except Exception as error:  # noqa: BLE001 - the parent asserts on which one
                outcome = type(error).__name__
            os.write(write, outcome.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as child_report:
        outcome = child_report.read()
    os.waitpid(pid, 0)
    return outcome


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
@pytest.mark.django_db(transaction=True, databases="__all__")
@pytest.mark.parametrize("alias", ["default", "redis"])
def test_a_child_forked_inside_a_reentrant_block_does_not_reenter_its_parent_s_lock(alias, lock_name):
    require_alias(alias)
    with distlock.lock(lock_name, ttl=30, using=alias, reentrant=True):
        def reenter():
            with distlock.lock(lock_name, blocking=False, using=alias, reentrant=True):
                return "entered"

        assert _in_a_forked_child(reenter) == "LockNotAcquired"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
@pytest.mark.django_db(transaction=True, databases="__all__")
def test_a_child_forked_inside_a_block_does_not_count_its_parent_s_lock_for_the_hierarchy(lock_name, settings):
    settings.DISTLOCK_HIERARCHY = ["bank:", "account:"]
    with distlock.lock(f"account:{lock_name}", ttl=30):
        def take_the_coarser_level():
            with distlock.lock(f"bank:{lock_name}", blocking=False):
                return "taken"

        assert _in_a_forked_child(take_the_coarser_level) == "'taken'"
