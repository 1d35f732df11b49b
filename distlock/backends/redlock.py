"""Redlock: one lock over N independent Redis masters, held while a majority of them grant it.

The algorithm (https://redis.io/docs/latest/develop/use/patterns/distributed-locks/): send the
acquire script to every master at once, gather the replies for at most ``NODE_TIMEOUT``, and hold
the lock if a majority granted it and time is left, ``validity = ttl − elapsed − drift`` with
``drift = ttl × CLOCK_DRIFT_FACTOR + 2 ms``; otherwise undo the partial grants on every master.

.. warning::
   ``lease.token`` is **not a safe fencing token** (``lease.token_is_safe`` is False). It is the
   highest of the per-master counters of the granting majority: a master that restarts without
   persistence, a clock jump, or a holder that expired without releasing can make a later holder's
   token smaller than an earlier one's. Use ZooKeeper, etcd or the database backend when a second
   holder would corrupt data; Redlock is for efficiency locks without a single Redis to fail.
"""

import hashlib
import logging
import math
import os
import queue
import random
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import redis
from django.core.exceptions import ImproperlyConfigured
from redis.exceptions import NoScriptError, RedisError, ResponseError

from distlock.backends.base import NOTIFICATIONS, BaseLockBackend, Grant, LockInfo, Option, positive_number
from distlock.backends.redis_servers import redis_server, tls_problem, unsecured
from distlock.exceptions import BackendUnavailable
from distlock.holder import current_holder
from distlock.redaction import redact
from distlock.waiting import Wakeups, mailbox

logger = logging.getLogger("distlock.redlock")

# -- protocol, run on every master ------------------------------------------------------------------
# Keys on each master, under KEY_PREFIX (default "distlock"):
#   <prefix>:lock:<name>   hash {owner, token, host, pid, task_id, acquired_ms}, expiring after the ttl
#   <prefix>:token         the master's token counter, shared by every lock name of the alias
#   <prefix>:released      pub/sub channel; every release publishes the lock name on it

# KEYS[1] lock hash, KEYS[2] token counter; ARGV owner, ttl in ms, host, pid, task id.
# Invariant: a master grants a name to one owner at a time (no hash = free), and every grant takes a
# counter value above all values this master handed out before. Sent twice by the same owner (a
# retry on a fresh connection), it reports the same grant again.
# Returns {1, token} when granted, {0, milliseconds left on the holder's grant} when held.
ACQUIRE_SCRIPT = """
local holder = redis.call('HGET', KEYS[1], 'owner')
if holder == ARGV[1] then
  return {1, tonumber(redis.call('HGET', KEYS[1], 'token'))}
elseif holder then
  return {0, redis.call('PTTL', KEYS[1])}
end
local token = redis.call('INCR', KEYS[2])
local now = redis.call('TIME')
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'token', token, 'host', ARGV[3], 'pid', ARGV[4],
           'task_id', ARGV[5], 'acquired_ms', now[1] .. string.format('%03d', math.floor(now[2] / 1000)))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1, token}
"""

# KEYS[1] lock hash, KEYS[2] token counter; ARGV owner, token floor, channel, lock name.
# Invariant: deletes only the caller's own grant (compare-and-delete). It also raises the counter to
# the floor (the released lease's token) on every master, so that the next holder's token is above
# this one whichever majority grants it: masters outside this lease's majority catch up.
# Returns 1 if the caller's grant was deleted (and the name published to waiters), 0 otherwise.
RELEASE_SCRIPT = """
if tonumber(redis.call('GET', KEYS[2]) or '0') < tonumber(ARGV[2]) then
  redis.call('SET', KEYS[2], ARGV[2])
end
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[3], ARGV[4])
  return 1
end
return 0
"""

