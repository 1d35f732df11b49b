"""Locks as rows of the ``distlock_lock`` table, judged by the database server's clock (PostgreSQL, SQLite).

Every statement runs in autocommit on a connection of the backend's own (checked out of a small
pool for the one call), never on Django's connection: a lock written inside the caller's uncommitted ``transaction.atomic()`` would be
invisible to every other process and exclude nobody. The locks are lease rows, not advisory locks:
session advisory locks belong to a server session, which a transaction-pooling proxy such as
PgBouncer hands to other clients between transactions, so they strand or vanish.
"""

import collections
import hashlib
import math
import os
import queue
import socket
import sqlite3
import threading
import time
import uuid
import weakref
import zoneinfo
from contextlib import nullcontext, suppress
from dataclasses import dataclass
from functools import partial
from datetime import timezone as dt_timezone

from django.apps import apps
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, ProgrammingError, connections, router
from django.db.backends.base.base import NO_DB_ALIAS
from django.db.backends.signals import connection_created
from django.db.utils import load_backend
from django.utils import timezone

from distlock.backends.base import (
    SAFE_FENCING_TOKENS,
    BaseLockBackend,
    Grant,
    LockInfo,
    Option,
    positive_count,
    positive_number,
)
from distlock.backends.green import green_library
from distlock.conf import is_shared_memory_database
from distlock.exceptions import BackendUnavailable, LockWouldDeadlock
from distlock.holder import current_holder
from distlock.waiting import mailbox

# ---------------------------------------------------------------------------------------------------
# The protocol. A lock is one row of distlock_lock (distlock.models.Lock), unique by name. A row whose
# expires_at has passed by the database's own clock is free: no statement uses the client's clock.
# Every statement compares the random owner id, so nobody changes a lock it does not hold.
# ---------------------------------------------------------------------------------------------------

# PostgreSQL, acquire: one statement, so one transaction; RETURNING gives (token, acquired_at,
# expires_at) when acquired, no row when the lock is held.
# - name_guard: a transaction-scoped advisory lock on (GUARD_NAMESPACE, hash of the name), released at
#   commit, so it cannot strand behind PgBouncer. It makes acquisitions of one name draw their tokens
#   one after the other: nextval() runs before the row is inserted, and without the guard another
#   process could draw a higher token, acquire and release the same name in between, and this insert
#   would then hold the lock with a lower token than its predecessor.
# - The token is nextval() of the alias-wide sequence (migration 0002): never reused, never rolled back.
# - ON CONFLICT takes the row over only if it has expired, or if it is this very call's own row (its
#   reply was lost with a broken connection and the call was retried).
PG_ACQUIRE = """
WITH name_guard AS MATERIALIZED (SELECT pg_advisory_xact_lock(%(guard_namespace)s, %(guard_key)s))
INSERT INTO distlock_lock AS held (name, owner, token, acquired_at, expires_at, host, pid, task_id)
SELECT %(name)s, %(owner)s, nextval('distlock_token_seq'), clock_timestamp(),
       clock_timestamp() + make_interval(secs => %(ttl)s), %(host)s, %(pid)s, %(task_id)s
FROM name_guard
ON CONFLICT (name) DO UPDATE
SET owner = EXCLUDED.owner, token = EXCLUDED.token, acquired_at = EXCLUDED.acquired_at,
    expires_at = EXCLUDED.expires_at, host = EXCLUDED.host, pid = EXCLUDED.pid, task_id = EXCLUDED.task_id
WHERE held.expires_at <= clock_timestamp() OR held.owner = EXCLUDED.owner
RETURNING token, acquired_at, expires_at
"""

# PostgreSQL, release (and force_release): compare-and-delete. Returns no row if the lock is not ours,
# else whether it was still unexpired; an expired row of ours is deleted too, to leave no litter,
# but reported False, since the lock had already lapsed.
PG_RELEASE = """
DELETE FROM distlock_lock WHERE name = %(name)s AND owner = %(owner)s
RETURNING expires_at > clock_timestamp()
"""

