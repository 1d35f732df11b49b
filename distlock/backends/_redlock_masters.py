"""Redlock's masters, spoken to all at once: a thread per master, rounds that end once a majority decides.

A caller hands one command to every master's thread (``Master.submit``) and waits on its ``Round``
until the replies decide the outcome, while slower masters' replies are still read by their threads.
``ReleaseListener`` wakes this process's waiters when any master announces a release.
"""

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import redis

from distlock.backends._redis import CLIENT_ERRORS, FORGET_IN_FORKED_CHILD, exchange
from distlock.redaction import redact
from distlock.waiting import Wakeups, mailbox

logger = logging.getLogger(__name__)

__all__ = ["UNTIL", "Job", "Master", "MasterSkipped", "ReleaseListener", "Round"]


class MasterSkipped(redis.RedisError):
    """A master left out of a round: it failed moments ago, or the round was over before the command was sent."""


#: When a caller may stop waiting for the rest of a round (``Round(until=...)``):
#: ``"decided"``: the missing replies can no longer change the outcome (releases, extensions);
#: ``"majority"``: a majority succeeded, or cannot answer at all; a miss waits for every reply, since a
#: late one may be a grant to undo (acquisitions);
#: ``"everyone"``: every master replied or failed (undoing a failed attempt, an operator's release).
UNTIL = ("decided", "majority", "everyone")


class Round:
    """The replies to one command sent to every master, and whether the caller may stop waiting.

    ``succeeded(reply)`` says which replies count towards the majority (a grant, a deletion...).
    Replies still missing are None. The masters' threads hand replies over through a queue and
    never take a lock: an interrupt (a time limit, a signal) can stop the caller anywhere in
    ``wait``, and a lock it left held would stall every master's thread, and with them the alias.
    """

    def __init__(self, size, quorum, succeeded, *, until="decided"):
        if until not in UNTIL:
            raise ValueError(f"until must be one of {UNTIL}, got {until!r}")
        self.replies = [None] * size
        self._quorum = quorum
        self._succeeded = succeeded
        self._until = until
        self._arrivals = mailbox()

    def deliver(self, index, reply):
        """Hand over one master's reply; never blocks."""
        self._arrivals.put((index, reply))

    def _decided(self):
        """True once the caller may stop waiting (see ``UNTIL``); a miss never turns into "unavailable" later."""
        size, quorum = len(self.replies), self._quorum
        missing = sum(1 for reply in self.replies if reply is None)
        if missing == 0 or self._until == "everyone":
            return missing == 0
        failed = sum(1 for reply in self.replies if isinstance(reply, Exception))
        succeeded = sum(1 for reply in self.replies if reply is not None and self._succeeded(reply))
        if succeeded >= quorum or failed > size - quorum:
            return True
        answered = size - missing - failed
        return self._until == "decided" and answered >= quorum and succeeded + missing < quorum

    def wait(self, timeout):
        """Return a copy of the replies once decided, or after ``timeout`` seconds with None for the missing.

        Sets ``timed_out``: whether the missing replies are late (rather than not needed).
        """
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            self._take_arrived()
            if self._decided():
                self.timed_out = False
                return list(self.replies)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.timed_out = True
                return list(self.replies)
            try:
                index, reply = self._arrivals.get(timeout=remaining)
            except queue.Empty:
                continue
            self.replies[index] = reply

    def _take_arrived(self):
        while True:
            try:
                index, reply = self._arrivals.get_nowait()
            except queue.Empty:
                return
            self.replies[index] = reply


@dataclass
class Job:
    """One command for one master: sent unless ``deadline`` passed first (except releases), replied to ``round``."""

    command: tuple
    #: ``command`` as ``_redis.pack`` encodes it: once per round, shared by the masters' jobs.
    packed: bytes
    deadline: float
    must_send: bool
    round: Round
    index: int


