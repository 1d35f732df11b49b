"""The base class every lock backend implements: the one acquire loop, its hooks, errors and capabilities.

Glossary (one word for one thing, in the code, the options and the docs):

- **alias**: one entry of ``settings.DISTLOCK``, and the backend instance built from it.
- **owner**: the random id an ``acquire()`` call stores on the server; only that owner's release or
  extension acts (compare-and-delete, ``release_owned``).
- **attempt**: one ``acquire()`` call (``Attempt``), from its first request to its lease or its failure.
- **try**: one ``_try_acquire`` of an attempt: a request that grants the lock or says why not.
  ``attempt.tries`` counts them; the lease shows the count as ``lease.attempts`` (its public name).
- **wait**: what an attempt does between two tries (``_wait_for_release``): back off, or wait for a
  notification from the server.
- **grant**: what a successful try reports (``Grant``); the base class turns it into a ``Lease``.
- **late grant**: a grant that comes back after its ttl ran out; it is given back, never handed out.
- **give back**: delete a grant nobody will use (late, unusable, or its caller was interrupted).
- **give up**: what an attempt that leaves without the lock does to withdraw its tries' records (a place
  in a queue) (``_give_up``).
- **leftover**: a record an attempt or a lease left on the server that nobody uses any more (a queue
  key a failed give-up could not delete); backends delete leftovers in the background or let them expire.
- **release_owned(name, owner)**: compare-and-delete by name and owner; a lease's release and an
  operator's force release both end there. Nothing is "forced": the owner is always compared.
- **KEY_PREFIX**: the option naming where an alias keeps its records on the server (a key prefix, a
  znode path, an etcd prefix).
- **REQUEST_TIMEOUT**: the option bounding one request to the server, in seconds
  (``distlock.backends.deadlines.request_deadline``).
- **session**: for ZooKeeper and etcd, the server-side session or lease that frees a dead holder's locks.
"""

import asyncio
import functools
import logging
import random
import threading
import time
import warnings
from dataclasses import dataclass
from datetime import datetime

from django.core.exceptions import ImproperlyConfigured

from distlock.backends import offload
from distlock.backends.offload import Abandoned, Inline
from distlock.backends.options import (
    EPOCH_SHIFT,
    Option,
    optional_positive_number,
    positive_number,
    token_epoch,
    token_in_epoch,
)
from distlock.backends.token_order import TokenOrder
from distlock.exceptions import BackendUnavailable, LockNotAcquired, NotSupported
from distlock.holder import new_owner
from distlock.lease import Lease
from distlock.redaction import redact

__all__ = [
    "ASYNC_LONGEST_PAUSE",
    "Attempt",
    "BaseLockBackend",
    "Grant",
    "INLINE",
    "LATE_GRANTS_LIMIT",
    "LockInfo",
    "LockPage",
    "NOTIFICATIONS",
    "READ_WRITE",
    "SAFE_FENCING_TOKENS",
    "SUPPORTED_BY",
    "Waiter",
    "Waiters",
    "check_page",
    "cut_page",
    "operation_words",
    "page_of",
    "refuse_after_late_grants",
]

logger = logging.getLogger(__name__)

#: Capabilities a backend may declare in ``capabilities``:
#: ``safe_fencing_tokens``: tokens never go backwards, so stores may trust them (``lease.token_is_safe``); a
#: process refuses a server it sees go back (``distlock.backends.token_order``).
#: ``read_write``: ``read_lock()`` / ``write_lock()`` are supported.
#: ``notifications``: waiters are woken by the server instead of polling.
SAFE_FENCING_TOKENS = "safe_fencing_tokens"
READ_WRITE = "read_write"
NOTIFICATIONS = "notifications"

#: The built-in backends that declare each capability, for ``NotSupported`` messages (a test keeps it true).
SUPPORTED_BY = {
    SAFE_FENCING_TOKENS: ("database", "locmem", "Redis", "ZooKeeper", "etcd"),
    READ_WRITE: ("ZooKeeper",),
    NOTIFICATIONS: ("locmem", "Redis", "Redlock", "ZooKeeper", "etcd"),
}


@dataclass(frozen=True)
class Grant:
    """What a backend's successful acquisition attempt reports; the base class turns it into a ``Lease``."""

    #: The fencing token the server issued.
    token: int
    #: The server's clock at acquisition, for display; None falls back to the client's wall clock.
    acquired_at: datetime | None = None
    #: Seconds of validity counted from the start of the attempt; None means the full ``ttl``.
    validity: float | None = None
    #: Backend-private data the lease carries back to release/extend (a znode path, an etcd key).
    handle: object = None
    #: For session backends: seconds after which the server frees the lock of a dead holder.
    session_timeout: float | None = None


#: Grants that came back after their ttl ran out, in one call, before ``acquire()`` gives up.
LATE_GRANTS_LIMIT = 3


