"""Green threads: whether this process runs on them (kazoo and gRPC need to know), and background loops that
a forked child can stop."""

import sys
import threading


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


def killed(exc):
    """Return True if ``exc`` is the ``GreenletExit`` that ends a greenlet on purpose (``Daemon.end_in_child``)."""
    return type(exc).__name__ == "GreenletExit"


class Daemon:
    """A background loop: a daemon thread, or a plain greenlet in a gevent-patched process.

    A forked child has no thread but the caller's, yet every greenlet of the parent runs on in it: the
    parent's loops would work there, on the parent's connections. Their owner ends them in the child
    with ``end_in_child()``. Plain greenlets, because a ``threading.Thread`` whose greenlet ends in the
    child fails with ``KeyError`` (the child's ``threading`` no longer lists it).
    """

    def __init__(self, target, *args, name):
        self._greenlet = None
        if green_library() == "gevent":
            import gevent  # noqa: PLC0415 - only under gevent

            self._greenlet = self._runner = gevent.Greenlet(target, *args)
            self._greenlet.name = name
        else:
            self._runner = threading.Thread(target=target, args=args, name=name, daemon=True)

    def start(self):
        self._runner.start()

    def is_alive(self):
        if self._greenlet is not None:
            return bool(self._greenlet)  # started and not finished
        return self._runner.is_alive()

    def join(self, timeout=None):
        self._runner.join(timeout)

    def is_current(self):
        """True when called from this loop itself (which must not join itself)."""
        if self._greenlet is not None:
            import gevent  # noqa: PLC0415 - only under gevent

            return gevent.getcurrent() is self._greenlet
        return threading.current_thread() is self._runner

    def end_in_child(self):
        """In a forked child: end the parent's greenlet at its next switch, with ``GreenletExit``, without waiting.

        Only schedules the kill: an at-fork hook must not switch greenlets. A thread is not in the child.
        """
        if self._greenlet is not None:
            self._greenlet.kill(block=False)