# KEYS[1] lock hash; ARGV owner, ttl in ms.
# Invariant: only the owner's grant is extended (compare-and-extend).
# Returns 1 if extended, 0 if the grant is gone or another owner's.
EXTEND_SCRIPT = """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

#: What the redis client raises for a master that is down, slow or refuses a command.
CLIENT_ERRORS = (RedisError, OSError)

#: Added to every clock-drift allowance: the granularity of the masters' expiry timers.
DRIFT_FLOOR = 0.002

#: Longest a waiter sleeps without a release notification before trying again, in case one was missed.
FALLBACK_POLL = 0.5

#: Seconds a master that failed or did not answer in time is left out, while a majority remains
#: without it: every round whose outcome needs its answer would otherwise wait NODE_TIMEOUT for it.
SKIP_FAILED_MASTER = 1.0


class MasterSkipped(RedisError):
    """A master left out of a round: it failed moments ago (``SKIP_FAILED_MASTER``), or the round was over."""


class Script:
    """A Lua script sent by its SHA1, with its source for masters that have not cached it yet."""

    #: Every script by its SHA1, for a master that answers NOSCRIPT.
    by_sha = {}

    def __init__(self, source):
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        Script.by_sha[self.sha] = self


ACQUIRE = Script(ACQUIRE_SCRIPT)
RELEASE = Script(RELEASE_SCRIPT)
EXTEND = Script(EXTEND_SCRIPT)


def clock_drift(ttl, drift_factor):
    """Return the seconds to allow for the masters' clocks running fast over ``ttl``."""
    return ttl * drift_factor + DRIFT_FLOOR


def remaining_validity(ttl, elapsed, drift_factor):
    """Return how long a majority grant can still be trusted after ``elapsed`` seconds spent gathering it.

    Redlock's rule, ttl − elapsed − drift: the masters started counting the ttl when they received
    the request, at most ``elapsed`` ago. Zero or less means the grant may already have expired on
    the masters, so it must not be used.
    """
    return ttl - elapsed - clock_drift(ttl, drift_factor)


def milliseconds(seconds):
    """Return ``seconds`` in whole milliseconds, rounded up so a master never expires a grant early."""
    return max(1, math.ceil(seconds * 1000))


def check_urls(urls):
    if len(urls) < 3 or len(urls) % 2 == 0:
        return f"must list an odd number of 3 or more Redis masters (a majority must survive a failure), not {len(urls)}"
    for url in urls:
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            return f"must contain redis://, rediss:// or unix:// URLs only; {redact(repr(url))} is not one"
        problem = tls_problem(url)
        if problem:
            return f"has a URL that {problem}: {redact(url.split('?', 1)[0])}"
    if len({redis_server(url) for url in urls}) != len(urls):
        return ("must name each master once (localhost and 127.0.0.1 are one server): a master listed twice "
                "would count twice towards the majority")
    return None


def check_drift_factor(value):
    if not math.isfinite(value) or not 0 <= value < 0.5:
        return "must be a fraction of the ttl from 0 to below 0.5 (Redlock uses 0.01)"
    return None


def check_jitter(value):
    if not math.isfinite(value) or value < 0:
        return "must be a finite number of seconds, zero or more"
    return None


def tls_hint(master, error):
    """Return a hint when a plain connection to ``master`` was dropped, as a TLS-only port drops it."""
    if master.display.startswith("redis://") and isinstance(error, redis.ConnectionError) and any(
            symptom in str(error) for symptom in ("reset by peer", "Connection closed by server")):
        return " (if the masters take TLS connections only, use rediss:// URLs)"
    return ""


def is_grant(reply):
    """True for the acquire script's "granted" reply."""
    return isinstance(reply, list) and reply[0] == 1


def is_one(reply):
    """True for a release or extend script's "done" reply."""
    return reply == 1


def not_answered(reply):
    """True for a master that failed (an exception) or had not replied when the round ended (None)."""
    return reply is None or isinstance(reply, Exception)


def glob_escape(text):
    """Return ``text`` with Redis glob characters escaped, for a literal prefix in ``SCAN MATCH``."""
    return "".join("\\" + char if char in "*?[]\\" else char for char in text)


