"""The database backend's own connections: lent to one call at a time, in arrival order, release and extend first."""

import collections
import queue
import threading
import time
import weakref
from contextlib import suppress

from distlock.backends.green import ForkedChildHook, mailbox

__all__ = ["ConnectionPool"]


#: Every pool: a forked child forgets the parent's connections.
_POOLS = ForkedChildHook("_forget_all")


class ConnectionPool:
    """The backend's own connections, each checked out by one call at a time and given back after it.

    Nothing is keyed by thread: OS thread idents and greenlet addresses are reused as soon as their
    thread ends, so a table keyed by them hands one caller's connection to another, and sweeping
    "dead" threads closes connections that live greenlets (invisible to ``threading.enumerate()``)
    are using mid-statement. Here only the caller that checked a connection out uses it, and only that
    caller closes it. At most ``size`` connections are open per process. A call that finds them all
    busy queues, and connections given back go to the queue in arrival order, except that calls which
    free or keep a lock (release, extend) go first: without that, threads that try a lock back to
    back take every returned connection again at once, and the holder's release waits behind them.
    After a fork the child forgets the parent's connections without closing them (closing would talk
    on the parent's sockets) and opens its own.
    """

    def __init__(self, connect, disconnect, size):
        #: ``connect()`` returns a new, not yet connected wrapper; ``disconnect(wrapper)`` closes one.
        self._connect, self._disconnect = connect, disconnect
        self.size = size
        self._forget_all()
        _POOLS.add(self)

    def _forget_all(self):
        # A new lock too: another thread of the parent may have held the old one during fork().
        self._lock = threading.Lock()
        self._idle = []      # wrappers nobody uses (connected, or closed and to reconnect), most recent last
        #: wrapper -> the generation it was checked out in. Weak: a wrapper an interrupt cut loose between
        #: the pool and its caller frees its place once collected (collecting it closes its connection).
        self._in_use = weakref.WeakKeyDictionary()
        self._queue = collections.deque()  # _Turn of each call waiting for a connection, in arrival order
        self._generation = object()  # replaced by close(): wrappers of an older one are closed on return

    def connection(self, ends, unavailable, *, urgent=False):
        """Return a context manager lending a wrapper nobody else uses until its block ends.

        It waits until ``ends`` for a free one; an ``urgent`` call queues ahead of the others (behind
        earlier urgent ones). ``unavailable(waited)`` builds the exception raised when all stay busy.
        A block that raises anything closes its wrapper (its state is unknown) instead of giving it back.
        """
        return _Loan(self, ends, unavailable, urgent)

    def _check_out(self, ends, unavailable, urgent):
        started = time.monotonic()
        turn = _Turn(urgent)
        try:
            with self._lock:
                if not self._queue and (self._idle or len(self._in_use) < self.size):
                    return self._hand_out(self._idle.pop() if self._idle else self._connect())
                if urgent:
                    # Behind the urgent turns already queued, ahead of every other one.
                    position = next((i for i, queued in enumerate(self._queue) if not queued.urgent),
                                    len(self._queue))
                    self._queue.insert(position, turn)
                else:
                    self._queue.append(turn)
            # The wait holds no lock (see distlock.waiting): an interrupt only has to withdraw the turn.
            with suppress(queue.Empty):
                return turn.mailbox.get(timeout=max(ends - time.monotonic(), 0.0))
            if self._withdraw(turn):
                raise unavailable(time.monotonic() - started)
            return turn.mailbox.get_nowait()  # handed over just as the wait ran out
        except BaseException:
            self._give_up_turn(turn)
            raise

    def _withdraw(self, turn):
        """Take ``turn`` out of the queue (if there); False if a connection was handed to it already."""
        with self._lock:
            if turn.given:
                return False
            with suppress(ValueError):
                self._queue.remove(turn)
            return True

    def _give_up_turn(self, turn):
        """Withdraw the turn of a call that raised; a connection handed to it meanwhile goes back."""
        if not self._withdraw(turn):
            with suppress(queue.Empty):  # empty if the call had taken it before it raised
                self._give_back(turn.mailbox.get_nowait())

    def _hand_out(self, wrapper):
        self._in_use[wrapper] = self._generation
        return wrapper

    def _give_back(self, wrapper, broken=False):
        with self._lock:
            generation = self._in_use.pop(wrapper, None)
            if generation is None:
                return  # checked out before a fork: the parent's, not ours to close
            reusable = not broken and generation is self._generation
            while self._queue and self._queue[0].given:
                self._queue.popleft()  # handed over by a giver an interrupt stopped before it could dequeue
            if self._queue:
                # Whoever waits longest gets it (or, for one that must be closed, a new wrapper). Marked
                # given before the put, dequeued after it: no interrupt in between loses the connection.
                turn = self._queue[0]
                handed = wrapper if reusable else self._connect()
                self._in_use[handed] = self._generation
                turn.given = True
                turn.mailbox.put(handed)
                self._queue.popleft()
            elif reusable:
                self._idle.append(wrapper)
        if not reusable:
            self._disconnect(wrapper)

    def close(self):
        """Close the idle connections now; those in use are closed when their call gives them back."""
        with self._lock:
            idle, self._idle = self._idle, []
            self._generation = object()
        for wrapper in idle:
            self._disconnect(wrapper)


class _Loan:
    """One use of a pooled connection: a class, not a generator, so that nothing of it runs at garbage
    collection. A generator an interrupt left suspended gives its wrapper back when collected, at any
    point of any thread, possibly one holding the pool's lock: a deadlock."""

    def __init__(self, pool, ends, unavailable, urgent):
        self._pool, self._ends, self._unavailable, self._urgent = pool, ends, unavailable, urgent

    def __enter__(self):
        self.wrapper = self._pool._check_out(self._ends, self._unavailable, self._urgent)
        return self.wrapper

    def __exit__(self, exc_type, exc, traceback):
        self._pool._give_back(self.wrapper, broken=exc_type is not None)


class _Turn:
    """A call's place in the pool's queue: the giver puts the connection in its mailbox."""

    def __init__(self, urgent):
        self.mailbox = mailbox()
        self.urgent = urgent
        self.given = False