def refuse_after_late_grants(late_grants, alias, name, ttl):
    """Raise ``LockNotAcquired`` once ``late_grants`` grants of one call came back after their ttl ran out.

    Such a grant is worth nothing (another owner may hold the lock already) and is given back. A
    pause or a slow network can make one late, and the call tries again; but a ttl shorter than a
    round trip to the server makes every grant late, and retrying would never end.
    """
    if late_grants >= LATE_GRANTS_LIMIT:
        raise LockNotAcquired(
            f"Lock {name!r} on alias '{alias}' not acquired: {late_grants} grants came back after the ttl of "
            f"{ttl:g}s had run out; use a ttl longer than a round trip to the server."
        )


#: The job of an attempt run on its caller's own thread: never cancelled.
INLINE = Inline()

#: What ``_try_once`` returns after giving back a grant it could not hand out: try again at once.
_TRY_AGAIN = object()


#: The longest pause between two tries of a coroutine (``aacquire``), in seconds. Longer than the
#: sync loop's 200 ms: each try of every waiting coroutine costs a worker thread's CPU in this
#: process, and a release made in the process wakes its next waiter at once anyway. Shorter than
#: Redis's ``WAITER_REFRESH``, so a waiter's queue entry stays alive.
ASYNC_LONGEST_PAUSE = 0.5


def _backoff(attempt, longest=0.2):
    """Return a jittered exponential back-off (10 ms doubling to ``longest``) after ``attempt.tries`` tries.

    For servers that cannot notify; jitter keeps contenders from retrying in lock step.
    """
    return min(longest, 0.01 * (2 ** min(attempt.tries - 1, 6))) * random.uniform(0.5, 1.0)


class Waiter:
    """A coroutine waiting for a lock (``aacquire``): ``wake()`` may be called from any thread."""

    __slots__ = ("_event", "_loop", "woken")

    def __init__(self):
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()
        #: True if the last ``wait()`` ended with a wake-up rather than its timeout.
        self.woken = False

    def clear(self):
        self._event.clear()

    async def wait(self, timeout):
        """Return after ``timeout`` seconds, or sooner once woken (also by a ``wake()`` since ``clear()``)."""
        self.woken = False
        try:
            async with asyncio.timeout(timeout):
                await self._event.wait()
        except TimeoutError:
            return
        self.woken = True

    def wake(self):
        try:
            self._loop.call_soon_threadsafe(self._event.set)
        except RuntimeError:  # its loop is closed: nobody waits any more
            pass


class Waiters:
    """The coroutines of this process waiting for each lock of one alias, in the order they began to wait.

    A release made in this process wakes the first waiter of its lock; it is usually the server's
    next in line too, where the server keeps a queue (the others would be refused). If it is not,
    the next in line finds the lock at its next poll. Releases made elsewhere are seen by polling.
    """

    def __init__(self):
        self._lock = threading.Lock()  # held for a dict update, never across a call
        self._by_name = {}

    def add(self, name):
        """Return a new ``Waiter`` of the running loop for lock ``name``, last in line."""
        waiter = Waiter()
        with self._lock:
            self._by_name[name] = (*self._by_name.get(name, ()), waiter)
        return waiter

    def discard(self, name, waiter):
        with self._lock:
            left = tuple(other for other in self._by_name.get(name, ()) if other is not waiter)
            if left:
                self._by_name[name] = left
            else:
                self._by_name.pop(name, None)

    def wake(self, name):
        """Wake the first waiter for lock ``name``, if any (from any thread)."""
        waiting = self._by_name.get(name)  # a tuple, replaced whole: read without the lock
        if waiting:
            waiting[0].wake()

    def wake_next(self, name, waiter):
        """Wake the waiter for lock ``name`` that follows ``waiter`` in line, if any."""
        waiting = self._by_name.get(name, ())
        for position, other in enumerate(waiting[:-1]):
            if other is waiter:
                waiting[position + 1].wake()
                return


@dataclass
class Attempt:
    """One ``acquire()`` call as its tries and waits see it.

    The base class makes one per call and passes it to every hook, so what a try learns (the server's
    hint of when to look again, a place in a queue) reaches the wait and the try that follow without
    per-thread state in the backend.
    """

    name: str
    #: The random owner id every try of this call stores on the server.
    owner: str
    ttl: float
    blocking: bool
    #: ``time.monotonic()`` by which the call must end, or None for no limit.
    deadline: float | None
    #: The caller's timeout, for messages.
    timeout: float | None = None
    #: None for an exclusive lock; "read" or "write" for ``acquire_shared()``.
    mode: str | None = None
    #: The job the attempt runs as (``distlock.backends.offload``): ``cancelled`` once its caller was
    #: interrupted and left; ``wake`` the Event a wait should watch. ``INLINE`` on the caller's thread.
    job: object = INLINE
    #: The backend's own state of this call (its node or key in a queue), kept by its hooks.
    place: object = None
    #: Tries made so far (the first try sees 0).
    tries: int = 0
    #: Set by a try that was refused: seconds after which the lock may be free (the holder's remaining
    #: ttl, say); None when the server gave no hint.
    retry_after: float | None = None
    #: Set by a try, for backends whose waiters are notified: the notification-stream position seen
    #: before the try, so a release that lands between the try and the wait is not missed.
    notified_since: int | None = None
    #: Grants that came back after the ttl had run out (see ``refuse_after_late_grants``).
    late_grants: int = 0
    #: What the lease does once granted: passed on to it (``Lease``).
    auto_renew: bool = False
    max_hold: float | None = None
    #: The highest token of the alias this process had seen when the call began: a sound server grants
    #: above it (``distlock.backends.token_order``).
    token_floor: int = 0

    def remaining(self):
        """Seconds left of the caller's timeout (never below 0), or None for no limit."""
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)

    def out_of_time(self):
        """True if the caller will not wait any longer: a non-blocking attempt, or its timeout passed."""
        return not self.blocking or (self.deadline is not None and time.monotonic() >= self.deadline)


