"""The asyncio API: ``aacquire()``, ``alock()`` and the ``Lease.a*`` methods, on every backend alias.

Each test runs its coroutines with ``asyncio.run`` (the suite has no asyncio plugin).
"""

import asyncio
import gc
import os
import threading
import time

import pytest
from django.test import override_settings

import distlock
from distlock import Lease, LockNotAcquired, LockOrderError, reentrancy
from distlock.handler import locks
from tests.conftest import free, record_tries
from tests.servers import wait_until

#: Coroutines contending for one lock, as in the issue's acceptance test.
CONTENDERS = 50

#: The longest the event loop may go without running a ready task while they contend.
MAX_LOOP_LAG = 0.05

#: Seconds to see a cancelled waiter's leftovers gone: below the WAITER_TTL (2 s) of the Redis and the
#: database queues, so a place a cancelled waiter failed to withdraw cannot expire meanwhile and pass
#: for withdrawn.
LEFTOVERS_GONE_WITHIN = 1.0


def run(coroutine):
    return asyncio.run(coroutine)


@pytest.fixture
def tries(backend_alias, monkeypatch):
    """The owners whose tries reached the alias's backend, one entry per try (each try still goes to the server)."""
    return record_tries(locks[backend_alias], monkeypatch)


class CpuWait:
    """Seconds the threads of this process have spent ready to run but waiting for a CPU (Linux schedstat)."""

    def __init__(self):
        self._files = {}  # thread id -> open schedstat file

    def __call__(self):
        waited = 0
        try:
            threads = os.listdir("/proc/self/task")
        except OSError:  # not Linux: nothing to subtract
            return 0.0
        for tid in threads:
            try:
                if tid not in self._files:
                    self._files[tid] = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
                waited += int(os.pread(self._files[tid], 100, 0).split()[1])
            except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
                pass
        return waited / 1e9

    def close(self):
        for descriptor in self._files.values():
            os.close(descriptor)


async def probe_loop_lag(stop, lags, interval=0.005):
    """Record by how much each ``interval`` sleep of a task overran: how long the loop could not run it.

    Less the time the kernel kept the process's threads waiting for a CPU meanwhile (the loop's own,
    and the worker or client thread holding the GIL the loop waits for): on a machine busy with other
    processes that delays any program, whatever runs on its loop. A loop blocked by a server call, a
    sleep or a lock wait is not waiting for a CPU, and counts in full.
    """
    loop = asyncio.get_running_loop()
    cpu_wait = CpuWait()
    try:
        while not stop.is_set():
            before, waited = loop.time(), cpu_wait()
            await asyncio.sleep(interval)
            lags.append(loop.time() - before - interval - (cpu_wait() - waited))
    finally:
        cpu_wait.close()


# -- mutual exclusion, loop lag -----------------------------------------------------------------------------

def test_fifty_coroutines_never_overlap_and_the_loop_is_never_blocked(backend_alias, lock_name):
    intervals, lags = [], []

    @distlock.alock(lock_name, ttl=30, timeout=60, using=backend_alias)
    async def critical_section():
        entered = time.monotonic()
        await asyncio.sleep(0.001)  # yield inside: another coroutine let in now would overlap
        intervals.append((entered, time.monotonic()))

    async def scenario():
        stop = asyncio.Event()
        probe = asyncio.create_task(probe_loop_lag(stop, lags))
        try:
            await asyncio.gather(*(critical_section() for _ in range(CONTENDERS)))
        finally:
            stop.set()
            await probe

    # A full collection of this process's heap (pytest, Django, every client library) holds the GIL for
    # hundreds of ms on a busy machine whichever thread runs it: a pause of the interpreter, not of the
    # locks. The heap as it is is left out of collections for the run; what the run allocates is not.
    gc.collect()
    gc.freeze()
    try:
        run(scenario())
    finally:
        gc.unfreeze()
    assert len(intervals) == CONTENDERS
    ordered = sorted(intervals)
    overlaps = [(a, b) for a, b in zip(ordered, ordered[1:]) if b[0] < a[1]]
    assert not overlaps
    assert lags, "the probe never ran"
    assert max(lags) < MAX_LOOP_LAG, f"the event loop was blocked for {max(lags) * 1000:.0f} ms"
    assert free(backend_alias, lock_name)


