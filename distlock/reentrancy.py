"""Re-entering a lock the caller already holds: the record behind ``lock(name, reentrant=True)``.

**Who re-enters.** The *runner* that took the lock with ``reentrant=True``: the asyncio task it
runs in, else the greenlet (under gevent or eventlet), else the thread; and, inside a Celery task
run, only that run (``distlock.holder.current_task_id``). The record lives in the runner's
``contextvars`` context (``held.HeldLeases``) and each entry names its runner, because a context
can be copied: an asyncio task starts with a copy of its creator's, ``sync_to_async`` runs a copy
in another thread. Such a copy does **not** re-enter its creator's locks: the two run at the same
time, and letting both into the critical section is what the lock forbids. It goes to the server
like any other contender, as two threads of one Celery task run do. The task id keeps one worker
thread (prefork, threads pool) from re-entering, in a task run, a hold an earlier run left behind.

**What re-entry does.** No server round trip: the depth of the entry goes up by one and the block
gets the same ``Lease``, token included. The lease's settings are the outer block's (``ttl``,
``auto_renew``, ``max_hold``); an inner block's own are ignored, as a nested ``transaction.atomic()``
joins the outer transaction: a reentrant helper must work whatever its callers chose. A lease that
is lost, expired or released is not re-entered: ``LockLost`` (``LockSuspended`` while a session is
uncertain), fail closed. Re-entering is never a ``DISTLOCK_HIERARCHY`` violation: it waits for
nothing. Only locks taken with ``reentrant=True`` are re-entered, only by ``reentrant=True``:
a plain ``lock()`` or ``acquire()`` of a name the runner holds goes to the server and waits like
any other contender, as without reentrancy.

**Interrupts.** Every change to the record is one ``ContextVar.set`` of an immutable tuple, made in
an order that an exception landing between any two lines cannot turn into a wrong "held": the
outermost exit releases the lease first (``Lease.release`` marks it released before any I/O), then
forgets it, and a released lease is never re-entered; an entry whose lease was collected counts no
more. What is left is the first instant of an exit, before its one ``set``, as for ``lock()``
without reentrancy: the depth stays one higher and the lock is held until the lease is collected
(its renewal stops then) and the server frees it at its ttl.
"""

import asyncio
import sys
import threading
import weakref
from typing import NamedTuple

from distlock.exceptions import LockLost
from distlock.held import HeldLeases
from distlock.holder import current_task_id

__all__ = ["Entry", "depth", "enter_again", "forget", "hold", "held", "leave", "restore", "snapshot"]


class Entry(NamedTuple):
    """What the record keeps beside a reentrant lease: whose it is and how many blocks hold it."""

    runner: weakref.ref
    task_id: str
    depth: int


#: The leases this context holds reentrantly, each with its ``Entry``. A released lease keeps its
#: entry until the outermost block forgets it, so the blocks inside still find their depth.
_record = HeldLeases("distlock_reentrant_leases", keep_released=True)


def _runner():
    """Return the asyncio task, else the greenlet, else the thread, that is running the caller."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no event loop runs in this thread
        task = None
    if task is not None:
        return task
    green = sys.modules.get("greenlet")  # imported by gevent and eventlet; never imported here
    if green is not None:
        return green.getcurrent()  # a thread's own code runs in its main greenlet
    return threading.current_thread()


def held(alias, name):
    """Return ``(lease, Entry)`` of the caller's reentrant hold of ``name`` on ``alias``, or None.

    The lease may be lost or released: the caller decides.
    """
    runner, task_id = _runner(), current_task_id.get()
    for lease, entry in _record.entries():
        if lease.name == name and lease.alias == alias and entry.runner() is runner and entry.task_id == task_id:
            return lease, entry
    return None


def depth(name, alias):
    """Return how many reentrant blocks of the caller hold lock ``name`` on ``alias`` (0: none, or released)."""
    found = held(alias, name)
    return 0 if found is None or found[0].released else found[1].depth


def snapshot():
    """Return the record as it is, for ``restore()`` when an interrupted enter must be undone."""
    return _record.snapshot()


def restore(before):
    """Put back the record ``snapshot()`` returned (one set)."""
    _record.restore(before)


def hold(lease):
    """Record the caller's new reentrant ``lease`` at depth 1 (one set)."""
    _record.add(lease, Entry(weakref.ref(_runner()), current_task_id.get(), 1))


def enter_again(lease, entry):
    """Re-enter the hold ``held()`` found: check its lease, count one more block (one set), return the lease.

    :raises LockLost: the lease was released, or is lost or expired (``Lease.check()``).
    :raises LockSuspended: its session is uncertain.
    """
    if lease.released:
        raise LockLost(f"Lock {lease.name!r} (token {lease.token}) is not re-entered: release() was called on "
                       f"its lease inside the reentrant block that holds it.")
    lease.check()
    _record.replace(lease, entry._replace(depth=entry.depth + 1))
    return lease


def leave(lease, entry):
    """Count one block of ``lease`` fewer (one set); the outermost block calls ``forget()`` instead."""
    _record.replace(lease, entry._replace(depth=entry.depth - 1))


def forget(lease):
    """Drop the entry of ``lease`` (one set), once the outermost block released it."""
    _record.remove(lease)
