"""Waiting for another thread without a lock that an interrupt can leave behind.

An exception raised by a signal handler (Celery's soft time limit, a ``gevent.Timeout``, Ctrl-C) can
stop a caller between any two Python lines, including the lines of ``threading.Condition`` and
``threading.Event``: stopped at the start of ``Condition.__exit__``, a caller keeps the condition's
lock for good and every thread that notifies it (a backend's own I/O thread) blocks forever; stopped
inside ``Condition.wait``, it comes out with ``RuntimeError`` instead of its interrupt, or without
the lock it believes it holds. The waits here block only in a queue's ``get`` (``mailbox()``),
which an interrupt leaves as it was, and notifiers only ``put``, which never blocks.
"""

import queue
import time

from distlock.backends.green import mailbox

__all__ = ["Wakeups", "mailbox"]


class Wakeups:
    """Wake every thread waiting for a condition on shared state, which notifiers change before waking them."""

    def __init__(self):
        self._mailboxes = set()

    def wait_for(self, predicate, timeout=None):
        """Return ``predicate()`` once it is true, or its value after ``timeout`` seconds (None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        box = mailbox()
        try:
            self._mailboxes.add(box)  # before the first test: a change after it wakes this mailbox
            while not (result := predicate()):
                if deadline is None:
                    box.get()
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return result
                try:
                    box.get(timeout=remaining)
                except queue.Empty:
                    pass
            return result
        finally:
            self._mailboxes.discard(box)

    def notify_all(self):
        """Wake every waiter to test its predicate again; call it after changing the state."""
        for box in tuple(self._mailboxes):  # a copy taken under the GIL: waiters come and go
            box.put(None)