# PostgreSQL, extend: compare-and-extend; an expired lock stays lost even if nobody took it over.
PG_EXTEND = """
UPDATE distlock_lock SET expires_at = clock_timestamp() + make_interval(secs => %(ttl)s)
WHERE name = %(name)s AND owner = %(owner)s AND expires_at > clock_timestamp()
RETURNING expires_at
"""

PG_HELD = """
SELECT name, owner, token, acquired_at, expires_at, host, pid, task_id FROM distlock_lock
WHERE expires_at > clock_timestamp() AND left(name, %(prefix_length)s) = %(prefix)s
ORDER BY name
"""

# Keeps distlock's guard keys apart from the application's own two-key advisory locks ("dlk\0").
GUARD_NAMESPACE = 0x646C6B00

# SQLite, acquire: SQLite has one write slot per database. BEGIN IMMEDIATE takes it before anything
# is read, so each acquisition is serialized against every other writer of every process; tokens
# therefore strictly increase in the order locks are granted. Steps, in that one transaction:
SQLITE_BEGIN = "BEGIN IMMEDIATE"
# 1. The next alias-wide token: one more than the last, and never below the database clock in
#    microseconds, so a TokenSequence row deleted (a test-suite flush, a restore) does not send
#    tokens backwards.
SQLITE_NEXT_TOKEN = """
INSERT INTO distlock_tokensequence (id, value)
VALUES (1, CAST((julianday('now') - 2440587.5) * 86400000000 AS INTEGER))
ON CONFLICT (id) DO UPDATE SET value = max(value + 1, excluded.value)
RETURNING value
"""
# 2. The upsert, taking an expired row over (or this call's own row, as on PostgreSQL). Times are
#    stored as 'YYYY-MM-DD HH:MM:SS.SSS' UTC text from SQLite's clock: one fixed format, so text
#    comparison is time comparison, and Django reads it as a DateTimeField.
SQLITE_ACQUIRE = """
INSERT INTO distlock_lock (name, owner, token, acquired_at, expires_at, host, pid, task_id)
VALUES (:name, :owner, :token, strftime('%Y-%m-%d %H:%M:%f', 'now'),
        strftime('%Y-%m-%d %H:%M:%f', 'now', '+' || :ttl || ' seconds'), :host, :pid, :task_id)
ON CONFLICT (name) DO UPDATE
SET owner = excluded.owner, token = excluded.token, acquired_at = excluded.acquired_at,
    expires_at = excluded.expires_at, host = excluded.host, pid = excluded.pid, task_id = excluded.task_id
WHERE distlock_lock.expires_at <= excluded.acquired_at OR distlock_lock.owner = excluded.owner
RETURNING token, acquired_at, expires_at
"""
# 3. COMMIT if a row came back; otherwise ROLLBACK, which also gives the drawn token back.

SQLITE_RELEASE = """
DELETE FROM distlock_lock WHERE name = :name AND owner = :owner
RETURNING expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now')
"""

SQLITE_EXTEND = """
UPDATE distlock_lock SET expires_at = strftime('%Y-%m-%d %H:%M:%f', 'now', '+' || :ttl || ' seconds')
WHERE name = :name AND owner = :owner AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now')
RETURNING expires_at
"""

SQLITE_HELD = """
SELECT name, owner, token, acquired_at, expires_at, host, pid, task_id FROM distlock_lock
WHERE expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now') AND substr(name, 1, :prefix_length) = :prefix
ORDER BY name
"""

#: The shortest time a call may take, even at or past the caller's deadline: a last try made right at
#: the deadline (or a non-blocking one) must still be able to wait out another writer's commit.
MIN_CALL_BOUND = 1.0

#: The first SQLite with RETURNING.
MIN_SQLITE_VERSION = (3, 35)

#: libpq rounds a connect_timeout below 2 seconds up to 2.
MIN_CONNECT_TIMEOUT = 2

