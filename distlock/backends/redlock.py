"""Redlock: one lock over N independent Redis masters, held while a majority of them grant it.

The algorithm (https://redis.io/docs/latest/develop/use/patterns/distributed-locks/): send the
acquire script to every master at once, gather the replies for at most ``REQUEST_TIMEOUT``, and hold
the lock if a majority granted it and time is left, ``validity = ttl − elapsed − drift`` with
``drift = ttl × CLOCK_DRIFT_FACTOR + 2 ms``; otherwise undo the partial grants on every master.

.. warning::
   ``lease.token`` is **not a safe fencing token** (``lease.token_is_safe`` is False). It is the
   highest of the per-master counters of the granting majority: a master that restarts without
   persistence, a clock jump, or a holder that expired without releasing can make a later holder's
   token smaller than an earlier one's. Use ZooKeeper, etcd or the database backend when a second
   holder would corrupt data; Redlock is for efficiency locks without a single Redis to fail.
"""

import logging
import math
import random
import time
from datetime import datetime, timedelta, timezone

from django.core.exceptions import ImproperlyConfigured
from redis.exceptions import ResponseError

from distlock.backends import _redis
from distlock.backends._redlock_masters import Job, Master, MasterSkipped, ReleaseListener, Round
from distlock.backends.base import NOTIFICATIONS, BaseLockBackend, Grant, check_page, page_of
from distlock.backends.deadlines import request_deadline
from distlock.backends.options import Option, positive_number
from distlock.backends.redis_servers import redis_server, unsecured, url_problem
from distlock.holder import holder_record, read_holder_record
from distlock.redaction import redact

logger = logging.getLogger(__name__)

__all__ = ["RedlockBackend", "clock_drift", "remaining_validity"]

# -- protocol, run on every master ------------------------------------------------------------------
# Keys on each master, under KEY_PREFIX (default "distlock"):
#   <prefix>:lock:<name>   hash {owner, token, acquired_ms, holder (JSON: host, pid, task_id)}, expiring after the ttl
#   <prefix>:token         the master's token counter, shared by every lock name of the alias
#   <prefix>:released      pub/sub channel; every release publishes the lock name on it

# KEYS[1] lock hash, KEYS[2] token counter; ARGV owner, ttl in ms, holder (JSON).
# Invariant: a master grants a name to one owner at a time (no hash = free), and every grant takes a
# counter value above all values this master handed out before. Sent twice by the same owner (a
# retry on a fresh connection), it reports the same grant again.
# Returns {1, token} when granted, {0, milliseconds left on the holder's grant} when held.
ACQUIRE = _redis.Script("acquire", """
local holder = redis.call('HGET', KEYS[1], 'owner')
if holder == ARGV[1] then
  return {1, tonumber(redis.call('HGET', KEYS[1], 'token'))}
elseif holder then
  return {0, redis.call('PTTL', KEYS[1])}
end
local token = redis.call('INCR', KEYS[2])
local _, now_ms = clock()
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'token', token, 'acquired_ms', string.format('%d', now_ms),
           'holder', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1, token}
""", helpers=(_redis.LUA_CLOCK,))

# KEYS[1] lock hash, KEYS[2] token counter; ARGV owner, token floor, channel, lock name.
# Invariant: deletes only the caller's own grant (compare-and-delete). It also raises the counter to
# the floor (the released lease's token) on every master, so that the next holder's token is above
# this one whichever majority grants it: masters outside this lease's majority catch up.
# Returns 1 if the caller's grant was deleted (and the name published to waiters), 0 otherwise.
RELEASE = _redis.Script("release", """
if tonumber(redis.call('GET', KEYS[2]) or '0') < tonumber(ARGV[2]) then
  redis.call('SET', KEYS[2], ARGV[2])
end
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[3], ARGV[4])
  return 1
end
return 0
""")

# KEYS[1] lock hash; ARGV owner, ttl in ms.
# Invariant: only the owner's grant is extended (compare-and-extend).
# Returns 1 if extended, 0 if the grant is gone or another owner's.
EXTEND = _redis.Script("extend", """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
""")

#: Added to every clock-drift allowance: the granularity of the masters' expiry timers.
DRIFT_FLOOR = 0.002

#: Longest a waiter sleeps without a release notification before trying again, in case one was missed.
FALLBACK_POLL = 0.5

#: Seconds a master that failed or did not answer in time is left out, while a majority remains
#: without it: every round whose outcome needs its answer would otherwise wait REQUEST_TIMEOUT for it.
SKIP_FAILED_MASTER = 1.0


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
        problem = url_problem(url)
        if problem:
            return f"has a URL that {problem}: {redact(repr(url.split('?', 1)[0] if isinstance(url, str) else url))}"
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


def is_grant(reply):
    """True for the acquire script's "granted" reply."""
    return isinstance(reply, list) and reply[0] == 1


