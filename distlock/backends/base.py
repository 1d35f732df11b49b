"""The base class every lock backend implements, and the option schema the system checks share."""

import math
import random
import time
from dataclasses import dataclass
from datetime import datetime

from django.core.exceptions import ImproperlyConfigured

from distlock.exceptions import BackendUnavailable, LockNotAcquired
from distlock.holder import new_owner
from distlock.lease import Lease
from distlock.redaction import redact
from distlock.validation import MAX_SECONDS

#: Capabilities a backend may declare in ``capabilities``:
#: ``safe_fencing_tokens``: tokens never go backwards, so stores may trust them (``lease.token_is_safe``).
#: ``read_write``: ``read_lock()`` / ``write_lock()`` are supported.
#: ``notifications``: waiters are woken by the server instead of polling.
SAFE_FENCING_TOKENS = "safe_fencing_tokens"
READ_WRITE = "read_write"
NOTIFICATIONS = "notifications"


class Option:
    """One entry of a backend's ``OPTIONS``: its accepted types, default and an optional extra check.

    ``check`` receives the value and returns an error message, or None when the value is fine.
    """

    def __init__(self, types, default=None, *, required=False, check=None, expected=None):
        self.types = types if isinstance(types, tuple) else (types,)
        self.default = default
        self.required = required
        self.check = check
        self.expected = expected or " or ".join(t.__name__ for t in self.types)

    def clean(self, alias, name, value):
        # bool is an int subclass; a TTL of True is a typo, not a number.
        if not isinstance(value, self.types) or (isinstance(value, bool) and bool not in self.types):
            raise ImproperlyConfigured(
                f"DISTLOCK['{alias}']['OPTIONS']['{name}'] must be {self.expected}, got {redact(repr(value))}."
            )
        problem = self.check(value) if self.check else None
        if problem:
            raise ImproperlyConfigured(
                f"DISTLOCK['{alias}']['OPTIONS']['{name}'] {problem}, got {redact(repr(value))}."
            )
        return value


def positive_number(value):
    """Return an error unless ``value`` is a finite number of seconds above zero, at most ``MAX_SECONDS``."""
    if not math.isfinite(value) or value <= 0 or value > MAX_SECONDS:
        return f"must be a finite number of seconds above zero and at most {MAX_SECONDS:g}"
    return None


def optional_positive_number(value):
    return None if value is None else positive_number(value)


def positive_count(value):
    """Return an error unless ``value`` (an int) is at least 1."""
    return None if value >= 1 else "must be at least 1"


#: Bits of a fencing token left to the backend's own token below ``TOKEN_EPOCH``: room for every
#: backend's tokens (locmem's are microseconds since 1970, below 2**52 until 2112; ZooKeeper's zxids
#: while its leader epoch is below 2**20), and the epoch above them stays within a signed 64-bit column.
EPOCH_SHIFT = 52
MAX_TOKEN_EPOCH = 2 ** (63 - EPOCH_SHIFT) - 1


def token_epoch(value):
    """Return an error unless ``value`` is a ``TOKEN_EPOCH`` (0 to ``MAX_TOKEN_EPOCH``)."""
    return None if 0 <= value <= MAX_TOKEN_EPOCH else f"must be between 0 and {MAX_TOKEN_EPOCH}"


def token_in_epoch(epoch, token):
    """Return the backend's ``token`` placed in ``epoch``, or None if it does not fit below the epoch.

    Tokens of one backend compare only with each other: an alias pointed at another backend, or at a
    server started afresh, issues tokens below those its fenced rows already store, and every write
    would be refused as stale. Raising ``TOKEN_EPOCH`` puts every new token above every earlier one.
    """
    if not epoch:
        return token
    if not 0 <= token < 1 << EPOCH_SHIFT:
        return None
    return epoch << EPOCH_SHIFT | token


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


@dataclass
class Attempt:
    """One ``acquire()`` call as its tries and waits see it.

    The base class makes one per call and passes it to ``_try_acquire`` and ``_wait_for_release``,
    so what a try learns (the server's hint of when to look again, a position in a notification
    stream) reaches the wait that follows without per-thread state in the backend.
    """

    name: str
    #: The random owner id every try of this call stores on the server.
    owner: str
    ttl: float
    blocking: bool
    #: ``time.monotonic()`` by which the call must end, or None for no limit.
    deadline: float | None
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