#: Seconds ``close()`` waits for the watchdog's thread to leave (a daemon: it cannot outlive the process).
STOP_WAIT = 5.0


@dataclass(eq=False)
class _Watch:
    fileno: int
    deadline: float
    fired: bool = False


class _Watching:
    """The block of one ``_Watchdog.watch``."""

    def __init__(self, watchdog, watch):
        self._watchdog, self._watch = watchdog, watch

    def __enter__(self):
        self._watchdog._add(self._watch)
        return self._watch

    def __exit__(self, exc_type, exc, traceback):
        self._watchdog._discard(self._watch)


class _Watchdog:
    """Shut down the socket of a PostgreSQL connection whose statement outlives its bound.

    psycopg has no client-side statement timeout, and TCP keeps the connection to a paused or
    black-holed server open indefinitely; shutting the socket down makes the blocked call fail at
    once. One daemon thread per backend, started on first use, asleep until the nearest deadline.
    """

    def __init__(self):
        self._forget_after_fork()
        watchdog = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (w := watchdog()) and w._forget_after_fork())

    def _forget_after_fork(self):
        # The parent's thread does not run in the child and may have held the lock at fork().
        self._lock = threading.Lock()  # a plain lock and a queue, never a Condition: see distlock.waiting
        self._wake = mailbox()
        self._watches = set()
        self._wake_at = math.inf
        self._thread = None
        self._stopping = False

    def watch(self, fileno, seconds):
        """Return a context manager that severs ``fileno`` if its block still runs after ``seconds``.

        It yields the ``_Watch``. A class, not a generator: see ``_Loan``.
        """
        return _Watching(self, _Watch(fileno, time.monotonic() + seconds))

    def _add(self, watch):
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                # An interrupt inside threading's is_alive() or join() can mark a running thread stopped:
                # wake the old thread, which leaves once its queue is no longer the current one.
                self._wake.put(None)
                self._wake = mailbox()
                self._stopping = False
                self._thread = threading.Thread(target=self._run, args=(self._wake,), name="distlock-db-watchdog",
                                                daemon=True)
                self._thread.start()
            self._watches.add(watch)
            if watch.deadline < self._wake_at:
                self._wake.put(None)

    def _discard(self, watch):
        # Under the lock, so the thread never severs a connection a later call uses.
        with self._lock:
            self._watches.discard(watch)

    def _run(self, wake):
        while True:
            with self._lock:
                if self._stopping or wake is not self._wake:
                    return
                now = time.monotonic()
                for watch in [watch for watch in self._watches if watch.deadline <= now]:
                    self._watches.discard(watch)
                    watch.fired = True
                    _shut_down(watch.fileno)
                self._wake_at = min((watch.deadline for watch in self._watches), default=math.inf)
            try:
                wake.get(timeout=None if self._wake_at == math.inf else self._wake_at - now)
            except queue.Empty:
                pass

    def stop(self):
        with self._lock:
            self._stopping = True
            self._wake.put(None)
            thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(STOP_WAIT)


def _shut_down(fileno):
    """Shut the socket down for both directions; the connection's owner closes the descriptor itself."""
    try:
        with socket.socket(fileno=os.dup(fileno)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by its owner: nothing left to interrupt


class _ConnectionPool:
    """The backend's own connections, each checked out by one call at a time and given back after it.

    Nothing is keyed by thread: OS thread idents and greenlet addresses are reused as soon as their
    thread ends, so a table keyed by them hands one caller's connection to another, and sweeping
    "dead" threads closes connections that live greenlets (invisible to ``threading.enumerate()``)
    are using mid-statement. Here only the caller that checked a connection out uses it, and only that
    caller closes it. At most ``size`` connections are open per process. A call that finds them all
    busy queues, and connections given back go to the queue in arrival order, except that calls which
    free or keep a lock (release, extend) go first: without that, threads that try a lock back to
    back take every returned connection again at once, and the holder's release waits behind them. After a fork the child forgets the parent's connections without
    closing them (closing would talk on the parent's sockets) and opens its own.
    """

    def __init__(self, connect, size):
        self._connect = connect
        self.size = size
        self._forget_all()
        pool = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (p := pool()) and p._forget_all())

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
            self._abandon(turn)
            raise

    def _withdraw(self, turn):
        """Take ``turn`` out of the queue (if there); False if a connection was handed to it already."""
        with self._lock:
            if turn.given:
                return False
            with suppress(ValueError):
                self._queue.remove(turn)
            return True

    def _abandon(self, turn):
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
            _close(wrapper)

    def close(self):
        """Close the idle connections now; those in use are closed when their call gives them back."""
        with self._lock:
            idle, self._idle = self._idle, []
            self._generation = object()
        for wrapper in idle:
            _close(wrapper)


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