#: When a caller may stop waiting for the rest of a round (``Round(until=...)``):
#: ``"decided"``: the missing replies can no longer change the outcome (releases, extensions);
#: ``"majority"``: a majority succeeded, or cannot answer at all; a miss waits for every reply, since a
#: late one may be a grant to undo (acquisitions);
#: ``"everyone"``: every master replied or failed (undoing a failed attempt, force release).
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
    packed: list
    deadline: float
    must_send: bool
    round: Round
    index: int


class Master:
    """One Redis master, spoken to by a thread of its own over one connection, with NODE_TIMEOUT on it.

    Every caller's command goes to every master's thread at once: the thread writes whatever is
    queued in one go and hands each reply to its caller's ``Round``. A caller waits only until its
    round is decided (a majority agreed, or cannot), at most NODE_TIMEOUT; the replies of slower
    masters are still read by their threads, so a slow master never holds up the others and its
    connection is never left with an unread reply. There are no client retries: Redlock counts a
    master that fails as one that said no.
    """

    def __init__(self, url, timeout):
        #: The URL as shown in messages, reprs, logs and thread names: without its password, nor its query
        #: (TLS parameters such as ``ssl_password``, the key file's passphrase).
        self.display = redact(url.split("?", 1)[0])
        self.pool = redis.ConnectionPool.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self.client = redis.Redis(connection_pool=self.pool)
        #: Monotonic time until which the master is left out after a failure (see ``SKIP_FAILED_MASTER``).
        self.skip_until = 0.0
        self._jobs = None
        self._thread = None
        self._pid = None
        self._start_lock = threading.Lock()
        #: False until the thread has a connection, and again after the connection failed.
        self.connected = False

    def __repr__(self):
        return f"<Master {self.display}>"

    def submit(self, job):
        """Queue ``job`` for this master's thread, started on first use (and again in a forked child)."""
        if self._pid != os.getpid():
            with self._start_lock:
                if self._pid != os.getpid():
                    # A forked child has the queue but not the thread: start afresh, new connection too.
                    self._jobs = mailbox()
                    self.connected = False
                    self._thread = threading.Thread(target=self._send_and_read, args=(self._jobs,), daemon=True,
                                                    name=f"distlock-redlock:{self.display}")
                    self._pid = os.getpid()
                    self._thread.start()
        self._jobs.put(job)

    def stop(self):
        """Stop the thread once it has sent what is queued; a later command starts a new one."""
        with self._start_lock:
            if self._thread is None or self._pid != os.getpid():
                return
            thread, self._thread, self._pid = self._thread, None, None
            self._jobs.put(None)
        thread.join(1.0)

    def _send_and_read(self, jobs):
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
        """Write every job's command at once, then read and hand out the replies in order.

        A connection the master closed while it sat idle (a restart) fails before the new process
        saw anything: the batch goes once more on a fresh connection. That is safe even if the first
        write did arrive: the acquire script reports the caller's own grant again, and a release or
        extend that ran twice only reports 0 the second time.
        """
        was_connected = connection._sock is not None  # redis-py 8's ``is_connected``, in every release line
        unanswered = list(jobs)
        try:
            try:
                self._write_and_read(connection, unanswered)
            except redis.ConnectionError:
                if not was_connected or len(unanswered) < len(jobs):
                    raise
                connection.disconnect()
                self._write_and_read(connection, unanswered)
        except CLIENT_ERRORS as exc:
            self.connected = False
            connection.disconnect()  # an unread reply must never answer the next command
            for job in unanswered:
                job.round.deliver(job.index, exc)
        else:
            self.connected = True

    def _write_and_read(self, connection, unanswered):
        """Send the commands of ``unanswered`` jobs, deliver their replies, and remove each answered job."""
        connection.send_packed_command([chunk for job in unanswered for chunk in job.packed])
        forgot_scripts = []
        for job in list(unanswered):
            reply = self._read(connection)
            if isinstance(reply, NoScriptError):
                forgot_scripts.append(job)
                continue
            job.round.deliver(job.index, reply)
            unanswered.remove(job)
        if forgot_scripts:
            # A master that restarted lost its script cache: send the sources, in the same order.
            evals = [("EVAL", Script.by_sha[job.command[1]].source, *job.command[2:]) for job in forgot_scripts]
            connection.send_packed_command(connection.pack_commands(evals))
            for job in forgot_scripts:
                job.round.deliver(job.index, self._read(connection))
                unanswered.remove(job)

    @staticmethod
    def _read(connection):
        """Return the next reply; an error reply is returned too (it leaves the connection usable)."""
        try:
            return connection.read_response()
        except ResponseError as exc:
            return exc


