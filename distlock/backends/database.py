"""Locks as rows of the ``distlock_lock`` table, judged by the database server's clock (PostgreSQL, SQLite).

Every statement runs in autocommit on a connection of the backend's own (checked out of a small
pool for the one call: ``distlock.backends._sql_pool``), never on Django's connection: a lock written
inside the caller's uncommitted ``transaction.atomic()`` would be invisible to every other process and
exclude nobody. The locks are lease rows, not advisory locks: session advisory locks belong to a
server session, which a transaction-pooling proxy such as PgBouncer hands to other clients between
transactions, so they strand or vanish. The statements, each with why it is safe under concurrency,
are in ``distlock.backends._sql``.

Waiters queue in ``distlock_lockwaiter`` and a free lock goes to the one that queued first (see
``distlock.backends._sql``). On PostgreSQL a release tells the waiter first in line with ``NOTIFY``;
listening for it (one ``LISTEN`` connection per alias and process, ``distlock.backends._sql_listen``,
opened at the first wait, beside the pool's ``MAX_CONNECTIONS``), that waiter tries again at once. The
back-off stays as the fallback, so a lost notification costs one pause, never a hang.
"""

import logging
import random
import sqlite3
import threading
import time
import uuid
from functools import partial

from django.apps import apps
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, ProgrammingError, connections, router
from django.db.backends.base.base import NO_DB_ALIAS
from django.db.backends.signals import connection_created
from django.db.utils import load_backend

from distlock.backends._sql import (
    DIALECTS,
    MIN_SQLITE_VERSION,
    NOTIFY_CHANNEL,
    UNWATCHED,
    WAITER_TTL,
    close_quietly,
    engine_vendor,
    table_locked,
)
from distlock.backends._sql_listen import ReleaseListener
from distlock.backends._sql_pool import ConnectionPool
from distlock.backends.base import SAFE_FENCING_TOKENS, BaseLockBackend, Grant, check_page, cut_page
from distlock.backends.deadlines import request_seconds
from distlock.backends.green import green_library
from distlock.backends.offload import Abandoned
from distlock.backends.options import Option, positive_count, positive_number
from distlock.conf import PRIVATE_MEMORY, SHARED_MEMORY, sqlite_memory
from distlock.exceptions import BackendUnavailable, LockNotAcquired, LockWouldDeadlock
from distlock.holder import current_holder

logger = logging.getLogger(__name__)

__all__ = ["DatabaseBackend", "lock_database"]

#: The LIMIT of a listing without ``limit``: every row.
_ALL_ROWS = 2**62

#: The shortest bound of one request, even at or past the caller's deadline: a last try made right at
#: the deadline (or a non-blocking one) must still be able to wait out another writer's commit.
MIN_REQUEST_SECONDS = 1.0

#: Seconds of the first pause after a shared-cache table lock (``table_locked``); it doubles up to 50 ms.
TABLE_LOCKED_PAUSE = 0.001

#: On SQLite, which cannot notify waiters: seconds (times a random 0.5-1.0) between the tries of the waiter
#: first in line, and as much more per waiter ahead (up to the back-off's 200 ms). A hand-off waits on the
#: next waiter's pause, and the one behind it is polling nearly as often when its turn comes. A try that
#: takes nothing writes nothing (its place is refreshed once half its life is gone).
NEXT_IN_LINE_PAUSE = 0.01

#: ...but a try still takes SQLite's one write slot for a moment, which the application's own writers
#: need: a waiter's pause is at least this share of the time it has queued, so a long hold is polled a few
#: times a second (the back-off's 200 ms after 4 s), not a hundred, and its hand-off waits at most that
#: share of the wait longer.
QUEUED_PAUSE_SHARE = 0.05

#: What bounds a request, for messages.
BOUNDED_BY = "REQUEST_TIMEOUT or the caller's timeout"