def _close(wrapper):
    """Close ``wrapper`` (rolling back anything half done); its next use reconnects."""
    try:
        wrapper.close()
    except DatabaseError:
        pass  # the connection is already broken: closing it has nothing left to do


class _Dialect:
    """One database's side of the protocol: its statements, run the same way by both databases."""

    #: Release, extend and listing statements: set by each database below.
    RELEASE = EXTEND = HELD = None

    def release(self, cursor, params):
        cursor.execute(self.RELEASE, params)
        return cursor.fetchone()

    def extend(self, cursor, params):
        cursor.execute(self.EXTEND, params)
        return cursor.fetchone()

    def held(self, cursor, params):
        cursor.execute(self.HELD, params)
        return cursor.fetchall()

    def close(self):
        pass


class _PostgreSQL(_Dialect):
    """The PostgreSQL side of the protocol: statements, connect timeout, the watchdog."""

    RELEASE, EXTEND, HELD = PG_RELEASE, PG_EXTEND, PG_HELD

    def __init__(self):
        self.watchdog = _Watchdog()

    @staticmethod
    def connect(wrapper, bound, configured_options):
        if wrapper.connection is None:
            # The caller's bound, unless the project configured a shorter connect_timeout.
            configured = configured_options.get("connect_timeout") or math.inf
            wrapper.settings_dict["OPTIONS"]["connect_timeout"] = max(MIN_CONNECT_TIMEOUT,
                                                                      math.ceil(min(bound, configured)))
            wrapper.ensure_connection()

    def bounded(self, wrapper, bound):
        return self.watchdog.watch(wrapper.connection.fileno(), bound)

    @staticmethod
    def acquire(cursor, params):
        key = int.from_bytes(hashlib.blake2b(params["name"].encode(), digest_size=4).digest(), "big", signed=True)
        cursor.execute(PG_ACQUIRE, {**params, "guard_namespace": GUARD_NAMESPACE, "guard_key": key})
        return cursor.fetchone()

    @staticmethod
    def aware(value):
        # With USE_TZ, Django's psycopg loaders give aware datetimes; without it, naive ones in the
        # connection's time zone, which Django sets to TIME_ZONE.
        if timezone.is_aware(value):
            return value
        return timezone.make_aware(value, zoneinfo.ZoneInfo(settings.TIME_ZONE)).astimezone(dt_timezone.utc)

    def close(self):
        self.watchdog.stop()


class _SQLite(_Dialect):
    """The SQLite side of the protocol: statements, and the busy timeout as the bound."""

    RELEASE, EXTEND, HELD = SQLITE_RELEASE, SQLITE_EXTEND, SQLITE_HELD

    @staticmethod
    def connect(wrapper, bound, configured_options):
        wrapper.ensure_connection()
        # The busy timeout is how long a statement waits for the write slot: SQLite's only way to hang.
        wrapper.connection.execute(f"PRAGMA busy_timeout = {int(bound * 1000)}")

    @staticmethod
    def bounded(wrapper, bound):
        return nullcontext()  # the busy timeout set in connect() bounds every statement

    @staticmethod
    def acquire(cursor, params):
        try:
            cursor.execute(SQLITE_BEGIN)  # inside: an interrupt just after it must roll back too
            cursor.execute(SQLITE_NEXT_TOKEN)
            (token,) = cursor.fetchone()
            cursor.execute(SQLITE_ACQUIRE, {**params, "token": token})
            row = cursor.fetchone()
            cursor.execute("COMMIT" if row is not None else "ROLLBACK")
        except BaseException:
            cursor.connection.rollback()
            raise
        return row

    @staticmethod
    def aware(value):
        return value.replace(tzinfo=dt_timezone.utc)  # SQLite's clock is UTC; Django parses the text naive