class ReleaseListener:
    """Wake this process's waiters when a master announces a release: one pub/sub thread per master.

    Every release publishes the lock name on every master; the first copy to arrive wakes the
    waiters of that name, so masters that are down or slow delay nobody. Started on the first wait,
    so processes that never wait hold no subscriptions.
    """

    #: Names whose latest release is remembered; older ones fall back to ``FALLBACK_POLL``.
    remembered = 1024

    def __init__(self, masters, channel, quorum):
        self._masters = masters
        self._channel = channel
        self._quorum = quorum
        self._wakeups = Wakeups()
        self._counting = threading.Lock()  # the listening threads' only: callers never take it (see Wakeups)
        self._released = OrderedDict()  # lock name -> sequence number of its latest release
        #: Number of releases announced so far; a waiter notes it before trying, then waits for a larger one.
        self.sequence = 0
        self._start_lock = threading.Lock()
        self._subscriptions = 0  # masters subscribed right now
        self._stopped = None  # set to stop the current threads
        self._threads = []
        self._pid = None

    def start(self):
        """Subscribe on every master unless already done; return False if this call started it.

        A release between the caller's last attempt and the subscription was not seen, so a caller
        that gets False tries again at once instead of waiting. It waits (a second at most) until a
        majority of masters is subscribed: every release reaches a majority, so at least one of them.
        """
        with self._start_lock:
            if self._threads and self._pid == os.getpid():
                return True
            if self._pid != os.getpid():
                self._subscriptions = 0  # a forked child has none of the parent's threads
            self._pid, self._stopped = os.getpid(), threading.Event()
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
        if self._pid == os.getpid():
            for thread in threads:
                thread.join(1.0)