def test_no_server_call_runs_on_the_loop_thread(backend_alias, lock_name, monkeypatch):
    """Whatever the server's speed: the loop's thread makes no call that waits for it."""
    backend = locks[backend_alias]
    callers = []
    for hook in ("_try_acquire", "_do_release", "_do_extend", "_give_up", "_give_back"):
        real = getattr(backend, hook)

        def recorded(*args, _real=real, _hook=hook, **kwargs):
            callers.append((_hook, threading.get_ident()))
            return _real(*args, **kwargs)

        monkeypatch.setattr(backend, hook, recorded)

    async def scenario():
        lease = await distlock.aacquire(lock_name, ttl=30, using=backend_alias)
        with pytest.raises(LockNotAcquired):
            await distlock.aacquire(lock_name, ttl=30, timeout=0.05, using=backend_alias)
        waiter = asyncio.create_task(distlock.aacquire(lock_name, ttl=30, using=backend_alias))
        while sum(hook == "_try_acquire" for hook, _ in callers) < 3:
            await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await lease.aextend()
        await lease.arelease()
        return threading.get_ident()

    loop_thread = run(scenario())
    assert {hook for hook, _ in callers} >= {"_try_acquire", "_do_release", "_do_extend", "_give_up"}
    assert [hook for hook, caller in callers if caller == loop_thread] == []


# -- cancellation ----------------------------------------------------------------------------------------------

def test_cancelled_waiters_leave_nothing_behind(backend_alias, lock_name, tries):
    holder = distlock.acquire(lock_name, ttl=30, using=backend_alias)
    waiters = 5

    async def scenario():
        tasks = [asyncio.create_task(distlock.aacquire(lock_name, ttl=30, using=backend_alias))
                 for _ in range(waiters)]
        # Each has tried twice: queued where the server keeps a queue, and waiting.
        while len({owner for owner in tries if tries.count(owner) >= 2}) < waiters:
            assert not any(task.done() for task in tasks)
            await asyncio.sleep(0.01)
        for task in tasks:
            task.cancel()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(outcome, asyncio.CancelledError) for outcome in outcomes)

    try:
        run(scenario())
    finally:
        holder.release()
    wait_until(lambda: free(backend_alias, lock_name), LEFTOVERS_GONE_WITHIN, "the lock free for a newcomer")
    assert not list(locks[backend_alias].held_locks(lock_name))


def test_a_cancel_while_a_successful_try_is_in_flight_gives_its_grant_back(backend_alias, lock_name, monkeypatch):
    backend = locks[backend_alias]
    real = backend._try_acquire
    granted, proceed = threading.Event(), threading.Event()

    def try_acquire(attempt):
        grant = real(attempt)  # the server grants the lock...
        granted.set()
        proceed.wait(10)  # ...and the reply is still on its way when the coroutine is cancelled
        return grant

    monkeypatch.setattr(backend, "_try_acquire", try_acquire)

    async def scenario():
        task = asyncio.create_task(distlock.aacquire(lock_name, ttl=30, using=backend_alias))
        assert await asyncio.to_thread(granted.wait, 10)
        task.cancel()
        proceed.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(scenario())
    monkeypatch.setattr(backend, "_try_acquire", real)
    assert free(backend_alias, lock_name)  # given back before the CancelledError reached the caller
    assert not list(backend.held_locks(lock_name))


def test_a_coroutine_closed_while_a_successful_try_is_in_flight_gives_its_grant_back(backend_alias, lock_name,
                                                                                     monkeypatch):
    """``coroutine.close()`` (GeneratorExit) cannot await the clean-up: it runs on its own, all the same."""
    backend = locks[backend_alias]
    real = backend._try_acquire
    granted, proceed = threading.Event(), threading.Event()

    def try_acquire(attempt):
        grant = real(attempt)
        granted.set()
        proceed.wait(10)
        return grant

    monkeypatch.setattr(backend, "_try_acquire", try_acquire)

    async def scenario():
        coroutine = distlock.aacquire(lock_name, ttl=30, using=backend_alias)
        awaited = coroutine.send(None)  # runs up to its first await: the try, on a worker thread
        assert await asyncio.to_thread(granted.wait, 10)
        coroutine.close()
        proceed.set()
        assert not awaited.cancelled()

    run(scenario())
    monkeypatch.setattr(backend, "_try_acquire", real)
    wait_until(lambda: free(backend_alias, lock_name), LEFTOVERS_GONE_WITHIN, "the grant given back")


def test_a_cancel_inside_the_block_releases_the_lock(backend_alias, lock_name):
    async def scenario():
        entered = asyncio.Event()

        async def hold():
            async with distlock.alock(lock_name, ttl=30, using=backend_alias):
                entered.set()
                await asyncio.sleep(60)

        task = asyncio.create_task(hold())
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(scenario())
    assert free(backend_alias, lock_name)