class WriteSlotBusy(BackendUnavailable):
    """SQLite's write slot stayed taken by another writer for a whole request, which therefore changed nothing.

    Raised as it is by release, extend and the listing. An acquire's try that has time left counts it
    as "not granted yet" (``DatabaseBackend._try_acquire``) and the loop tries again.
    """


def lock_database(options):
    """The database of an alias's lock rows: its ``DATABASE`` option, else where the routers write ``Lock``.

    Without routers that is ``default``; a router that keeps the distlock app on a database of its own
    keeps the lock rows there too, next to the rejection log and the metrics.
    """
    if options["DATABASE"] is not None:
        return options["DATABASE"]
    return router.db_for_write(apps.get_model("distlock", "Lock"))


class DatabaseBackend(BaseLockBackend):
    """Locks in the ``distlock_lock`` table of one Django database, PostgreSQL or SQLite.

    Acquire is one atomic statement (PostgreSQL) or one ``BEGIN IMMEDIATE`` transaction (SQLite) that
    also takes expired locks over and draws the next alias-wide fencing token. Waiters queue, and a
    free lock goes to the one that queued first; they look again after a short jittered back-off or,
    on PostgreSQL, as soon as a release notification arrives. A request that cannot finish within
    ``REQUEST_TIMEOUT`` (or the caller's timeout) raises ``BackendUnavailable``. On SQLite, another writer
    keeping the database's write slot for a whole request made that request change nothing: a blocking acquire
    with time left counts the try as "not granted yet" and tries again, like for a held lock; once its timeout
    has run out, and for a non-blocking acquire, release, extend and the listing, it raises
    ``BackendUnavailable`` ("stayed locked by another writer", ``WriteSlotBusy``). On SQLite, locking inside
    this thread's open transaction on the same database raises ``LockWouldDeadlock``.
    """

    capabilities = frozenset({SAFE_FENCING_TOKENS})

    client_errors = (DatabaseError,)

    renamed_options = {"STATEMENT_TIMEOUT": "REQUEST_TIMEOUT"}

    options = {
        "DATABASE": Option((str, type(None)), None,
                           expected="the alias of a database in settings.DATABASES, or None (the database routers)"),
        "REQUEST_TIMEOUT": Option((int, float), 5, check=positive_number, expected="a number of seconds"),
        "MAX_CONNECTIONS": Option(int, 10, check=positive_count, expected="a whole number of connections"),
    }

    def __init__(self, alias, options):
        super().__init__(alias, options)
        self.database = lock_database(self.settings)
        self.vendor = engine_vendor(settings.DATABASES[self.database]["ENGINE"])
        self._dialect = DIALECTS[self.vendor]()
        # On Django's in-memory test database the lock rows get an in-memory database of their own
        # (``_memory_database``), whose shared cache lets one connection write at a time: calls take
        # turns on one connection, in the pool's order (release and extend first), instead of racing
        # for table locks, which a renewal could lose past its ttl.
        size = 1 if sqlite_memory(self.database) == SHARED_MEMORY else self.settings["MAX_CONNECTIONS"]
        self._pool = ConnectionPool(self._new_connection, self._dialect.disconnect, size)
        #: SQLite's calls are C calls that never yield to a gevent or eventlet hub: each call yields first, so
        #: a loop of lock calls still lets timers (a time limit), renewals and other green threads run.
        self._yields = self.vendor == "sqlite" and green_library() is not None
        #: (name, keeper connection) of the lock rows' own in-memory database, if any (``_memory_database``).
        self._memory = None
        self._memory_lock = threading.Lock()
        #: Release notifications (PostgreSQL): the process's one listening connection for this alias.
        self._listener = (ReleaseListener(self._listening_connection, self._dialect.disconnect, alias)
                          if self.vendor == "postgresql" else None)
        connection_created.connect(self._close_before_database_maintenance, weak=True)

    @property
    def label(self):
        """How operators know the database, in messages: "PostgreSQL" or "SQLite"."""
        return self._dialect.label

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
        try:
            vendor = engine_vendor(settings.DATABASES[database].get("ENGINE", ""))
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
        if sqlite_memory(database) == PRIVATE_MEMORY:
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
        if sqlite_memory(self.database) == SHARED_MEMORY:
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
                    editor.create_model(apps.get_model("distlock", "LockWaiter"))
                    editor.create_model(apps.get_model("distlock", "TokenSequence"))
                self._memory = (name, keeper)
            return self._memory[0]

    def _listening_connection(self):
        """Return a new wrapper listening on ``NOTIFY_CHANNEL``: connected, ``LISTEN`` done, within ``REQUEST_TIMEOUT``.

        The release listener's (``distlock.backends._sql_listen``): a paused server cuts it off like any statement.
        """
        wrapper = self._new_connection()
        try:
            ends = time.monotonic() + self.settings["REQUEST_TIMEOUT"]
            with wrapper.wrap_database_errors:
                self._dialect.connect(wrapper, ends - time.monotonic(),
                                      settings.DATABASES[self.database].get("OPTIONS", {}))
                with self._dialect.watch(wrapper, ends):
                    wrapper.connection.execute(f"LISTEN {NOTIFY_CHANNEL}")
        except BaseException:
            self._dialect.disconnect(wrapper)
            raise
        return wrapper

    def close(self):
        if self._listener is not None:
            self._listener.stop()
        self._pool.close()
        self._dialect.close()
        with self._memory_lock:
            memory, self._memory = self._memory, None
        if memory is not None:
            close_quietly(memory[1])

    def _close_before_database_maintenance(self, *, connection, **kwargs):
        """Close the idle connections when Django connects to no database in particular (``NO_DB_ALIAS``).

        Django does so to create or drop a test database: idle connections of ours to it made the
        DROP fail ("is being accessed by other users"), and ``manage.py test`` exit 1. The release
        listener stops too. The next lock call reconnects (the next wait listens again).
        """
        if connection.alias == NO_DB_ALIAS and connection.vendor == self.vendor:
            if self._listener is not None:
                self._listener.stop()
            self._pool.close()

    # -- running the protocol ----------------------------------------------------------------------

    def _run(self, step, params, *, operation, deadline=None, urgent=False):
        """Return ``step(cursor, params)`` run on a connection of the pool, within one request's bound.

        ``operation`` names the call in messages ("acquire lock 'x'"); ``deadline`` is the caller's
        (``time.monotonic()``, or None). Every database error drops the connection (so no half-done
        transaction survives) and becomes ``BackendUnavailable``. A reused connection found broken (a
        server restart, an idle connection cut) is replaced and the call retried once: every step is
        safe to repeat for its owner. ``urgent`` calls (release, extend) go ahead of the others
        waiting for a connection.
        """
        if self._yields:
            time.sleep(0)  # patched: a switch to the hub
        bound = request_seconds(self.settings["REQUEST_TIMEOUT"], deadline, minimum=MIN_REQUEST_SECONDS)
        with self.translate_errors(operation):
            return self._run_within(step, params, operation, bound, urgent)

    def _run_within(self, step, params, operation, bound, urgent):
        """Do ``_run``'s work within ``bound`` seconds from now; database errors left to ``translate_errors``."""
        ends = time.monotonic() + bound
        configured_options = settings.DATABASES[self.database].get("OPTIONS", {})
        busy = partial(self._pool_busy, operation)
        retried, pauses = False, 0
        while True:
            with self._pool.connection(ends, busy, urgent=urgent) as wrapper:
                reused = wrapper.connection is not None
                watch = UNWATCHED
                try:
                    with wrapper.wrap_database_errors:
                        self._dialect.connect(wrapper, ends - time.monotonic(), configured_options)
                        with self._dialect.watch(wrapper, ends) as watch:
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
                    if table_locked(exc) and time.monotonic() < ends:
                        # A shared-cache SQLite database (Django's in-memory test database) locks tables
                        # without waiting in busy_timeout: wait here instead, within the call's bound. The
                        # step changed nothing (its transaction rolled back), so it runs again as it is.
                        time.sleep(min(TABLE_LOCKED_PAUSE * 2 ** pauses, ends - time.monotonic(), 0.05))
                        pauses += 1
                        continue
                    if watch.severed:
                        raise self.unavailable(
                            operation, f"the database did not answer within {bound:.3g}s ({BOUNDED_BY})") from exc
                    if getattr(exc.__cause__, "sqlite_errorname", "") == "SQLITE_BUSY":
                        # Every step's transaction rolled back (and the pool closes this connection):
                        # the request changed nothing, so an acquire may try again (``_try_acquire``).
                        raise WriteSlotBusy(*self.unavailable(
                            operation, f"the SQLite database stayed locked by another writer for {bound:.3g}s "
                                       f"({BOUNDED_BY}); keep write transactions short").args) from exc
                    if retried or not reused or wrapper.is_usable() or time.monotonic() >= ends:
                        raise
                    logger.info("Alias %r: a connection to DATABASES[%r] was found broken (%s); reconnecting once.",
                                self.alias, self.database, self._cause(exc))
                    self._dialect.disconnect(wrapper)  # the next loop reconnects it
                    retried = True

    def _pool_busy(self, operation, waited):
        return self.unavailable(
            operation, f"all {self._pool.size} of this process's lock connections stayed busy for {waited:.3g}s "
                       f"({BOUNDED_BY}); raise DISTLOCK['{self.alias}']['OPTIONS']['MAX_CONNECTIONS'] if this process "
                       "makes more lock calls at once")

    def _cause(self, exc):
        """Return the database's error, with the fix when the tables are missing.

        Its first line only: the lines after it are context (the statement, libpq's hints).
        """
        cause = str(exc).strip().split("\n", 1)[0].strip().rstrip(".") or type(exc).__name__
        if isinstance(exc, ProgrammingError) or "no such table" in cause:
            return f"{cause}; run `manage.py migrate distlock --database {self.database}`"
        return cause

    def _refuse_self_deadlock(self, name):
        """Raise ``LockWouldDeadlock`` if this thread has a transaction open on the same SQLite database.

        SQLite has one write slot. A transaction begun IMMEDIATE (or EXCLUSIVE) holds it from BEGIN; a
        DEFERRED one from its first write, which Python cannot observe; and one that has read works on a
        snapshot older than the lock. So any open transaction counts; the lock statement would otherwise
        wait for the caller's own transaction until the busy timeout.
        """
        if self.vendor != "sqlite":
            return
        if sqlite_memory(self.database) == SHARED_MEMORY:
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
                  "pid": holder.pid, "task_id": holder.task_id[:255], "queue": attempt.blocking}
        if self._listener is not None and attempt.blocking and attempt.tries:
            # Noted before the try: a release that lands between the try and the wait wakes the wait.
            attempt.notified_since = self._listener.since()
        try:
            row, ahead = self._run(self._dialect.acquire, params, operation=f"acquire lock {attempt.name!r}",
                                   deadline=attempt.deadline)
        except WriteSlotBusy as exc:
            # Another writer kept SQLite's write slot for this whole try, whose transaction rolled back:
            # the lock was not even looked at. A blocking call with time left waits as for a held lock;
            # one out of time (or non-blocking) says why it could not look.
            if attempt.out_of_time():
                raise
            logger.info("%s; trying again within the caller's timeout.", str(exc).rstrip("."))
            return None
        if row is None:
            if ahead is not None:
                now = time.monotonic()
                if attempt.place is None:
                    attempt.place = now  # when this call first queued
                attempt.retry_after = max((ahead + 1) * NEXT_IN_LINE_PAUSE,
                                          (now - attempt.place) * QUEUED_PAUSE_SHARE)
            return None
        token, acquired_at, _expires_at = row
        return Grant(token=token, acquired_at=self._dialect.aware(acquired_at))

    def _wait_for_release(self, attempt, remaining):
        """Back off (``_back_off``), or less on SQLite near the head of the line (``NEXT_IN_LINE_PAUSE``); on
        PostgreSQL, stop as soon as a release of the lock is announced.

        The listener starts at an attempt's first wait; a release between that attempt's first try
        and the start is not heard, and costs this one pause.
        """
        pause = self._back_off(attempt, remaining)
        if attempt.retry_after is not None:
            pause = min(pause, attempt.retry_after * random.uniform(0.5, 1.0))
        if self._listener is None:
            time.sleep(pause)
            return
        since = attempt.notified_since if attempt.notified_since is not None else self._listener.since()
        if self._listener.wait(attempt.owner, since, pause) == "release":
            logger.debug("Lock %r (alias %r): a release notification woke the waiter.", attempt.name, self.alias)

    def _give_up(self, attempt, reason):
        """A waiter whose timeout ran out leaves the queue at once (else its place expires within ``WAITER_TTL``).

        Only on a timeout, or for a caller that already left (``Abandoned``: a cancelled coroutine, whose
        place would otherwise hold up a free lock for ``WAITER_TTL``): after any other exception (the
        database failed, the caller was interrupted on its own thread) one more request would stretch
        the caller's wait.
        """
        if not (isinstance(reason, (LockNotAcquired, Abandoned)) and attempt.blocking and attempt.tries):
            return
        try:
            self._run(self._dialect.leave, {"owner": attempt.owner},
                      operation=f"leave the queue of lock {attempt.name!r}")
        except BackendUnavailable as exc:
            # The caller's answer is still "not acquired"; the place expires on its own.
            logger.warning("%s Its place in the queue expires within %gs.", exc, WAITER_TTL)

    def _do_extend(self, lease, ttl):
        self._refuse_self_deadlock(lease.name)
        row = self._run(self._dialect.extend, {"name": lease.name, "owner": lease.owner, "ttl": ttl},
                        operation=f"extend lock {lease.name!r}", urgent=True)
        return row is not None

    def extend_many(self, requests):
        """Extend every ``(lease, ttl)`` with one UPDATE (on SQLite, one per ``SQLITE_EXTEND_CHUNK`` locks)."""
        self._refuse_self_deadlock(requests[0][0].name)
        extended = self._run(self._dialect.extend_many, [(lease.name, lease.owner, ttl) for lease, ttl in requests],
                             operation=f"extend {len(requests)} lock(s)", urgent=True)
        return [(lease.name, lease.owner) in extended for lease, _ in requests]

    def held_locks(self, prefix="", *, limit=None, cursor=None):
        """One page by name (keyset: the cursor is the page's last name); one row more tells if another follows."""
        check_page(limit, cursor)
        rows = self._run(self._dialect.held, {"prefix": prefix, "prefix_length": len(prefix), "after": cursor or "",
                                              "limit": _ALL_ROWS if limit is None else limit + 1},
                         operation="list held locks")
        aware = self._dialect.aware
        return cut_page([
            self.lock_info(name, {"owner": owner, "host": host, "pid": pid, "task_id": task_id}, token=token,
                           acquired_at=aware(acquired), expires_at=aware(expires))
            for name, owner, token, acquired, expires, host, pid, task_id in rows
        ], limit)

    def release_owned(self, name, owner):
        self._refuse_self_deadlock(name)
        row = self._run(self._dialect.release, {"name": name, "owner": owner}, operation=f"release lock {name!r}",
                        urgent=True)
        return row is not None and bool(row[0])

    def ping(self):
        self._run(lambda cursor, params: cursor.execute("SELECT 1").fetchone(), {}, operation="answer a ping")