DIALECTS = {"postgresql": _PostgreSQL, "sqlite": _SQLite}


def _engine_vendor(engine):
    """Return the vendor of a Django database ENGINE (imports it, does no I/O)."""
    return load_backend(engine).DatabaseWrapper.vendor


def lock_database(options):
    """The database of an alias's lock rows: its ``DATABASE`` option, else where the routers write ``Lock``.

    Without routers that is ``default``; a router that keeps the distlock app on a database of its own
    keeps the lock rows there too, next to the rejection log and the metrics.
    """
    if options["DATABASE"] is not None:
        return options["DATABASE"]
    return router.db_for_write(apps.get_model("distlock", "Lock"))


#: Seconds of the first pause after a shared-cache table lock (``_table_locked``); it doubles up to 50 ms.
TABLE_LOCKED_PAUSE = 0.001


def _table_locked(exc):
    """True for SQLite's "database table is locked": another connection of a shared cache holds the table."""
    return getattr(exc.__cause__, "sqlite_errorname", "").startswith("SQLITE_LOCKED")


def _is_private_memory_database(name):
    """True for an SQLite database only its own connection can see (":memory:", or no shared cache)."""
    name = str(name)
    return name in ("", ":memory:") or ("mode=memory" in name and "cache=shared" not in name)