class RedlockBackend(BaseLockBackend):
    """Locks held on a majority of ``URLS`` (independent Redis masters), with Redlock's validity rule.

    Survives a minority of masters down. Not for correctness: tokens are not safe fencing tokens
    (see the module docstring), and a master restarted without persistence forgets its grants.
    """

    capabilities = frozenset({NOTIFICATIONS})

    options = {
        "URLS": Option((list, tuple), required=True, check=check_urls,
                       expected="a list of 3, 5, 7… redis:// URLs, one per independent master"),
        "KEY_PREFIX": Option(str, "distlock", check=lambda value: None if value else "must not be empty"),
        "NODE_TIMEOUT": Option((int, float), 0.25, check=positive_number,
                               expected="a number of seconds, much smaller than the ttl"),
        "CLOCK_DRIFT_FACTOR": Option((int, float), 0.01, check=check_drift_factor,
                                     expected="a fraction of the ttl"),
        "RETRY_JITTER": Option((int, float), 0.005, check=check_jitter, expected="a number of seconds"),
    }

    #: The monotonic clock acquisition time is measured on; tests replace it to simulate a paused client.
    clock = staticmethod(time.monotonic)

    @classmethod
    def key_spaces(cls, alias, options):
        return [(redis_server(url), options["KEY_PREFIX"]) for url in options["URLS"]]

    @classmethod
    def security_warnings(cls, alias, options):
        """Warn about each master reached over the network with neither TLS nor a password."""
        return [message for message in map(unsecured, options["URLS"]) if message]

    def __init__(self, alias, options):
        super().__init__(alias, options)
        settings = self.settings
        self.node_timeout = settings["NODE_TIMEOUT"]
        self.drift_factor = settings["CLOCK_DRIFT_FACTOR"]
        self.retry_jitter = settings["RETRY_JITTER"]
        self.masters = [Master(url, self.node_timeout) for url in settings["URLS"]]
        self.quorum = len(self.masters) // 2 + 1
        prefix = settings["KEY_PREFIX"]
        self._lock_prefix = f"{prefix}:lock:"
        self._token_key = f"{prefix}:token"
        self._channel = f"{prefix}:released"
        self._listener = ReleaseListener(self.masters, self._channel, self.quorum)
        # Encodes each command once for every master (redis-py's packer; no connection is opened).
        self._packer = redis.Connection()

    @classmethod
    def check_combination(cls, alias, options):
        if options["NODE_TIMEOUT"] * 10 > options["DEFAULT_TTL"]:
            raise ImproperlyConfigured(
                f"DISTLOCK['{alias}']['OPTIONS']['NODE_TIMEOUT'] ({options['NODE_TIMEOUT']}s) must be at most a tenth "
                f"of DEFAULT_TTL ({options['DEFAULT_TTL']}s): time spent waiting for a slow master is taken off "
                "the lock's validity."
            )

    def trusted_validity(self, ttl):
        return ttl - clock_drift(ttl, self.drift_factor)

    def _lock_key(self, name):
        return self._lock_prefix + name

    # -- talking to every master at once ----------------------------------------------------------

    def _broadcast(self, command, succeeded, *, must_send=False, until="decided"):
        """Send ``command`` to every master at once; return their replies once a majority decides.

        Each entry is the master's reply, the exception it raised, or None if it had not answered
        when the round was decided or NODE_TIMEOUT ran out (the masters' threads still read those
        replies). ``succeeded(reply)`` says which replies count towards the majority. ``must_send``
        sends the command even to a master whose thread gets to it late: a release goes to every
        master whatever happens, while a late acquire could take a lock nobody waits for.
        ``until`` says how long to wait for the replies (``UNTIL``), NODE_TIMEOUT at most.
        """
        started = self.clock()
        masters = self.masters
        skipped = [master.skip_until > started for master in masters]
        if len(masters) - sum(skipped) < self.quorum:
            skipped = [False] * len(masters)  # without them there is no majority: try them all
        round_ = Round(len(masters), self.quorum, succeeded, until=until)
        packed = self._packer.pack_command(*command)
        # Connecting (TCP, then redis-py's HELLO and two CLIENT SETINFO) gets its own NODE_TIMEOUTs.
        patience = self.node_timeout
        if not all(master.connected for master, skip in zip(masters, skipped) if not skip):
            patience += 4 * self.node_timeout
        deadline = time.monotonic() + patience
        for index, master in enumerate(masters):
            if skipped[index]:
                round_.deliver(index, MasterSkipped(f"failed less than {SKIP_FAILED_MASTER:g}s ago"))
            else:
                master.submit(Job(command, packed, deadline, must_send, round_, index))
        replies = round_.wait(patience - (self.clock() - started))
        for master, reply, was_skipped in zip(masters, replies, skipped):
            failed = isinstance(reply, CLIENT_ERRORS) and not isinstance(reply, ResponseError)
            if not was_skipped and (failed or (reply is None and round_.timed_out)):
                master.skip_until = self.clock() + SKIP_FAILED_MASTER
        return replies

    def _run_script(self, script, keys, args, succeeded, **how):
        """Run ``script`` on every master at once; see ``_broadcast``."""
        return self._broadcast(("EVALSHA", script.sha, len(keys), *keys, *args), succeeded, **how)

    def _require_majority_answered(self, replies, action):
        """Raise ``BackendUnavailable`` unless a majority of masters answered (the one place errors are translated)."""
        if sum(1 for reply in replies if not not_answered(reply)) >= self.quorum:
            return
        errors = [(master, reply) for master, reply in zip(self.masters, replies) if isinstance(reply, Exception)]
        silent = sum(1 for reply in replies if reply is None)
        master, error = errors[0] if errors else (None, None)
        raise BackendUnavailable(
            f"Redlock alias '{self.alias}' could not {action}: a majority of {self.quorum} of its "
            f"{len(self.masters)} Redis masters must answer within NODE_TIMEOUT={self.node_timeout:g}s, but "
            f"{len(errors)} failed" + (f" (first: {master.display}: {redact(error)}{tls_hint(master, error)})"
                                       if errors else "")
            + (f" and {silent} did not answer" if silent else "") + "."
        ) from error

    # -- acquiring ----------------------------------------------------------------------------

    def _try_acquire(self, attempt):
        name, owner, ttl = attempt.name, attempt.owner, attempt.ttl
        if self.trusted_validity(ttl) <= 0:
            raise ValueError(
                f"ttl={ttl:g}s leaves no validity after Redlock's clock-drift allowance on alias '{self.alias}' "
                f"(ttl × CLOCK_DRIFT_FACTOR + {DRIFT_FLOOR * 1000:g} ms); give a ttl above "
                f"{DRIFT_FLOOR / (1 - self.drift_factor):.4f}s."
            )
        key = self._lock_key(name)
        holder = current_holder()
        attempt.notified_since = self._listener.sequence
        started = self.clock()
        replies = self._run_script(ACQUIRE, (key, self._token_key),
                                   (owner, milliseconds(ttl), holder.host, holder.pid, holder.task_id), is_grant,
                                   until="majority")
        elapsed = self.clock() - started
        grants = [reply[1] for reply in replies if is_grant(reply)]
        if len(grants) >= self.quorum:
            left = remaining_validity(ttl, elapsed, self.drift_factor)
            if left > 0:
                # Grant.validity counts from the start of the attempt: elapsed + left = ttl − drift.
                return Grant(token=max(grants), validity=elapsed + left)
            logger.warning(
                "Acquiring lock %r (alias %r) took %.3fs, leaving no validity of its %.3fs ttl (a paused "
                "client or slow masters); undoing it", name, self.alias, elapsed, ttl,
            )
        if grants or any(not_answered(reply) for reply in replies):
            # Undo everywhere, including masters that did not answer: their grant may have landed.
            # Waiting for every master means a failed attempt leaves no grant behind when it returns.
            self._run_script(RELEASE, (key, self._token_key), (owner, max(grants, default=0), self._channel, name),
                             is_one, must_send=True, until="everyone")
        self._require_majority_answered(replies, f"acquire lock {name!r}")
        attempt.retry_after = self._seconds_until_free(replies)
        return None

    def _seconds_until_free(self, replies):
        """Return when a majority of masters will have dropped the holders' grants, by their ttls.

        Zero after a split vote (no holder has a majority, and our own grants were just undone).
        """
        answered = [reply for reply in replies if not not_answered(reply)]
        held = sorted(max(reply[1], 0) for reply in answered if isinstance(reply, list) and reply[0] == 0)
        needed = self.quorum - (len(answered) - len(held))
        return held[needed - 1] / 1000 if needed > 0 else 0.0

    def _wait_for_release(self, attempt, remaining):
        """Wait for a release notification (or the holder's expiry), then a random jitter.

        The jitter keeps waiters woken by the same release from splitting the masters between them.
        """
        if self._listener.start() and attempt.retry_after > 0:
            timeout = min(attempt.retry_after, FALLBACK_POLL)
            self._listener.wait(attempt.name, attempt.notified_since,
                                timeout if remaining is None else min(timeout, remaining))
        jitter = random.uniform(0, self.retry_jitter)
        if remaining is not None:
            jitter = min(jitter, max(0.0, remaining))
        time.sleep(jitter)

    # -- holding ------------------------------------------------------------------------------

    def _do_release(self, lease):
        replies = self._run_script(RELEASE, (self._lock_key(lease.name), self._token_key),
                                   (lease.owner, lease.token, self._channel, lease.name), is_one, must_send=True)
        if sum(1 for reply in replies if is_one(reply)) >= self.quorum:
            return True
        self._require_majority_answered(replies, f"release lock {lease.name!r}")
        return False

    def _do_extend(self, lease, ttl):
        started = self.clock()
        replies = self._run_script(EXTEND, (self._lock_key(lease.name),), (lease.owner, milliseconds(ttl)), is_one)
        elapsed = self.clock() - started
        if sum(1 for reply in replies if is_one(reply)) >= self.quorum:
            return remaining_validity(ttl, elapsed, self.drift_factor) > 0
        self._require_majority_answered(replies, f"extend lock {lease.name!r}")
        return False

    # -- operating ----------------------------------------------------------------------------

    def _records(self, master, prefix):
        """Return ``{name: (record, ms left)}`` for the locks on ``master`` whose name starts with ``prefix``."""
        keys = list(master.client.scan_iter(match=glob_escape(self._lock_key(prefix)) + "*", count=1000))
        pipeline = master.client.pipeline(transaction=False)
        for key in keys:
            pipeline.hgetall(key)
            pipeline.pttl(key)
        results = pipeline.execute()
        records = {}
        for key, record, left in zip(keys, results[::2], results[1::2]):
            if record and left > 0:
                records[key.decode()[len(self._lock_prefix):]] = ({k.decode(): v.decode() for k, v in record.items()},
                                                                  left)
        return records

    def held_locks(self, prefix=""):
        """Return the locks held by one owner on a majority of masters (a minority grant is no lock)."""
        per_master = []
        for master in self.masters:
            try:
                per_master.append(self._records(master, prefix))
            except CLIENT_ERRORS as exc:
                per_master.append(exc)
        self._require_majority_answered(per_master, "list the held locks")
        now = datetime.now(timezone.utc)
        by_owner = {}
        for records in per_master:
            if isinstance(records, Exception):
                continue
            for name, (record, left) in records.items():
                by_owner.setdefault((name, record["owner"]), []).append((record, left))
        held = []
        for (name, owner), grants in sorted(by_owner.items()):
            if len(grants) < self.quorum:
                continue
            # The lock ends when fewer than a majority of grants remain: at the quorum-th longest one.
            lefts = sorted((left for _, left in grants), reverse=True)
            record = grants[0][0]
            held.append(LockInfo(
                alias=self.alias, name=name, owner=owner,
                token=max(int(record["token"]) for record, _ in grants),
                acquired_at=datetime.fromtimestamp(int(record["acquired_ms"]) / 1000, timezone.utc),
                expires_at=now + timedelta(milliseconds=lefts[self.quorum - 1]),
                host=record["host"], pid=int(record["pid"]), task_id=record["task_id"],
            ))
        return held

    def force_release(self, name, owner):
        """Delete ``owner``'s grant of ``name`` on every master; return True if it held a majority of them.

        Like the holder's own release it raises every master's counter to the holder's token, read
        first from the masters that granted it: else a master outside the holder's majority could
        hand the next holder a token below the evicted one's.
        """
        key = self._lock_key(name)
        grants = self._broadcast(("HMGET", key, "owner", "token"), lambda reply: True, until="everyone")
        self._require_majority_answered(grants, f"read lock {name!r} before force-releasing it")
        floor = max((int(grant[1]) for grant in grants
                     if isinstance(grant, list) and grant[0] is not None and grant[0].decode() == owner), default=0)
        replies = self._run_script(RELEASE, (key, self._token_key), (owner, floor, self._channel, name),
                                   is_one, must_send=True, until="everyone")
        if sum(1 for reply in replies if is_one(reply)) >= self.quorum:
            return True
        self._require_majority_answered(replies, f"force-release lock {name!r}")
        return False

    def ping(self):
        self._require_majority_answered(self._broadcast(("PING",), lambda reply: True), "answer a PING")

    def close(self):
        self._listener.stop()
        for master in self.masters:
            master.stop()
        for master in self.masters:
            master.pool.disconnect()