@dataclass(frozen=True)
class LockInfo:
    """One lock as the server reports it, for the admin page and ``distlock list``."""

    alias: str
    name: str
    owner: str
    #: The holder's fencing token as its lease shows it; None if it does not fit below ``TOKEN_EPOCH``.
    token: int | None
    acquired_at: datetime | None = None
    expires_at: datetime | None = None
    host: str = ""
    pid: int | None = None
    task_id: str = ""


class LockPage(list):
    """One page of ``held_locks()``: the ``LockInfo`` of held locks, and ``cursor``, which asks for the next page.

    A list, so code written before pages iterates it as before. ``cursor`` is None on the last page.
    """

    def __init__(self, infos=(), cursor=None):
        super().__init__(infos)
        self.cursor = cursor


def check_page(limit, cursor):
    """Raise ``TypeError``/``ValueError`` for a ``held_locks()`` page that no backend could serve, before any I/O."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
        raise TypeError(f"limit must be a positive int or None, not {type(limit).__name__}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1, not {limit}")
    if cursor is not None and not isinstance(cursor, str):
        raise TypeError(f"cursor must be the str a page's cursor gave, or None, not {type(cursor).__name__}")


def page_of(infos, limit, cursor):
    """Return the ``LockPage`` of the first ``limit`` of ``infos`` by name after the name ``cursor``.

    For backends that read every held lock anyway; the others page on the server.
    """
    check_page(limit, cursor)
    return cut_page(sorted((info for info in infos if cursor is None or info.name > cursor),
                           key=lambda info: info.name), limit)


def cut_page(ordered, limit):
    """Return the ``LockPage`` of the first ``limit`` of ``ordered`` (by name); its cursor is its last name."""
    if limit is None or len(ordered) <= limit:
        return LockPage(ordered)
    return LockPage(ordered[:limit], ordered[limit - 1].name)


def operation_words(operation):
    """Return ``operation`` as words: a str as it is; a (verb phrase, lock name) pair as "verb phrase 'name'"."""
    return operation if isinstance(operation, str) else f"{operation[0]} {operation[1]!r}"


class _TranslatedErrors:
    """The block of ``BaseLockBackend.translate_errors``."""

    __slots__ = ("_backend", "_operation")

    def __init__(self, backend, operation):
        self._backend, self._operation = backend, operation

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, traceback):
        backend = self._backend
        if exc is None or isinstance(exc, BackendUnavailable) or not isinstance(exc, backend.client_errors):
            return False
        raise backend.unavailable(self._operation, backend._cause(exc)) from exc


class BaseLockBackend:
    """A lock server behind one ``DISTLOCK`` alias.

    ``acquire()`` is one loop for every backend (``_acquire_loop``). A backend implements:

    - ``_try_acquire(attempt)``: one try; a ``Grant``, or None while the lock is held;
    - ``_do_extend(lease, ttl)``, ``release_owned(name, owner)``, ``held_locks(prefix, limit=, cursor=)``,
      ``ping()``;
    - ``client_errors`` (the client's exceptions that mean "the server did not answer") and ``_cause(exc)``,
      so that ``translate_errors`` words every failure the same way on every backend.

    and, when its server offers more, overrides:

    - ``_wait_for_release(attempt, remaining)``: wait for a notification instead of backing off;
    - ``_hold``, ``_give_back_grant``, ``_give_up``: register a grant, give one back, leave a queue;
    - ``_do_release(lease)``: release through what the grant handed back (a znode path) rather than
      by name and owner;
    - ``_call(fn, give_back=...)``: run calls where an interrupt cannot break the client (``offload``).

    Argument checks, signals, renewal and metrics live above the backends, in ``distlock.api`` and
    ``distlock.lease``. docs/ARCHITECTURE.md walks through a whole call.
    """

    #: How operators know the server, in messages: "Redis", "ZooKeeper".
    label = "lock server"

    #: Capabilities (see the constants above) this backend provides.
    capabilities = frozenset()

    #: Exceptions of the client library that mean the server did not answer, or answered with an error
    #: (``translate_errors`` turns them into ``BackendUnavailable``).
    client_errors = ()

    #: True if every grant's token is above every token of the alias granted before it was asked for,
    #: whatever the lock's name (what the contract suite checks): with ``SAFE_FENCING_TOKENS``, a grant
    #: that breaks this makes the process refuse the server (``distlock.backends.token_order``). False
    #: for a server whose tokens grow per name only (an object's generation): not watched then.
    tokens_grow_alias_wide = True

    #: Option names of an earlier release: old name -> new name. They keep working for one release;
    #: the system checks warn (``distlock.W002``) and name the new one.
    renamed_options = {}

    #: Options every backend accepts.
    common_options = {
        "DEFAULT_TTL": Option((int, float), 30, check=positive_number, expected="a number of seconds"),
        "AUTO_RENEW": Option(bool, False),
        "MAX_HOLD": Option((int, float, type(None)), None, check=optional_positive_number,
                           expected="a number of seconds or None"),
        "TOKEN_EPOCH": Option(int, 0, check=token_epoch),
    }

    #: Options specific to the backend: name -> ``Option``.
    options = {}

    def __init__(self, alias, options):
        self.alias = alias
        self.settings = self.clean_options(alias, options)
        self._token_epoch = self.settings["TOKEN_EPOCH"]
        #: The order of the alias's tokens as this process saw it; refuses a server that went back.
        self.token_order = TokenOrder(self)
        self._watch_tokens = self.tokens_grow_alias_wide and SAFE_FENCING_TOKENS in self.capabilities
        #: The coroutines of this process waiting for a lock of the alias (``aacquire``).
        self._waiters = Waiters()

    def public_token(self, token):
        """Return the fencing token callers see for the backend's ``token`` (``token_in_epoch``), or None."""
        return token_in_epoch(self._token_epoch, token)

    @classmethod
    def clean_options(cls, alias, options):
        """Return the options with defaults filled in; raise ``ImproperlyConfigured`` naming the bad one.

        Does no I/O, so the system checks can call it while servers are down.
        """
        if options is None:
            options = {}
        if not isinstance(options, dict):
            raise ImproperlyConfigured(f"DISTLOCK['{alias}']['OPTIONS'] must be a dict, got {redact(repr(options))}.")
        options = cls._renamed(alias, options)
        schema = {**cls.common_options, **cls.options}
        unknown = sorted(set(options) - set(schema))
        if unknown:
            raise ImproperlyConfigured(
                f"DISTLOCK['{alias}']['OPTIONS'] has unknown option(s) {', '.join(unknown)} for "
                f"{cls.__module__}.{cls.__name__}; accepted: {', '.join(sorted(schema))}."
            )
        cleaned = {}
        for name, option in schema.items():
            if name in options:
                cleaned[name] = option.clean(alias, name, options[name])
            elif option.required:
                raise ImproperlyConfigured(
                    f"DISTLOCK['{alias}']['OPTIONS'] needs '{name}' ({option.expected}) for {cls.__name__}."
                )
            else:
                cleaned[name] = option.default
        if cleaned["TOKEN_EPOCH"] and SAFE_FENCING_TOKENS not in cls.capabilities:
            raise ImproperlyConfigured(
                f"DISTLOCK['{alias}']['OPTIONS']['TOKEN_EPOCH'] is set, but {cls.__name__} issues no safe fencing "
                "tokens to place in an epoch; leave it out."
            )
        cls.check_combination(alias, cleaned)
        return cleaned

    @classmethod
    def _renamed(cls, alias, options):
        """Return ``options`` with each old name of ``renamed_options`` moved to its new name."""
        renamed = dict(options)
        for old, new in cls.renamed_options.items():
            if old in renamed:
                if new in renamed:
                    raise ImproperlyConfigured(
                        f"DISTLOCK['{alias}']['OPTIONS'] sets both '{new}' and its old name '{old}'; keep '{new}' only."
                    )
                renamed[new] = renamed.pop(old)
        return renamed

    @classmethod
    def old_option_names(cls, options):
        """Return the (old, new) name pairs of ``renamed_options`` that ``options`` (as configured) still uses."""
        if not isinstance(options, dict):
            return []
        return [(old, new) for old, new in cls.renamed_options.items() if old in options]

    @classmethod
    def check_combination(cls, alias, options):
        """Raise ``ImproperlyConfigured`` for options that are fine alone but not together."""

    @classmethod
    def security_warnings(cls, alias, options):
        """Return what is left open in this alias's cleaned options (no TLS, no credentials); no I/O.

        The system checks show each as ``distlock.W001`` when ``DEBUG`` is off.
        """
        return []

    @classmethod
    def key_spaces(cls, alias, options):
        """Return the (server, key prefix) pairs this alias keeps its keys in, from cleaned options (no I/O).

        The system checks refuse two aliases that share one: each would read the other's keys as its
        own (a Redlock hash where a Redis lock string is expected).
        """
        return ()

    def __repr__(self):
        return f"<{type(self).__name__} alias={self.alias!r}>"

    @property
    def token_is_safe(self):
        return SAFE_FENCING_TOKENS in self.capabilities

    # -- errors: one idiom, one wording -----------------------------------------------------------

    def translate_errors(self, operation):
        """Return a context manager that turns the client's failures inside it into ``BackendUnavailable``.

        ``operation`` says what the call was doing, as a verb phrase: "acquire lock 'orders'", or as a
        (verb phrase, lock name) pair, worded only if the call fails (see ``operation_words``). A class
        rather than a generator: it wraps every request of every backend.
        """
        return _TranslatedErrors(self, operation)

    def unavailable(self, operation, cause):
        """Return the ``BackendUnavailable`` every backend raises: alias, server, operation and cause.

        "Lock alias 'default' (Redis) could not acquire lock 'orders': Connection refused." The message is
        redacted by ``BackendUnavailable`` itself.
        """
        return BackendUnavailable(
            f"Lock alias '{self.alias}' ({self.label}) could not {operation_words(operation)}: {cause}.")

    def _cause(self, exc):
        """Return the words for a client exception in ``unavailable``; backends add hints (TLS, ACLs)."""
        return str(exc).rstrip(".") or type(exc).__name__

    def require(self, capability, feature):
        """Raise ``NotSupported`` naming this backend, the alias and the backends that have ``capability``."""
        if capability not in self.capabilities:
            raise NotSupported(
                f"Lock alias '{self.alias}' ({self.label}) does not support {feature}; use an alias whose backend "
                f"does: {', '.join(SUPPORTED_BY[capability])}."
            )

    # -- acquiring -------------------------------------------------------------------------------

    def acquire(self, name, *, ttl, timeout, blocking, auto_renew=False, max_hold=None):
        """Return a ``Lease`` on ``name``, waiting up to ``timeout`` seconds (None: forever) if blocking.

        Raise ``LockNotAcquired`` on a miss or timeout and ``BackendUnavailable`` if the server is down.
        """
        return self._acquire(name, None, ttl=ttl, timeout=timeout, blocking=blocking, auto_renew=auto_renew,
                             max_hold=max_hold)

    def acquire_shared(self, name, mode, *, ttl, timeout, blocking, auto_renew=False, max_hold=None):
        """Return a ``Lease`` on the read/write lock ``name``: ``mode`` "read" (shared) or "write" (exclusive).

        Raise ``NotSupported`` unless the backend declares ``READ_WRITE``.
        """
        self.require(READ_WRITE, "read/write locks (read_lock(), write_lock())")
        if mode not in ("read", "write"):
            raise ValueError(f'mode must be "read" or "write", got {mode!r}.')
        return self._acquire(name, mode, ttl=ttl, timeout=timeout, blocking=blocking, auto_renew=auto_renew,
                             max_hold=max_hold)

    def _acquire(self, name, mode, *, ttl, timeout, blocking, auto_renew, max_hold):
        attempt = self._new_attempt(name, mode, ttl=ttl, timeout=timeout, blocking=blocking, auto_renew=auto_renew,
                                    max_hold=max_hold)
        return self._call(functools.partial(self._acquire_loop, attempt), give_back=self._give_back)

    def _new_attempt(self, name, mode, *, ttl, timeout, blocking, auto_renew, max_hold):
        """Return the ``Attempt`` of one acquire call; raise ``TokenRegression`` if the alias's server went back."""
        order = self.token_order
        if order.regression is not None:
            raise order.refusal()
        return Attempt(name=name, owner=new_owner(), ttl=ttl, blocking=blocking, timeout=timeout, mode=mode,
                       deadline=None if timeout is None else time.monotonic() + timeout,
                       auto_renew=auto_renew, max_hold=max_hold, token_floor=order.highest)

    def _acquire_loop(self, attempt, job):
        """The one acquire loop: try, wait, try again until granted, refused or out of time.

        Every exit without a lease gives up (``_give_up``), whatever the exception; every grant that
        cannot be handed out (late, or ``_hold`` refused it) is given back (``_give_back_grant``).
        """
        attempt.job = job
        try:
            while True:
                if job.cancelled:
                    raise Abandoned(attempt.name)
                lease = self._try_once(attempt)
                if lease is _TRY_AGAIN:
                    continue
                if lease is not None:
                    return lease
                if attempt.out_of_time():
                    raise LockNotAcquired(self.not_acquired_message(attempt))
                self._wait_for_release(attempt, attempt.remaining())
        except BaseException as exc:
            self._give_up(attempt, exc)
            raise

    def _try_once(self, attempt):
        """Make one try: return the ``Lease``, None while the lock is held, or ``_TRY_AGAIN`` at once.

        ``_TRY_AGAIN`` follows a grant that could not be handed out (late, or ``_hold`` refused it),
        which was given back. Raise ``LockNotAcquired`` once such grants leave no time or hope.
        """
        attempt.retry_after = None
        started = time.monotonic()
        grant = self._try_acquire(attempt)
        attempt.tries += 1
        if grant is None:
            return None
        lease = self.make_lease(attempt, started, grant)
        late = lease.remaining() <= 0
        if not late and self._hold(lease, attempt):
            return lease
        # Late (a pause, a slow server): another owner may hold the lock by now. Or the backend
        # refused to hold it (its session ended meanwhile). Never hand it out.
        self._give_back_grant(lease, attempt)
        if late:
            attempt.late_grants += 1
            refuse_after_late_grants(attempt.late_grants, self.alias, attempt.name, attempt.ttl)
        if attempt.deadline is not None and time.monotonic() >= attempt.deadline:
            raise LockNotAcquired(self.not_acquired_message(
                attempt, "its grant came back after its ttl had run out, or after its session ended"))
        return _TRY_AGAIN

    # -- acquiring from a coroutine --------------------------------------------------------------
    # The same tries, waits and clean-ups as ``_acquire_loop``, for ``distlock.aacquire``: each try
    # (and the clean-up) runs on a thread of ``offload``'s pool, and the waits between tries are the
    # event loop's, so a waiting coroutine holds no thread. The waits poll (``_async_pause``), whatever
    # the server can push: a release made in this process wakes the longest waiting coroutine at once
    # (``_waiters``); a release elsewhere is seen at the next poll.

    async def aacquire(self, name, *, ttl, timeout, blocking, auto_renew=False, max_hold=None):
        """``acquire()`` for a coroutine: the server calls run on worker threads, the waits on the event loop.

        Cancelled, it leaves nothing on the server: a try in flight runs to its end and what it was
        granted is given back, then the attempt gives up (a place in a queue) before the
        ``CancelledError`` propagates.
        """
        return await self._aacquire(name, None, ttl=ttl, timeout=timeout, blocking=blocking, auto_renew=auto_renew,
                                    max_hold=max_hold)

    async def aacquire_shared(self, name, mode, *, ttl, timeout, blocking, auto_renew=False, max_hold=None):
        """``acquire_shared()`` for a coroutine, as ``aacquire()``."""
        self.require(READ_WRITE, "read/write locks (read_lock(), write_lock())")
        if mode not in ("read", "write"):
            raise ValueError(f'mode must be "read" or "write", got {mode!r}.')
        return await self._aacquire(name, mode, ttl=ttl, timeout=timeout, blocking=blocking, auto_renew=auto_renew,
                                    max_hold=max_hold)

    async def _aacquire(self, name, mode, *, ttl, timeout, blocking, auto_renew, max_hold):
        attempt = self._new_attempt(name, mode, ttl=ttl, timeout=timeout, blocking=blocking, auto_renew=auto_renew,
                                    max_hold=max_hold)
        waiter = pending = None
        try:
            while True:
                if waiter is not None:
                    waiter.clear()  # before the try: a release during it ends the pause after it at once
                pending = offload.submit(self._try_once, attempt)
                # Cancelled here, before the try started, the try never starts; once started, it runs to its end.
                lease = await asyncio.wrap_future(pending)
                pending = None
                if lease is _TRY_AGAIN:
                    continue
                if lease is not None:
                    return lease
                if attempt.out_of_time():
                    raise LockNotAcquired(self.not_acquired_message(attempt))
                if waiter is None:
                    # After the first refused try, which queued the attempt where the server keeps a queue:
                    # local waiters are then woken roughly in the server's order.
                    waiter = self._waiters.add(name)
                elif waiter.woken:
                    # Woken by a release, refused all the same: the lock went to another waiter (the
                    # server's next in line, say), who may be waiting here too. Pass the wake-up on.
                    self._waiters.wake_next(name, waiter)
                await waiter.wait(self._async_pause(attempt, attempt.remaining()))
        except BaseException as exc:
            # A cancelled (or closed) coroutine gives up like a caller interrupted on the sync side (``Abandoned``).
            reason = Abandoned(name) if isinstance(exc, (asyncio.CancelledError, GeneratorExit)) else exc
            cleanup = offload.submit(self._abandon, attempt, pending, reason)
            if not isinstance(exc, GeneratorExit):  # a closed coroutine may not await: the clean-up runs alone
                await offload.finish(cleanup)
            raise
        finally:
            if waiter is not None:
                self._waiters.discard(name, waiter)

    def _abandon(self, attempt, pending, reason):
        """Worker: end a coroutine's attempt that leaves without its lease, for ``reason``.

        ``pending`` is the try in flight when the coroutine left (a ``Future``), or None: its lease, if
        it was granted one, is given back once it ends. Then the attempt gives up. Errors are logged:
        the coroutine's exception is the one it leaves with.
        """
        try:
            if pending is not None and not pending.cancelled() and pending.exception() is None:
                lease = pending.result()
                if isinstance(lease, Lease):
                    self._give_back(lease)
        except Exception:
            logger.exception("Giving back lock %r (alias %r), granted to a coroutine that left, failed; nothing "
                             "renews it, so the server frees it when its ttl or session ends.", attempt.name, self.alias)
        try:
            self._give_up(attempt, reason)
        except Exception:
            logger.exception("Giving up the attempt on lock %r (alias %r) of a coroutine that left failed.",
                             attempt.name, self.alias)

    def _async_pause(self, attempt, remaining):
        """Return the seconds a coroutine's attempt waits before its next try, unless a local release wakes it.

        The back-off of ``_wait_for_release``, shortened to the server's hint (``attempt.retry_after``)
        and to the caller's timeout; ``ASYNC_LONGEST_PAUSE`` at most.
        """
        delay = _backoff(attempt, longest=ASYNC_LONGEST_PAUSE)
        if attempt.retry_after is not None and attempt.retry_after > 0:
            delay = min(delay, attempt.retry_after)
        if remaining is not None:
            delay = min(delay, remaining)
        return max(delay, 0.0)

    def not_acquired_message(self, attempt, why=None):
        """The one ``LockNotAcquired`` message: the lock, the alias, and why (held, or ``why``)."""
        if why is None:
            why = ("it is held (non-blocking attempt)" if not attempt.blocking
                   else f"still held after {attempt.timeout:g}s")
        return f"Lock {attempt.name!r} on alias '{self.alias}' not acquired: {why}."

    def make_lease(self, attempt, started, grant):
        """Return the whole ``Lease`` for ``grant`` (renewal included); validity counts from ``started``.

        ``started`` is when the granting request was sent. A token that does not fit below
        ``TOKEN_EPOCH`` is no fencing token: the grant is given back and ``BackendUnavailable`` raised.
        A token at or below one the alias granted before the call began means its server went back:
        the grant is given back and ``TokenRegression`` raised (``distlock.backends.token_order``).
        """
        token = self.public_token(grant.token)
        lease = Lease(
            backend=self, name=attempt.name, owner=attempt.owner, token=grant.token if token is None else token,
            ttl=attempt.ttl, started=started, validity=attempt.ttl if grant.validity is None else grant.validity,
            acquired_at=grant.acquired_at, handle=grant.handle, session_timeout=grant.session_timeout,
            attempts=attempt.tries, auto_renew=attempt.auto_renew, max_hold=attempt.max_hold,
        )
        if token is None:
            try:
                self._give_back_grant(lease, attempt)
            finally:
                raise BackendUnavailable(
                    f"Lock {attempt.name!r} on alias '{self.alias}' was given back: the server issued token "
                    f"{grant.token}, which does not fit below TOKEN_EPOCH {self._token_epoch} (tokens below "
                    f"2**{EPOCH_SHIFT}); leave DISTLOCK['{self.alias}']['OPTIONS']['TOKEN_EPOCH'] out for this server."
                )
        if self._watch_tokens:
            refusal = self.token_order.check_grant(grant.token, attempt.token_floor, attempt.name)
            if refusal is not None:
                try:
                    self._give_back_grant(lease, attempt)
                finally:
                    raise refusal
        return lease

    # The hooks of the acquire loop.

    def _call(self, fn, *, give_back=None):
        """Return ``fn(job)``. Backends whose client an interrupt can break run it elsewhere (``offload``).

        ``give_back(value)`` gives back what ``fn`` returned if the caller was interrupted and left.
        """
        return fn(INLINE)

    def _try_acquire(self, attempt):
        """Try once; return a ``Grant``, or None if another owner holds the lock (or the try must be repeated).

        ``attempt.deadline`` (monotonic, or None) bounds how long the network call may take. The record
        on the server carries ``attempt.owner`` and ``distlock.holder.current_holder()`` (host, pid,
        task id). A refused try may set ``attempt.retry_after``, or keep its place in a queue in
        ``attempt.place``, for the wait that follows.
        """
        raise NotImplementedError(f"{type(self).__name__} must provide _try_acquire()")

    def _wait_for_release(self, attempt, remaining):
        """Block until the lock may be free again, at most ``remaining`` seconds (None: no limit).

        The default is a jittered exponential back-off (``_back_off``), for servers that cannot notify.
        """
        time.sleep(self._back_off(attempt, remaining))

    def _back_off(self, attempt, remaining):
        """Return the seconds of the pause after a refused try: 10 ms doubling to 200 ms, within ``remaining``.

        Times a random 0.5-1.0: jitter keeps contenders from retrying in lock step.
        """
        delay = _backoff(attempt)
        if remaining is not None:
            delay = min(delay, remaining)
        return max(delay, 0)

    def _hold(self, lease, attempt):
        """Register a granted, timely lease with the backend; return False if it cannot be held after all.

        Session backends refuse a grant whose session ended before it was registered.
        """
        return True

    def _give_back_grant(self, lease, attempt):
        """Delete the record of a grant that will not be handed out (late, refused by ``_hold``)."""
        self._do_release(lease)

    def _give_up(self, attempt, reason):
        """Withdraw what the tries of an attempt leaving without the lock left on the server (a place in a queue).

        ``reason`` is the exception the attempt ends with. Must not block for long: after
        ``BackendUnavailable`` talking to the server again would stretch the caller's timeout, so such
        leftovers are deleted in the background or expire on their own.
        """

    def _give_back(self, lease):
        """Release a lease granted to a caller that was interrupted before it could take it."""
        logger.info("Releasing lock %r (alias %r, token %s): the call that acquired it was interrupted.",
                    lease.name, self.alias, lease.token)
        self._do_release(lease)

    # -- holding -------------------------------------------------------------------------------

    def release(self, lease):
        """Delete the lock if ``lease`` still owns it; return True if it did (compare-and-delete).

        Then wakes the coroutine of this process that has waited longest for the lock (``aacquire``).
        """
        try:
            return self._do_release(lease)
        finally:
            self._waiters.wake(lease.name)

    def _do_release(self, lease):
        """Release ``lease``; by default ``release_owned(lease.name, lease.owner)``."""
        return self.release_owned(lease.name, lease.owner)

    def extend(self, lease, ttl):
        """Make the lock expire ``ttl`` seconds from now if ``lease`` still owns it; return False if lost."""
        return self._do_extend(lease, ttl)

    def _do_extend(self, lease, ttl):
        raise NotImplementedError(f"{type(self).__name__} must provide _do_extend()")

    def extend_many(self, requests):
        """Extend each ``(lease, ttl)`` of ``requests``; return, in their order, True (extended), False (lost)
        or the exception its extension raised.

        The renewal scheduler calls it once per round with every lease due. One ``extend`` each by
        default; a backend that can extend many locks in one round trip overrides it.
        """
        outcomes = []
        for lease, ttl in requests:
            try:
                outcomes.append(self.extend(lease, ttl))
            except Exception as exc:  # noqa: BLE001 - handed to the scheduler, lease by lease
                outcomes.append(exc)
        return outcomes

    def session_valid_until(self, lease):
        """Return the ``time.monotonic()`` after which ``lease``'s session may be gone on the server, or None.

        Local and cheap (``lease.check()`` calls it): backends whose server frees locks with a session
        report what they last heard; backends without sessions return None.
        """
        return None

    def trusted_validity(self, ttl):
        """Return how long an extension to ``ttl`` can be trusted, counted from when its request was sent.

        The full ``ttl``, unless the servers' clocks may run fast (Redlock subtracts its drift allowance).
        """
        return ttl

    # -- operating -----------------------------------------------------------------------------

    def held_locks(self, prefix="", *, limit=None, cursor=None):
        """Return a ``LockPage`` of the locks held whose name starts with ``prefix``: every one, or ``limit`` of them.

        Ordered by name (Redis: in ``SCAN`` order, where a page may hold a few more than ``limit``; etcd:
        in key order, the order of the percent-encoded names, each page sorted).
        ``cursor``: the ``cursor`` of the page before, to get the next one; an opaque string.
        """
        raise NotImplementedError(f"{type(self).__name__} must provide held_locks()")

    def release_owned(self, name, owner):
        """Delete lock ``name`` only if ``owner`` still holds it (compare-and-delete); return True if deleted.

        A lease's release and an operator's release (admin, ``distlock release``) both end here.
        """
        raise NotImplementedError(f"{type(self).__name__} must provide release_owned()")

    def force_release(self, name, owner):
        """Deprecated name of ``release_owned`` (it always compared the owner); removed in distlock 2.0."""
        warnings.warn(f"{type(self).__name__}.force_release() is deprecated; call release_owned().",
                      DeprecationWarning, stacklevel=2)
        return self.release_owned(name, owner)

    def lock_info(self, name, record, *, token, owner=None, acquired_at=None, expires_at=None):
        """Return the ``LockInfo`` of lock ``name`` from its holder ``record`` (``read_holder_record``)."""
        return LockInfo(
            alias=self.alias, name=name, owner=record["owner"] if owner is None else owner,
            token=self.public_token(token), acquired_at=acquired_at, expires_at=expires_at,
            host=record["host"], pid=record["pid"], task_id=record["task_id"],
        )

    def foreign_records(self):
        """Return a description of each record under this alias's namespace that the lock protocol ignores.

        Planted by hand or by another program (a persistent znode among ZooKeeper contenders, say):
        harmless to the locks, reported by ``distlock check``.
        """
        return []

    def ping(self):
        """Make one round trip to the server; raise ``BackendUnavailable`` if it does not answer."""
        raise NotImplementedError(f"{type(self).__name__} must provide ping()")

    def close(self):
        """Release connections and sessions; held leases on session backends are lost."""