class DatabaseBackend(BaseLockBackend):
    """Locks in the ``distlock_lock`` table of one Django database, PostgreSQL or SQLite.

    Acquire is one atomic statement (PostgreSQL) or one ``BEGIN IMMEDIATE`` transaction (SQLite) that
    also takes expired locks over and draws the next alias-wide fencing token. Waiters poll with a
    short jittered back-off. A call that cannot finish within ``STATEMENT_TIMEOUT`` (or the caller's
    timeout) raises ``BackendUnavailable``; on SQLite that includes the database staying locked by
    another writer. On SQLite, locking inside this thread's open transaction on the same database
    raises ``LockWouldDeadlock``.
    """

    capabilities = frozenset({SAFE_FENCING_TOKENS})

    options = {
        "DATABASE": Option((str, type(None)), None,
                           expected="the alias of a database in settings.DATABASES, or None (the database routers)"),
        "STATEMENT_TIMEOUT": Option((int, float), 5, check=positive_number, expected="a number of seconds"),
        "MAX_CONNECTIONS": Option(int, 10, check=positive_count, expected="a whole number of connections"),
    }

    def __init__(self, alias, options):
        super().__init__(alias, options)
        self.database = lock_database(self.settings)
        self.vendor = _engine_vendor(settings.DATABASES[self.database]["ENGINE"])
        self._dialect = DIALECTS[self.vendor]()
        # On Django's in-memory test database the lock rows get an in-memory database of their own
        # (``_memory_database``), whose shared cache lets one connection write at a time: calls take
        # turns on one connection, in the pool's order (release and extend first), instead of racing
        # for table locks, which a renewal could lose past its ttl.
        self._pool = _ConnectionPool(self._new_connection,
                                     1 if is_shared_memory_database(self.database) else self.settings["MAX_CONNECTIONS"])
        #: SQLite's calls are C calls that never yield to a gevent or eventlet hub: each call yields first, so
        #: a loop of lock calls still lets timers (a time limit), renewals and other green threads run.
        self._yields = self.vendor == "sqlite" and green_library() is not None
        #: (name, keeper connection) of the lock rows' own in-memory database, if any (``_memory_database``).
        self._memory = None
        self._memory_lock = threading.Lock()
        connection_created.connect(self._close_before_database_maintenance, weak=True)

    @classmethod
    def check_combination(cls, alias, options):
        database = lock_database(options)
        if database not in settings.DATABASES:
            source = ("is" if options["DATABASE"] is not None
                      else "is not set, and the database routers give for writing distlock's Lock is")
            raise ImproperlyConfigured(
                f"DISTLOCK['{alias}']['OPTIONS']['DATABASE'] {source} '{database}', which is not in "
                f"settings.DATABASES (configured: {', '.join(map(repr, settings.DATABASES))})."
            )
        entry = settings.DATABASES[database]
        try:
            vendor = _engine_vendor(entry.get("ENGINE", ""))
        except ImproperlyConfigured as exc:
            raise ImproperlyConfigured(f"DISTLOCK['{alias}']: DATABASES['{database}']['ENGINE']: {exc}") from exc
        if vendor not in DIALECTS:
            raise ImproperlyConfigured(
                f"DISTLOCK['{alias}']['OPTIONS']['DATABASE'] names '{database}', whose vendor is '{vendor}'; the "
                "database backend supports PostgreSQL and SQLite. Use one of those, or another lock backend."
            )
        if vendor == "sqlite" and sqlite3.sqlite_version_info < MIN_SQLITE_VERSION:
            raise ImproperlyConfigured(
                f"DISTLOCK['{alias}']: the database backend needs SQLite {'.'.join(map(str, MIN_SQLITE_VERSION))} "
                f"or later (for RETURNING); this Python uses SQLite {sqlite3.sqlite_version}."
            )
        if vendor == "sqlite" and _is_private_memory_database(entry.get("NAME", "")):
            raise ImproperlyConfigured(
                f"DISTLOCK['{alias}']['OPTIONS']['DATABASE'] names '{database}', an in-memory SQLite database that "
                "only one connection can see; locks need a database file every process opens."
            )

    # -- connections ---------------------------------------------------------------------------------

    def _new_connection(self):
        """Return a new, not yet connected wrapper for ``DATABASE``, in autocommit, outside Django's pool."""
        databases = {
            alias: {**entry, "OPTIONS": dict(entry.get("OPTIONS", {})), "TEST": dict(entry.get("TEST", {}))}
            for alias, entry in settings.DATABASES.items()
        }
        entry = connections.configure_settings(databases)[self.database]
        # Django keeps one pool per alias, shared with the ORM; this connection is the backend's own.
        entry["OPTIONS"].pop("pool", None)
        entry["AUTOCOMMIT"] = True
        if is_shared_memory_database(self.database):
            entry["NAME"] = self._memory_database(entry)
        wrapper = load_backend(entry["ENGINE"]).DatabaseWrapper(entry, self.database)
        # Whichever thread checks it out next uses it (one at a time), and may close it.
        wrapper.inc_thread_sharing()
        return wrapper

    def _memory_database(self, entry):
        """Return the name of this backend's own in-memory database, made with the lock tables at first use.

        Django's SQLite test database is in memory with a shared cache, whose table locks never wait:
        while a lock statement wrote, the tests' own ORM writes failed with "database table is locked".
        Lock rows in an in-memory database of their own share no cache with them, and no other process
        could see either database. A keeper connection holds it until ``close()``.
        """
        with self._memory_lock:
            if self._memory is None:
                name = f"file:distlock-{self.alias}-{uuid.uuid4().hex}?mode=memory&cache=shared"
                keeper = load_backend(entry["ENGINE"]).DatabaseWrapper({**entry, "NAME": name}, self.database)
                keeper.inc_thread_sharing()
                with keeper.schema_editor() as editor:
                    editor.create_model(apps.get_model("distlock", "Lock"))
                    editor.create_model(apps.get_model("distlock", "TokenSequence"))
                self._memory = (name, keeper)
            return self._memory[0]

    def close(self):
        self._pool.close()
        self._dialect.close()
        with self._memory_lock:
            memory, self._memory = self._memory, None
        if memory is not None:
            _close(memory[1])

    def _close_before_database_maintenance(self, *, connection, **kwargs):
        """Close the idle connections when Django connects to no database in particular (``NO_DB_ALIAS``).

        Django does so to create or drop a test database: idle connections of ours to it made the
        DROP fail ("is being accessed by other users"), and ``manage.py test`` exit 1. The next lock
        call reconnects.
        """
        if connection.alias == NO_DB_ALIAS and connection.vendor == self.vendor:
            self._pool.close()

    # -- running the protocol ----------------------------------------------------------------------

    def _call_bound(self, deadline):
        """Seconds one call may take: STATEMENT_TIMEOUT, cut to the caller's remaining timeout."""
        limit = self.settings["STATEMENT_TIMEOUT"]
        if deadline is None:
            return limit
        return min(limit, max(deadline - time.monotonic(), MIN_CALL_BOUND))

    def _run(self, step, params, *, deadline=None, urgent=False):
        """Return ``step(cursor, params)`` run on a connection of the pool, within the call's bound.

        Every database error drops the connection (so no half-done transaction survives) and becomes
        ``BackendUnavailable``. A reused connection found broken (a server restart, an idle connection
        cut) is replaced and the call retried once: every step is safe to repeat for its owner.
        ``urgent`` calls (release, extend) go ahead of the others waiting for a connection.
        """
        if self._yields:
            time.sleep(0)  # patched: a switch to the hub
        bound = self._call_bound(deadline)
        ends = time.monotonic() + bound
        configured_options = settings.DATABASES[self.database].get("OPTIONS", {})
        retried, table_locked = False, 0
        while True:
            with self._pool.connection(ends, partial(self._pool_busy, bound), urgent=urgent) as wrapper:
                reused = wrapper.connection is not None
                watch = None
                try:
                    with wrapper.wrap_database_errors:
                        self._dialect.connect(wrapper, ends - time.monotonic(), configured_options)
                        with self._dialect.bounded(wrapper, ends - time.monotonic()) as watch:
                            cursor = wrapper.connection.cursor()
                            try:
                                return step(cursor, params)
                            finally:
                                # An interrupt between execute() and the last row leaves the statement
                                # unfinished, and an unfinished SQLite write keeps the write slot, even
                                # past closing the connection, until the cursor is collected (the
                                # interrupt's traceback keeps it). Closing the cursor ends the statement.
                                cursor.close()
                except DatabaseError as exc:
                    if _table_locked(exc) and time.monotonic() < ends:
                        # A shared-cache SQLite database (Django's in-memory test database) locks tables
                        # without waiting in busy_timeout: wait here instead, within the call's bound. The
                        # step changed nothing (its transaction rolled back), so it runs again as it is.
                        time.sleep(min(TABLE_LOCKED_PAUSE * 2 ** table_locked, ends - time.monotonic(), 0.05))
                        table_locked += 1
                        continue
                    cut_meanwhile = reused and not (watch is not None and watch.fired) and not wrapper.is_usable()
                    if retried or not cut_meanwhile or time.monotonic() >= ends:
                        raise BackendUnavailable(self._unavailable_message(exc, bound, watch)) from exc
                    _close(wrapper)  # the next loop reconnects it
                    retried = True

    def _pool_busy(self, bound, waited):
        return BackendUnavailable(
            f"Database backend of alias '{self.alias}' (DATABASES['{self.database}'], {self.vendor}): all "
            f"{self._pool.size} of this process's lock connections stayed busy for {waited:.3g}s (STATEMENT_TIMEOUT "
            f"or the caller's timeout). Raise DISTLOCK['{self.alias}']['OPTIONS']['MAX_CONNECTIONS'] if this "
            "process makes more lock calls at once."
        )

    def _unavailable_message(self, exc, bound, watch):
        where = f"Database backend of alias '{self.alias}' (DATABASES['{self.database}'], {self.vendor})"
        if watch is not None and watch.fired:
            return f"{where} did not answer within {bound:.3g}s (STATEMENT_TIMEOUT or the caller's timeout)."
        if getattr(exc.__cause__, "sqlite_errorname", "") == "SQLITE_BUSY":
            return (f"{where}: the SQLite database stayed locked by another writer for {bound:.3g}s "
                    "(STATEMENT_TIMEOUT or the caller's timeout); keep write transactions short.")
        if isinstance(exc, ProgrammingError) or "no such table" in str(exc):
            return f"{where} is not set up: {exc}. Run `manage.py migrate distlock --database {self.database}`."
        return f"{where} is unavailable: {exc}"

    def _refuse_self_deadlock(self, name):
        """Raise ``LockWouldDeadlock`` if this thread has a transaction open on the same SQLite database.

        SQLite has one write slot. A transaction begun IMMEDIATE (or EXCLUSIVE) holds it from BEGIN; a
        DEFERRED one from its first write, which Python cannot observe; and one that has read works on a
        snapshot older than the lock. So any open transaction counts; the lock statement would otherwise
        wait for the caller's own transaction until the busy timeout.
        """
        if self.vendor != "sqlite":
            return
        if is_shared_memory_database(self.database):
            return  # the lock rows live in an in-memory database of their own (``_memory_database``)
        database_name = str(settings.DATABASES[self.database]["NAME"])
        for connection in connections.all(initialized_only=True):
            if (connection.vendor == "sqlite" and str(connection.settings_dict["NAME"]) == database_name
                    and connection.connection is not None and connection.connection.in_transaction):
                raise LockWouldDeadlock(
                    f"Lock {name!r} on alias '{self.alias}': this thread has a transaction open on the SQLite "
                    f"database of DATABASES['{connection.alias}'], and SQLite has one write slot, so the lock "
                    "statement would wait for that transaction, that is for itself. Take database locks outside "
                    "transaction.atomic() (lock first, then open the transaction inside the lock), or use a "
                    "PostgreSQL or Redis alias for locks taken inside transactions."
                )

    # -- the backend contract ----------------------------------------------------------------------

    def _try_acquire(self, attempt):
        self._refuse_self_deadlock(attempt.name)
        holder = current_holder()
        params = {"name": attempt.name, "owner": attempt.owner, "ttl": attempt.ttl, "host": holder.host[:255],
                  "pid": holder.pid, "task_id": holder.task_id[:255]}
        row = self._run(self._dialect.acquire, params, deadline=attempt.deadline)
        if row is None:
            return None
        token, acquired_at, _expires_at = row
        return Grant(token=token, acquired_at=self._dialect.aware(acquired_at))

    def _do_release(self, lease):
        return self.force_release(lease.name, lease.owner)

    def _do_extend(self, lease, ttl):
        self._refuse_self_deadlock(lease.name)
        return self._run(self._dialect.extend, {"name": lease.name, "owner": lease.owner, "ttl": ttl},
                         urgent=True) is not None

    def held_locks(self, prefix=""):
        rows = self._run(self._dialect.held, {"prefix": prefix, "prefix_length": len(prefix)})
        return [
            LockInfo(alias=self.alias, name=name, owner=owner, token=self.public_token(token),
                     acquired_at=self._dialect.aware(acquired),
                     expires_at=self._dialect.aware(expires), host=host, pid=pid, task_id=task_id)
            for name, owner, token, acquired, expires, host, pid, task_id in rows
        ]

    def force_release(self, name, owner):
        self._refuse_self_deadlock(name)
        row = self._run(self._dialect.release, {"name": name, "owner": owner}, urgent=True)
        return row is not None and bool(row[0])

    def ping(self):
        self._run(lambda cursor, params: cursor.execute("SELECT 1").fetchone(), {})
