"""Green threads: whether this process runs on them (kazoo and gRPC need to know), and background loops that
a forked child can stop."""

import os
import queue
import sys
import threading
import weakref

__all__ = ["Daemon", "ForkedChildHook", "green_library", "killed", "mailbox"]


def green_library():
    """Return "gevent" or "eventlet" if that library monkey-patched ``socket`` in this process, else None."""
    if "gevent" in sys.modules:
        from gevent import monkey  # noqa: PLC0415 - only in a process that imported gevent

        if monkey.is_module_patched("socket"):
            return "gevent"
    if "eventlet" in sys.modules:
        from eventlet import patcher  # noqa: PLC0415 - only in a process that imported eventlet

        if patcher.is_monkey_patched("socket"):
            return "eventlet"
    return None


def mailbox():
    """Return a queue for handing things to a waiting thread: ``put`` never blocks, ``get`` keeps no lock.

    The C ``SimpleQueue`` (gevent's, once gevent patched ``queue``). eventlet leaves ``SimpleQueue``
    alone, and a wait in C would stall every green thread of the process: there, eventlet's queue.
    """
    if green_library() == "eventlet":
        from eventlet.queue import LightQueue  # noqa: PLC0415 - only in an eventlet process

        return LightQueue()
    return queue.SimpleQueue()



class ForkedChildHook:
    """Objects of one kind that must forget, in a forked child, what is the parent's (threads, sockets, locks).

    The one fork idiom of distlock: a module makes one hook per kind at import, naming the method to
    call, and adds each object it makes. Objects are held weakly; kinds run in the order their
    modules were imported (``os.register_at_fork`` keeps that order).
    """

    def __init__(self, method):
        self._method = method
        self._owners = weakref.WeakSet()
        os.register_at_fork(after_in_child=self._in_child)

    def add(self, owner):
        self._owners.add(owner)

    def _in_child(self):
        for owner in list(self._owners):
            getattr(owner, self._method)()


def killed(exc):
    """Return True if ``exc`` is the ``GreenletExit`` that ends a greenlet on purpose (``Daemon.end_in_child``)."""
    return type(exc).__name__ == "GreenletExit"


class _UnwaitedThread(threading.Thread):
    """A daemon thread whose ``start()`` does not wait for it to run (see ``Daemon``)."""

    def start(self):
        if not _CAN_START_UNWAITED:
            super().start()
            return
        calling = False
        try:
            with threading._active_limbo_lock:  # noqa: SLF001 - what Thread.start() does, minus its wait
                threading._limbo[self] = self  # noqa: SLF001
            calling = True
            threading._start_new_thread(self._bootstrap, ())  # noqa: SLF001
        except RuntimeError:
            self._unlist()  # "can't start new thread": as CPython's Thread.start() does
            raise
        except BaseException:
            # An interrupt (a time limit, which may be an ``Exception``). Landing as
            # ``_start_new_thread`` returned, it finds the thread running, which lists itself out:
            # taken out here, the thread died on KeyError in its bootstrap before running anything.
            if not calling:
                self._unlist()
            raise

    def _unlist(self):
        with threading._active_limbo_lock:  # noqa: SLF001
            threading._limbo.pop(self, None)  # noqa: SLF001


#: The internals ``_UnwaitedThread.start`` uses exist (CPython 3.11 and 3.12); elsewhere it waits as usual.
_CAN_START_UNWAITED = all(hasattr(threading, name) for name in ("_active_limbo_lock", "_limbo", "_start_new_thread"))


class Daemon:
    """A background loop: a daemon thread, or a plain greenlet in a gevent-patched process.

    A forked child has no thread but the caller's, yet every greenlet of the parent runs on in it: the
    parent's loops would work there, on the parent's connections. Their owner ends them in the child
    with ``end_in_child()``. Plain greenlets, because a ``threading.Thread`` whose greenlet ends in the
    child fails with ``KeyError`` (the child's ``threading`` no longer lists it).

    ``threading.Thread.start()`` waits on a ``Condition`` until the new thread runs; an exception
    raised in the caller by a signal handler inside that wait (a time limit landing as a lock is
    granted and its renewal starts) comes out as ``RuntimeError: release unlocked lock`` instead of
    itself. A ``Daemon``'s start does not wait, and its ``is_alive`` and ``join`` rest on its own flag
    and a queue, which an interrupt leaves as they were.
    """

    def __init__(self, target, *args, name):
        self._target, self._args = target, args
        self._greenlet = self._thread = None
        self._alive = False
        self._ended = mailbox()
        if green_library() == "gevent":
            import gevent  # noqa: PLC0415 - only under gevent

            self._greenlet = gevent.Greenlet(target, *args)
            self._greenlet.name = name
        else:
            self._thread = _UnwaitedThread(target=self._run, name=name, daemon=True)

    def start(self):
        if self._greenlet is not None:
            self._greenlet.start()
            return
        try:
            self._alive = True  # before the thread runs: a second start() must see it alive
            self._thread.start()
        except BaseException:
            self._alive = False
            raise

    def _run(self):
        try:
            self._target(*self._args)
        finally:
            self._alive = False
            self._ended.put(None)

    def is_alive(self):
        if self._greenlet is not None:
            return bool(self._greenlet)  # started and not finished
        return self._alive

    def join(self, timeout=None):
        if self._greenlet is not None:
            self._greenlet.join(timeout)
            return
        if not self._alive:
            return
        try:
            self._ended.get(timeout=timeout)
            self._ended.put(None)  # for any other joiner
        except queue.Empty:
            pass

    def is_current(self):
        """True when called from this loop itself (which must not join itself)."""
        if self._greenlet is not None:
            import gevent  # noqa: PLC0415 - only under gevent

            return gevent.getcurrent() is self._greenlet
        return threading.current_thread() is self._thread

    def end_in_child(self):
        """In a forked child: end the parent's greenlet at its next switch, with ``GreenletExit``, without waiting.

        Only schedules the kill: an at-fork hook must not switch greenlets. A thread is not in the child.
        """
        if self._greenlet is not None:
            self._greenlet.kill(block=False)
        else:
            self._alive = False