def is_one(reply):
    """True for a release or extend script's "done" reply."""
    return reply == 1


def not_answered(reply):
    """True for a master that failed (an exception) or had not replied when the round ended (None)."""
    return reply is None or isinstance(reply, Exception)


class RedlockBackend(BaseLockBackend):
    """Locks held on a majority of ``URLS`` (independent Redis masters), with Redlock's validity rule.

    Survives a minority of masters down. Not for correctness: tokens are not safe fencing tokens
    (see the module docstring), and a master restarted without persistence forgets its grants.
    """

    label = "Redlock"
    capabilities = frozenset({NOTIFICATIONS})
    client_errors = _redis.CLIENT_ERRORS
    renamed_options = {"NODE_TIMEOUT": "REQUEST_TIMEOUT"}

    options = {
        "URLS": Option((list, tuple), required=True, check=check_urls,
                       expected="a list of 3, 5, 7… redis:// URLs, one per independent master"),
        "KEY_PREFIX": _redis.KEY_PREFIX_OPTION,
        "REQUEST_TIMEOUT": Option((int, float), 0.25, check=positive_number,
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
        self.request_timeout = settings["REQUEST_TIMEOUT"]
        self.drift_factor = settings["CLOCK_DRIFT_FACTOR"]
        self.retry_jitter = settings["RETRY_JITTER"]
        self.masters = [Master(url, self.request_timeout) for url in settings["URLS"]]
        self.quorum = len(self.masters) // 2 + 1
        prefix = settings["KEY_PREFIX"]
        self._lock_prefix = f"{prefix}:lock:"
        self._token_key = f"{prefix}:token"
        self._channel = f"{prefix}:released"
        self._listener = ReleaseListener(self.masters, self._channel, self.quorum)

    @classmethod
    def check_combination(cls, alias, options):
        if options["REQUEST_TIMEOUT"] * 10 > options["DEFAULT_TTL"]:
            raise ImproperlyConfigured(
                f"DISTLOCK['{alias}']['OPTIONS']['REQUEST_TIMEOUT'] ({options['REQUEST_TIMEOUT']}s) must be at most a "
                f"tenth of DEFAULT_TTL ({options['DEFAULT_TTL']}s): time spent waiting for a slow master is taken off "
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
        when the round was decided or REQUEST_TIMEOUT ran out (the masters' threads still read those
        replies). ``succeeded(reply)`` says which replies count towards the majority. ``must_send``
        sends the command even to a master whose thread gets to it late: a release goes to every
        master whatever happens, while a late acquire could take a lock nobody waits for.
        ``until`` says how long to wait for the replies (``UNTIL``), REQUEST_TIMEOUT at most.
        """
        started = self.clock()
        masters = self.masters
        skipped = [master.skip_until > started for master in masters]
        if len(masters) - sum(skipped) < self.quorum:
            skipped = [False] * len(masters)  # without them there is no majority: try them all
        round_ = Round(len(masters), self.quorum, succeeded, until=until)
        # Connecting (TCP, then redis-py's HELLO and two CLIENT SETINFO) gets its own REQUEST_TIMEOUTs.
        patience = self.request_timeout
        if not all(master.connected for master, skip in zip(masters, skipped) if not skip):
            patience += 4 * self.request_timeout
        # Never cut to the caller's deadline: a round cut short leaves grants to undo on every
        # master, which takes longer than letting the round finish.
        deadline = request_deadline(patience, minimum=_redis.MIN_REQUEST_SECONDS)
        packed = _redis.pack(command)
        for index, master in enumerate(masters):
            if skipped[index]:
                round_.deliver(index, MasterSkipped(f"failed less than {SKIP_FAILED_MASTER:g}s ago"))
            else:
                master.submit(Job(command, packed, deadline, must_send, round_, index))
        replies = round_.wait(patience - (self.clock() - started))
        for master, reply, was_skipped in zip(masters, replies, skipped):
            failed = isinstance(reply, self.client_errors) and not isinstance(reply, ResponseError)
            if not was_skipped and (failed or (reply is None and round_.timed_out)):
                master.skip_until = self.clock() + SKIP_FAILED_MASTER
        return replies

    def _run_script(self, script, keys, args, succeeded, **how):
        """Run ``script`` on every master at once; see ``_broadcast``."""
        return self._broadcast(script.command(keys, args), succeeded, **how)

    def _require_majority_answered(self, replies, operation):
        """Raise ``BackendUnavailable`` (``unavailable``) unless a majority of masters answered."""
        if sum(1 for reply in replies if not not_answered(reply)) >= self.quorum:
            return
        failures = [(master, reply) for master, reply in zip(self.masters, replies) if isinstance(reply, Exception)]
        cause = (f"a majority of {self.quorum} of its {len(self.masters)} Redis masters must answer within "
                 f"REQUEST_TIMEOUT={self.request_timeout:g}s, but {len(failures)} failed")
        master, error = failures[0] if failures else (None, None)
        if failures:
            cause += f" (first: {master.display}: {_redis.failure_cause(error, master.display)})"
        silent = sum(1 for reply in replies if reply is None)
        if silent:
            cause += f" and {silent} did not answer"
        raise self.unavailable(operation, cause) from error

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
        attempt.notified_since = self._listener.sequence
        started = self.clock()
        replies = self._run_script(ACQUIRE, (key, self._token_key), (owner, milliseconds(ttl), holder_record()),
                                   is_grant, until="majority")
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

    def _majority_did(self, replies, operation):
        """Return True if a majority of masters replied 1 (done), False if a majority answered otherwise.

        Raise ``BackendUnavailable`` if no majority answered at all.
        """
        if sum(1 for reply in replies if is_one(reply)) >= self.quorum:
            return True
        self._require_majority_answered(replies, operation)
        return False

    def _release(self, name, owner, floor, **how):
        """Delete ``owner``'s grant of ``name`` on every master, raising each counter to ``floor``; True if a majority did."""
        replies = self._run_script(RELEASE, (self._lock_key(name), self._token_key), (owner, floor, self._channel, name),
                                   is_one, must_send=True, **how)
        return self._majority_did(replies, f"release lock {name!r}")

    def _do_release(self, lease):
        return self._release(lease.name, lease.owner, lease.token)

    def _do_extend(self, lease, ttl):
        started = self.clock()
        replies = self._run_script(EXTEND, (self._lock_key(lease.name),), (lease.owner, milliseconds(ttl)), is_one)
        elapsed = self.clock() - started
        return (self._majority_did(replies, f"extend lock {lease.name!r}")
                and remaining_validity(ttl, elapsed, self.drift_factor) > 0)

    # -- operating ----------------------------------------------------------------------------

    def _grants(self, master, prefix):
        """Return ``{name: (fields, ms left)}`` for the grants on ``master`` whose name starts with ``prefix``."""
        keys = list(master.client.scan_iter(match=_redis.glob_escape(self._lock_key(prefix)) + "*", count=1000))
        pipeline = master.client.pipeline(transaction=False)
        for key in keys:
            pipeline.hgetall(key)
            pipeline.pttl(key)
        results = pipeline.execute()
        grants = {}
        for key, fields, left in zip(keys, results[::2], results[1::2]):
            if fields and left > 0:
                grants[key.decode()[len(self._lock_prefix):]] = ({k.decode(): v.decode() for k, v in fields.items()},
                                                                 left)
        return grants

    def held_locks(self, prefix="", *, limit=None, cursor=None):
        """Return the locks held by one owner on a majority of masters (a minority grant is no lock).

        Every master's grants are read, then cut to the page asked for.
        """
        check_page(limit, cursor)
        per_master = []
        for master in self.masters:
            try:
                per_master.append(self._grants(master, prefix))
            except self.client_errors as exc:
                per_master.append(exc)
        self._require_majority_answered(per_master, "list held locks")
        now = datetime.now(timezone.utc)
        by_owner = {}
        for grants in per_master:
            if isinstance(grants, Exception):
                continue
            for name, (fields, left) in grants.items():
                by_owner.setdefault((name, fields["owner"]), []).append((fields, left))
        held = []
        for (name, owner), grants in sorted(by_owner.items()):
            if len(grants) < self.quorum:
                continue
            # The lock ends when fewer than a majority of grants remain: at the quorum-th longest one.
            lefts = sorted((left for _, left in grants), reverse=True)
            fields = grants[0][0]
            held.append(self.lock_info(
                name, read_holder_record(fields.get("holder")), owner=owner,
                token=max(int(fields["token"]) for fields, _ in grants),
                acquired_at=datetime.fromtimestamp(int(fields["acquired_ms"]) / 1000, timezone.utc),
                expires_at=now + timedelta(milliseconds=lefts[self.quorum - 1]),
            ))
        return page_of(held, limit, cursor)

    def release_owned(self, name, owner):
        """Delete ``owner``'s grant of ``name`` on every master; return True if it held a majority of them.

        Like the holder's own release it raises every master's counter to the holder's token, read
        first from the masters that granted it: else a master outside the holder's majority could
        hand the next holder a token below the evicted one's.
        """
        grants = self._broadcast(("HMGET", self._lock_key(name), "owner", "token"), lambda reply: True,
                                 until="everyone")
        self._require_majority_answered(grants, f"release lock {name!r}")
        floor = max((int(grant[1]) for grant in grants
                     if isinstance(grant, list) and grant[0] is not None and grant[0].decode() == owner), default=0)
        return self._release(name, owner, floor, until="everyone")

    def ping(self):
        self._require_majority_answered(self._broadcast(("PING",), lambda reply: True), "answer a ping")

    def close(self):
        self._listener.stop()
        for master in self.masters:
            master.stop()
        for master in self.masters:
            master.pool.disconnect()