class BaseLockBackend:
    """A lock server behind one ``DISTLOCK`` alias.

    Subclasses implement ``_try_acquire``, ``_do_release``, ``_do_extend``, ``held_locks`` and
    ``force_release``; they override ``_wait_for_release`` when the server can notify waiters.
    Argument checks, signals, renewal and metrics live above the backends, in ``distlock.api`` and
    ``distlock.lease``.
    """

    #: Capabilities (see the constants above) this backend provides.
    capabilities = frozenset()

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
            raise ImproperlyConfigured(f"DISTLOCK['{alias}']['OPTIONS'] must be a dict, got {options!r}.")
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

    # -- acquiring -------------------------------------------------------------------------------

    def acquire(self, name, *, ttl, timeout, blocking):
        """Return a ``Lease`` on ``name``, waiting up to ``timeout`` seconds (None: forever) if blocking.

        Raise ``LockNotAcquired`` on a miss or timeout and ``BackendUnavailable`` if the server is down.
        """
        attempt = Attempt(name=name, owner=new_owner(), ttl=ttl, blocking=blocking,
                          deadline=None if timeout is None else time.monotonic() + timeout)
        try:
            while True:
                started = time.monotonic()
                attempt.retry_after = None
                grant = self._try_acquire(attempt)
                attempt.tries += 1
                if grant is not None:
                    lease = self.make_lease(name, attempt.owner, ttl, started, grant)
                    if lease.remaining() > 0:
                        lease.attempts = attempt.tries
                        return lease
                    # Late (a pause, a slow server): another owner may hold the lock by now.
                    self._do_release(lease)
                    attempt.late_grants += 1
                    refuse_after_late_grants(attempt.late_grants, self.alias, name, ttl)
                    continue
                remaining = None if attempt.deadline is None else attempt.deadline - time.monotonic()
                if not blocking or (remaining is not None and remaining <= 0):
                    raise LockNotAcquired(self._not_acquired_message(name, blocking, timeout))
                self._wait_for_release(attempt, remaining)
        except LockNotAcquired:
            self._give_up(attempt)
            raise

    def _not_acquired_message(self, name, blocking, timeout):
        how = "it is held (non-blocking attempt)" if not blocking else f"still held after {timeout:g}s"
        return f"Lock {name!r} on alias '{self.alias}' not acquired: {how}."

    def make_lease(self, name, owner, ttl, started, grant):
        """Return the ``Lease`` for ``grant``; validity counts from ``started``, before the request was sent.

        A token that does not fit below ``TOKEN_EPOCH`` is no fencing token: the grant is given back.
        """
        token = self.public_token(grant.token)
        lease = Lease(
            backend=self, name=name, owner=owner, token=grant.token if token is None else token, ttl=ttl,
            started=started, validity=ttl if grant.validity is None else grant.validity,
            acquired_at=grant.acquired_at, handle=grant.handle, session_timeout=grant.session_timeout,
        )
        if token is None:
            try:
                self._do_release(lease)
            finally:
                raise BackendUnavailable(
                    f"Lock {name!r} on alias '{self.alias}' was given back: the server issued token {grant.token}, "
                    f"which does not fit below TOKEN_EPOCH {self._token_epoch} (tokens below 2**{EPOCH_SHIFT}); "
                    f"leave DISTLOCK['{self.alias}']['OPTIONS']['TOKEN_EPOCH'] out for this server."
                )
        return lease

    def _try_acquire(self, attempt):
        """Try once; return a ``Grant``, or None if another owner holds the lock.

        ``attempt.deadline`` (monotonic, or None) bounds how long the network call may take. The record
        on the server carries ``attempt.owner`` and ``distlock.holder.current_holder()`` (host, pid,
        task id). A refused try may set ``attempt.retry_after`` for the wait that follows.
        """
        raise NotImplementedError("subclasses of BaseLockBackend must provide _try_acquire()")

    def _give_up(self, attempt):
        """Undo what the tries of a call that missed or timed out left on the server (a place in a queue).

        Not called when the server failed (``BackendUnavailable``): talking to it again would stretch
        the caller's timeout, so such leftovers must expire on their own.
        """

    def _wait_for_release(self, attempt, remaining):
        """Block until the lock may be free again, at most ``remaining`` seconds (None: no limit).

        The default is a jittered exponential back-off (10 ms doubling to 200 ms), for servers that
        cannot notify; jitter keeps contenders from retrying in lock step.
        """
        delay = min(0.2, 0.01 * (2 ** min(attempt.tries - 1, 5))) * random.uniform(0.5, 1.0)
        if remaining is not None:
            delay = min(delay, remaining)
        time.sleep(max(delay, 0))

    # -- holding -------------------------------------------------------------------------------

    def release(self, lease):
        """Delete the lock if ``lease`` still owns it; return True if it did (compare-and-delete)."""
        return self._do_release(lease)

    def _do_release(self, lease):
        raise NotImplementedError("subclasses of BaseLockBackend must provide _do_release()")

    def extend(self, lease, ttl):
        """Make the lock expire ``ttl`` seconds from now if ``lease`` still owns it; return False if lost."""
        return self._do_extend(lease, ttl)

    def _do_extend(self, lease, ttl):
        raise NotImplementedError("subclasses of BaseLockBackend must provide _do_extend()")

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

    def held_locks(self, prefix=""):
        """Return the ``LockInfo`` of every lock currently held whose name starts with ``prefix``."""
        raise NotImplementedError("subclasses of BaseLockBackend must provide held_locks()")

    def force_release(self, name, owner):
        """Delete lock ``name`` only if ``owner`` still holds it (an operator's action); return True if deleted."""
        raise NotImplementedError("subclasses of BaseLockBackend must provide force_release()")

    def foreign_records(self):
        """Return a description of each record under this alias's namespace that the lock protocol ignores.

        Planted by hand or by another program (a persistent znode among ZooKeeper contenders, say):
        harmless to the locks, reported by ``distlock check``.
        """
        return []

    def ping(self):
        """Make one round trip to the server; raise ``BackendUnavailable`` if it does not answer."""
        raise NotImplementedError("subclasses of BaseLockBackend must provide ping()")

    def close(self):
        """Release connections and sessions; held leases on session backends are lost."""