# -- the sync API's arguments, exceptions and lease -------------------------------------------------------

def test_the_same_exceptions_and_lease_as_the_sync_api(backend_alias, lock_name):
    async def scenario():
        lease = await distlock.aacquire(lock_name, ttl=30, using=backend_alias)
        assert isinstance(lease, Lease)
        assert (lease.name, lease.alias, lease.ttl) == (lock_name, backend_alias, 30)
        assert lease.token_is_safe == locks[backend_alias].token_is_safe
        await lease.acheck()
        with pytest.raises(LockNotAcquired, match="held \\(non-blocking attempt\\)"):
            await distlock.aacquire(lock_name, ttl=30, blocking=False, using=backend_alias)
        with pytest.raises(LockNotAcquired, match="still held after 0.2s"):
            async with distlock.alock(lock_name, ttl=30, timeout=0.2, using=backend_alias):
                pass  # never entered
        assert await lease.aextend(20) is True
        assert await lease.arelease() is True
        assert await lease.arelease() is False
        assert await lease.aextend() is False
        async with distlock.alock(lock_name, ttl=30, timeout=5, using=backend_alias) as again:
            assert again.token > lease.token
        async with await distlock.aacquire(lock_name, ttl=30, using=backend_alias) as third:
            assert not third.released
        assert third.released

    run(scenario())
    assert free(backend_alias, lock_name)


def test_arguments_are_checked_before_any_io():
    with pytest.raises(ValueError, match="ttl must be above zero"):
        run(distlock.aacquire("report", ttl=-1, using="locmem"))
    with pytest.raises(TypeError, match="blocking must be True or False"):
        run(distlock.aacquire("report", blocking="yes", using="locmem"))
    with pytest.raises(ValueError, match="must not be empty"):
        distlock.alock("")
    with pytest.raises(TypeError, match="reentrant must be True or False"):
        distlock.alock("report", reentrant="yes")


def test_alock_decorates_only_an_async_def():
    with pytest.raises(TypeError, match="decorates an async def.*use lock\\(\\)"):
        @distlock.alock("report", using="locmem")
        def report():  # never called
            pass


def test_one_alock_object_serves_many_tasks(lock_name):
    """A module-level ``alock`` used by concurrent tasks: each block releases its own lease."""
    shared = distlock.alock(lock_name, ttl=30, timeout=10, using="locmem")
    tokens = []

    async def use():
        async with shared as lease:
            await asyncio.sleep(0.001)
            tokens.append(lease.token)
            assert not lease.released

    async def scenario():
        await asyncio.gather(*(use() for _ in range(10)))

    run(scenario())
    assert len(set(tokens)) == 10
    assert free("locmem", lock_name)


# -- reentrancy and DISTLOCK_HIERARCHY ----------------------------------------------------------------------

def test_reentrant_alock_reenters_in_its_task_only(lock_name):
    outer_lock = distlock.alock(lock_name, ttl=30, using="locmem", reentrant=True)

    async def scenario():
        async with outer_lock as outer:
            async with distlock.alock(lock_name, ttl=30, using="locmem", reentrant=True) as inner:
                assert inner is outer
                assert reentrancy.depth(lock_name, "locmem") == 2

            async def other_task():
                async with distlock.alock(lock_name, ttl=30, timeout=0, using="locmem", reentrant=True):
                    pass  # never entered

            with pytest.raises(LockNotAcquired):
                await asyncio.create_task(other_task())
            assert not outer.released
        assert outer.released

    run(scenario())
    assert free("locmem", lock_name)


def test_reentrant_decorator_reenters(lock_name):
    depths = []

    @distlock.alock(lock_name, ttl=30, using="locmem", reentrant=True)
    async def recurse(n):
        depths.append(reentrancy.depth(lock_name, "locmem"))
        if n:
            await recurse(n - 1)

    run(recurse(2))
    assert depths == [1, 2, 3]
    assert free("locmem", lock_name)


@override_settings(DISTLOCK_HIERARCHY=["region:", "account:"])
def test_the_hierarchy_check_fires_for_alock(lock_name):
    async def scenario():
        async with distlock.alock(f"account:{lock_name}", ttl=30, using="locmem"):
            with pytest.raises(LockOrderError, match="coarser than lock"):
                async with distlock.alock(f"region:{lock_name}", ttl=30, using="locmem"):
                    pass  # never entered
        async with distlock.alock(f"region:{lock_name}", ttl=30, using="locmem"):
            async with distlock.alock(f"account:{lock_name}", ttl=30, using="locmem"):
                pass

    run(scenario())