class Master:
    """One Redis master, spoken to by a thread of its own over one connection, ``timeout`` on every request.

    Every caller's command goes to every master's thread at once: the thread writes whatever is
    queued in one go and hands each reply to its caller's ``Round``. A caller waits only until its
    round is decided (a majority agreed, or cannot), at most ``timeout``; the replies of slower
    masters are still read by their threads, so a slow master never holds up the others and its
    connection is never left with an unread reply. There are no client retries: Redlock counts a
    master that fails as one that said no.
    """

    def __init__(self, url, timeout):
        #: The URL as shown in messages, reprs, logs and thread names: without its password, nor its query
        #: (TLS parameters such as ``ssl_password``, the key file's passphrase).
        self.display = redact(url.split("?", 1)[0])
        self.timeout = timeout
        self.pool = redis.ConnectionPool.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self.client = redis.Redis(connection_pool=self.pool)
        #: Monotonic time until which the master is left out after a failure.
        self.skip_until = 0.0
        self.forget_after_fork()  # no thread yet
        FORGET_IN_FORKED_CHILD.add(self)

    def __repr__(self):
        return f"<Master {self.display}>"

    def forget_after_fork(self):
        """Start with no thread: a forked child has the parent's queue, but not the thread reading it."""
        self._start_lock = threading.Lock()
        self._jobs = None
        self._thread = None
        #: False until the thread has a connection, and again after the connection failed.
        self.connected = False

    def submit(self, job):
        """Queue ``job`` for this master's thread, started on first use."""
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._jobs = mailbox()
                    self._thread = threading.Thread(target=self._serve, args=(self._jobs,), daemon=True,
                                                    name=f"distlock-redlock:{self.display}")
                    self._thread.start()
        self._jobs.put(job)

    def stop(self):
        """Stop the thread once it has sent what is queued; a later command starts a new one."""
        with self._start_lock:
            if self._thread is None:
                return
            thread, self._thread = self._thread, None
            self._jobs.put(None)
        thread.join(1.0)

    def _serve(self, jobs):
        connection = self.pool.make_connection()  # this thread's own; it connects on first use
        try:
            while True:
                batch = [jobs.get()]
                while True:
                    try:
                        batch.append(jobs.get_nowait())
                    except queue.Empty:
                        break
                now = time.monotonic()
                due = []
                for job in batch:
                    if job is None:
                        continue
                    if job.must_send or job.deadline > now:
                        due.append(job)
                    else:
                        # Sent now, an acquire could take a lock its caller no longer waits for.
                        job.round.deliver(job.index, MasterSkipped("not sent: the round was already over"))
                if due:
                    self._exchange(connection, due)
                if None in batch:
                    return
        finally:
            connection.disconnect()

    def _exchange(self, connection, jobs):
        """Send every job's command at once, then hand each job its reply (or the failure)."""
        try:
            replies = exchange(connection, [job.command for job in jobs], self.timeout, [job.packed for job in jobs])
        except CLIENT_ERRORS as exc:
            self.connected = False
            connection.disconnect()  # an unread reply must never answer the next command
            replies = [exc] * len(jobs)
        else:
            self.connected = True
        for job, reply in zip(jobs, replies):
            job.round.deliver(job.index, reply)


class ReleaseListener:
    """Wake this process's waiters when a master announces a release: one pub/sub thread per master.

    Every release publishes the lock name on every master; the first copy to arrive wakes the
    waiters of that name, so masters that are down or slow delay nobody. Started on the first wait,
    so processes that never wait hold no subscriptions.
    """

    #: Names whose latest release is remembered; older ones fall back to polling.
    remembered = 1024

    def __init__(self, masters, channel, quorum):
        self._masters = masters
        self._channel = channel
        self._quorum = quorum
        self._wakeups = Wakeups()
        self._released = OrderedDict()  # lock name -> sequence number of its latest release
        #: Number of releases announced so far; a waiter notes it before trying, then waits for a larger one.
        self.sequence = 0
        self.forget_after_fork()  # no thread yet
        FORGET_IN_FORKED_CHILD.add(self)

    def forget_after_fork(self):
        """Start with no thread: a forked child has none of the parent's subscriptions."""
        self._counting = threading.Lock()  # the listening threads' only: callers never take it (see Wakeups)
        self._start_lock = threading.Lock()
        self._subscriptions = 0  # masters subscribed right now
        self._stopped = None  # set to stop the current threads
        self._threads = []

    def start(self):
        """Subscribe on every master unless already done; return False if this call started it.

        A release between the caller's last attempt and the subscription was not seen, so a caller
        that gets False tries again at once instead of waiting. It waits (a second at most) until a
        majority of masters is subscribed: every release reaches a majority, so at least one of them.
        """
        with self._start_lock:
            if self._threads:
                return True
            self._stopped = threading.Event()
            self._threads = [threading.Thread(target=self._listen, args=(master, self._stopped), daemon=True,
                                              name=f"distlock-redlock-listen:{master.display}")
                             for master in self._masters]
            for thread in self._threads:
                thread.start()
        self._wakeups.wait_for(lambda: self._subscriptions >= self._quorum, 1.0)
        return False

    def wait(self, name, since, timeout):
        """Block until a release of ``name`` numbered above ``since`` is announced, at most ``timeout`` seconds."""
        self._wakeups.wait_for(lambda: self._released.get(name, 0) > since, timeout)

    def _announce(self, name):
        with self._counting:
            self._released[name] = self.sequence + 1
            self._released.move_to_end(name)
            if len(self._released) > self.remembered:
                self._released.popitem(last=False)
            self.sequence += 1
        self._wakeups.notify_all()

    def _count_subscription(self, change):
        with self._counting:
            self._subscriptions += change
        self._wakeups.notify_all()

    def _listen(self, master, stopped):
        while not stopped.is_set():
            pubsub = master.client.pubsub()
            subscribed = False
            try:
                pubsub.subscribe(self._channel)
                while not stopped.is_set():
                    message = pubsub.get_message(timeout=0.25)
                    if message is None:
                        continue
                    if message["type"] == "subscribe":
                        subscribed = True
                        self._count_subscription(+1)
                    elif message["type"] == "message":
                        self._announce(message["data"].decode())
            except CLIENT_ERRORS as exc:
                logger.debug("Release notifications from %s interrupted (%s); resubscribing", master.display, redact(exc))
                stopped.wait(1.0)
            finally:
                if subscribed:
                    self._count_subscription(-1)
                pubsub.close()

    def stop(self):
        """Stop the threads; a later wait starts new ones."""
        with self._start_lock:
            threads, self._threads = self._threads, []
            if self._stopped is not None:
                self._stopped.set()
        for thread in threads:
            thread.join(1.0)
