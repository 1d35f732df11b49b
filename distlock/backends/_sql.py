"""The database backend's protocol: its statements on PostgreSQL and SQLite, and how each database runs them.

A lock is one row of ``distlock_lock`` (``distlock.models.Lock``), unique by name. A row whose
``expires_at`` has passed by the database's own clock is free: no statement uses the client's clock.
Every statement compares the random owner id, so nobody changes a lock it does not hold.

Waiters queue (``distlock.models.LockWaiter``, one row per blocking acquire that found the lock taken):
a free lock goes to the live waiter of its name with the lowest id, so a holder that releases and
comes straight back queues behind the others. A waiter's row lives ``WAITER_TTL`` seconds past its
last try; a dead waiter's row stops counting then. A caller that holds the lock already (its reply was
lost and the call retried) is never made to wait behind the queue. On PostgreSQL, a release (and a
waiter leaving the queue of a free lock) sends ``NOTIFY`` on ``NOTIFY_CHANNEL`` with the owner id of
the waiter first in line, inside its own statement, so only a committed release is announced, and
only to the waiter whose turn it is; waiters listen for it
(``distlock.backends._sql_listen``) and poll as before when a notification is lost. The queue orders
grants only: mutual exclusion and token order rest on the lock row alone, as before. On PostgreSQL the
acquire statement reads the queue from its snapshot, taken before the name guard was granted, so a
waiter that queued in that instant may be passed over once.
"""

import hashlib
import math
import os
import socket
import zoneinfo
from datetime import timezone as dt_timezone

from django.conf import settings
from django.db import DatabaseError
from django.db.utils import load_backend
from django.utils import timezone

from distlock.backends.deadlines import DeadlineTimer

__all__ = ["DIALECTS", "MIN_SQLITE_VERSION", "NOTIFY_CHANNEL", "UNWATCHED", "WAITER_TTL", "close_quietly",
           "engine_vendor", "table_locked"]

# -- PostgreSQL ---------------------------------------------------------------------------------------

# Acquire: one statement, so one transaction; RETURNING gives (token, acquired_at, expires_at) when
# acquired, no row when the lock is held or another waiter's turn comes first.
# - name_guard: a transaction-scoped advisory lock on (GUARD_NAMESPACE, hash of the name), released at
#   commit, so it cannot strand behind PgBouncer. It makes acquisitions of one name draw their tokens
#   one after the other: nextval() runs before the row is inserted, and without the guard another
#   process could draw a higher token, acquire and release the same name in between, and this insert
#   would then hold the lock with a lower token than its predecessor.
# - turn: true unless a live waiter of the name queued before this call (or this call has no place
#   yet); always true for a call whose own row holds the lock. Selected FROM name_guard, so the guard
#   is taken whatever the queue holds.
# - The token is nextval() of the alias-wide sequence (migration 0002): never reused, never rolled back.
# - ON CONFLICT takes the row over only if it has expired, or if it is this very call's own row (its
#   reply was lost with a broken connection and the call was retried).
# - left_queue: a grant deletes the call's place and the expired places of the name (a dead waiter's).
# - queued: a call that was not granted and may wait (``queue``) takes a place, or refreshes its own
#   once less than half of WAITER_TTL is left of it (so most polls write nothing).
PG_ACQUIRE = """
WITH name_guard AS MATERIALIZED (SELECT pg_advisory_xact_lock(%(guard_namespace)s, %(guard_key)s)),
turn AS MATERIALIZED (
    SELECT NOT EXISTS (
               SELECT 1 FROM distlock_lockwaiter AS ahead
               WHERE ahead.name = %(name)s AND ahead.expires_at > clock_timestamp()
                 AND ahead.id < coalesce((SELECT id FROM distlock_lockwaiter WHERE owner = %(owner)s),
                                         9223372036854775807))
           OR EXISTS (SELECT 1 FROM distlock_lock WHERE name = %(name)s AND owner = %(owner)s) AS ours
    FROM name_guard
),
granted AS (
    INSERT INTO distlock_lock AS held (name, owner, token, acquired_at, expires_at, host, pid, task_id)
    SELECT %(name)s, %(owner)s, nextval('distlock_token_seq'), clock_timestamp(),
           clock_timestamp() + make_interval(secs => %(ttl)s), %(host)s, %(pid)s, %(task_id)s
    FROM turn WHERE turn.ours
    ON CONFLICT (name) DO UPDATE
    SET owner = EXCLUDED.owner, token = EXCLUDED.token, acquired_at = EXCLUDED.acquired_at,
        expires_at = EXCLUDED.expires_at, host = EXCLUDED.host, pid = EXCLUDED.pid, task_id = EXCLUDED.task_id
    WHERE held.expires_at <= clock_timestamp() OR held.owner = EXCLUDED.owner
    RETURNING token, acquired_at, expires_at
),
left_queue AS (
    DELETE FROM distlock_lockwaiter
    WHERE name = %(name)s AND (owner = %(owner)s OR expires_at <= clock_timestamp()) AND EXISTS (SELECT 1 FROM granted)
),
queued AS (
    INSERT INTO distlock_lockwaiter AS place (name, owner, expires_at)
    SELECT %(name)s, %(owner)s, clock_timestamp() + make_interval(secs => %(waiter_ttl)s)
    WHERE %(queue)s AND NOT EXISTS (SELECT 1 FROM granted)
    ON CONFLICT (owner) DO UPDATE SET expires_at = EXCLUDED.expires_at
    WHERE place.expires_at < clock_timestamp() + make_interval(secs => %(waiter_ttl)s / 2)
)
SELECT token, acquired_at, expires_at FROM granted
"""

# Release (release_owned): compare-and-delete. Returns no row if the lock is not ours, else whether it
# was still unexpired; an expired row of ours is deleted too, to leave no litter, but reported False,
# since the lock had already lapsed. If a live waiter queues for the name, the first in line is told
# (NOTIFY with its owner, sent at commit, so never for a release that did not happen): only the waiter
# whose turn it is wakes. Without waiters nothing is sent, and the release does not take the
# commit-time lock NOTIFY needs.
PG_RELEASE = """
WITH released AS (
    DELETE FROM distlock_lock WHERE name = %(name)s AND owner = %(owner)s
    RETURNING expires_at > clock_timestamp() AS valid
)
SELECT valid, (SELECT pg_notify(%(channel)s, owner) FROM distlock_lockwaiter
               WHERE name = %(name)s AND expires_at > clock_timestamp() ORDER BY id LIMIT 1)
FROM released
"""

# Leave the queue (a waiter whose timeout ran out): delete the place; if the lock is free, tell the
# next waiter in line, whose turn it may be now.
PG_LEAVE = """
WITH left_queue AS (DELETE FROM distlock_lockwaiter WHERE owner = %(owner)s RETURNING name)
SELECT (SELECT pg_notify(%(channel)s, next.owner) FROM distlock_lockwaiter AS next
        WHERE next.name = left_queue.name AND next.owner <> %(owner)s AND next.expires_at > clock_timestamp()
        ORDER BY next.id LIMIT 1)
FROM left_queue
WHERE NOT EXISTS (SELECT 1 FROM distlock_lock WHERE name = left_queue.name AND expires_at > clock_timestamp())
"""

#: The channel of release notifications: one per database, as the lock table; the payload is the owner id
#: of the waiter whose turn it is.
NOTIFY_CHANNEL = "distlock_lock"

#: Seconds a waiter's place lives after its last try: longer than the longest pause between two
#: tries (the back-off's 200 ms, plus a slow statement), short enough that a waiter that died (a
#: SIGKILL, a lost machine) holds the lock up no longer than this.
WAITER_TTL = 2.0

# Extend: compare-and-extend; an expired lock stays lost even if nobody took it over.
PG_EXTEND = """
UPDATE distlock_lock SET expires_at = clock_timestamp() + make_interval(secs => %(ttl)s)
WHERE name = %(name)s AND owner = %(owner)s AND expires_at > clock_timestamp()
RETURNING expires_at
"""

# Extend many (the renewal scheduler's round): EXTEND for each (name, owner, ttl) of the arrays, in one
# statement. Returns the (name, owner) of each lock extended.
PG_EXTEND_MANY = """
UPDATE distlock_lock AS held SET expires_at = clock_timestamp() + make_interval(secs => due.ttl)
FROM unnest(%(names)s::text[], %(owners)s::text[], %(ttls)s::float8[]) AS due (name, owner, ttl)
WHERE held.name = due.name AND held.owner = due.owner AND held.expires_at > clock_timestamp()
RETURNING held.name, held.owner
"""

# Listing, one page: the held locks after the name ``after`` (a page's cursor, else ""), by name.
PG_HELD = """
SELECT name, owner, token, acquired_at, expires_at, host, pid, task_id FROM distlock_lock
WHERE expires_at > clock_timestamp() AND left(name, %(prefix_length)s) = %(prefix)s AND name > %(after)s
ORDER BY name LIMIT %(limit)s
"""

# Keeps distlock's guard keys apart from the application's own two-key advisory locks ("dlk\0").
GUARD_NAMESPACE = 0x646C6B00

# -- SQLite ----------------------------------------------------------------------------------------------

# Acquire: SQLite has one write slot per database. BEGIN IMMEDIATE takes it before anything is read,
# so each acquisition is serialized against every other writer of every process; tokens therefore
# strictly increase in the order locks are granted. Steps, in that one transaction:
SQLITE_BEGIN = "BEGIN IMMEDIATE"
# 1. Whether the lock is this call's to take: free (or this call's own row) and no live waiter of the
#    name queued before this call (a call without a place queues behind every live waiter); and how
#    many live waiters queued before it, for the pause before its next try.
SQLITE_TURN = """
WITH me AS (
    SELECT (SELECT count(*) FROM distlock_lockwaiter AS ahead
            WHERE ahead.name = :name AND ahead.expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now')
              AND ahead.id < coalesce((SELECT id FROM distlock_lockwaiter WHERE owner = :owner),
                                      9223372036854775807)) AS ahead,
           EXISTS (SELECT 1 FROM distlock_lock WHERE name = :name AND owner = :owner) AS holding,
           NOT EXISTS (SELECT 1 FROM distlock_lock
                       WHERE name = :name AND owner <> :owner
                         AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now')) AS free
)
SELECT (ahead = 0 OR holding) AND free, ahead FROM me
"""
# 2a. Its turn: the next alias-wide token: one more than the last, and never below the database clock
#     in microseconds, so a TokenSequence row deleted (a test-suite flush, a restore) does not send
#     tokens backwards.
SQLITE_NEXT_TOKEN = """
INSERT INTO distlock_tokensequence (id, value)
VALUES (1, CAST((julianday('now') - 2440587.5) * 86400000000 AS INTEGER))
ON CONFLICT (id) DO UPDATE SET value = max(value + 1, excluded.value)
RETURNING value
"""
# 2b. The upsert, taking an expired row over (or this call's own row, as on PostgreSQL). Times are
#     stored as 'YYYY-MM-DD HH:MM:SS.SSS' UTC text from SQLite's clock: one fixed format, so text
#     comparison is time comparison, and Django reads it as a DateTimeField.
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
# 2c. The grant deletes the call's place and the expired places of the name (a dead waiter's).
SQLITE_GRANTED = """
DELETE FROM distlock_lockwaiter
WHERE name = :name AND (owner = :owner OR expires_at <= strftime('%Y-%m-%d %H:%M:%f', 'now'))
"""
# 3. Not its turn: a call that may wait takes a place, or refreshes its own once less than half of
#    WAITER_TTL is left of it; one that may not wait writes nothing.
SQLITE_QUEUE = """
INSERT INTO distlock_lockwaiter (name, owner, expires_at)
VALUES (:name, :owner, strftime('%Y-%m-%d %H:%M:%f', 'now', '+' || :waiter_ttl || ' seconds'))
ON CONFLICT (owner) DO UPDATE SET expires_at = excluded.expires_at
WHERE distlock_lockwaiter.expires_at < strftime('%Y-%m-%d %H:%M:%f', 'now', '+' || (:waiter_ttl / 2.0) || ' seconds')
"""
# 4. COMMIT; ROLLBACK if nothing was written (a non-blocking try of a taken lock).

SQLITE_LEAVE = "DELETE FROM distlock_lockwaiter WHERE owner = :owner"

SQLITE_RELEASE = """
DELETE FROM distlock_lock WHERE name = :name AND owner = :owner
RETURNING expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now')
"""

SQLITE_EXTEND = """
UPDATE distlock_lock SET expires_at = strftime('%Y-%m-%d %H:%M:%f', 'now', '+' || :ttl || ' seconds')
WHERE name = :name AND owner = :owner AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now')
RETURNING expires_at
"""

# Extend many: EXTEND for each (name, owner, ttl) row of ``due``, whose VALUES the dialect writes for
# each chunk of at most SQLITE_EXTEND_CHUNK locks (SQLite has no arrays). Returns the (name, owner) of
# each lock extended.
SQLITE_EXTEND_MANY = """
WITH due (name, owner, ttl) AS (VALUES {rows})
UPDATE distlock_lock SET expires_at = strftime('%Y-%m-%d %H:%M:%f', 'now', '+' || due.ttl || ' seconds')
FROM due
WHERE distlock_lock.name = due.name AND distlock_lock.owner = due.owner
  AND distlock_lock.expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now')
RETURNING distlock_lock.name, distlock_lock.owner
"""
#: Locks per SQLITE_EXTEND_MANY statement: three parameters each, well below SQLite's limit of 32766.
SQLITE_EXTEND_CHUNK = 500

SQLITE_HELD = """
SELECT name, owner, token, acquired_at, expires_at, host, pid, task_id FROM distlock_lock
WHERE expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now') AND substr(name, 1, :prefix_length) = :prefix
  AND name > :after
ORDER BY name LIMIT :limit
"""

#: The first SQLite with RETURNING.
MIN_SQLITE_VERSION = (3, 35)

#: libpq rounds a connect_timeout below 2 seconds up to 2.
MIN_CONNECT_TIMEOUT = 2


def engine_vendor(engine):
    """Return the vendor of a Django database ENGINE (imports it, does no I/O)."""
    return load_backend(engine).DatabaseWrapper.vendor


def table_locked(exc):
    """True for SQLite's "database table is locked": another connection of a shared cache holds the table."""
    return getattr(exc.__cause__, "sqlite_errorname", "").startswith("SQLITE_LOCKED")


def close_quietly(wrapper):
    """Close ``wrapper`` (rolling back anything half done); its next use reconnects."""
    try:
        wrapper.close()
    except DatabaseError:
        pass  # the connection is already broken: closing it has nothing left to do


class _Unwatched:
    """The watch of a statement no timer cuts off (SQLite's, and a call's before its statement starts)."""

    severed = False

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, traceback):
        pass


UNWATCHED = _Unwatched()


class _Watch:
    """One statement on a PostgreSQL connection, severed by the dialect's timer if it outlives its deadline.

    A class, not a generator: a generator an interrupt left suspended runs its ``finally`` when
    collected, in any thread, possibly the timer's own while it holds the timer's lock (a deadlock).
    """

    severed = False

    def __init__(self, timer, wrapper, deadline):
        self._timer, self._wrapper, self._deadline = timer, wrapper, deadline

    def __enter__(self):
        self._timer.schedule(self._wrapper, self._deadline)
        return self

    def __exit__(self, exc_type, exc, traceback):
        # False once the timer fired: under its lock, so after this the timer cannot sever the connection.
        self.severed = not self._timer.cancel(self._wrapper)


class _Dialect:
    """One database's side of the protocol: its statements, run the same way by both databases."""

    #: How operators know the database, in messages.
    label = None
    #: Release, extend and listing statements: set by each database below.
    RELEASE = EXTEND = HELD = None

    def connect(self, wrapper, bound, configured_options):
        """Connect ``wrapper`` if it is not, within ``bound`` seconds; bound its statements by ``bound`` too."""
        raise NotImplementedError

    def watch(self, wrapper, deadline):
        """Return a context manager around one statement on ``wrapper`` that must end by ``deadline``."""
        return UNWATCHED

    def disconnect(self, wrapper):
        """Close ``wrapper``: the only way the backend closes a connection of its own."""
        close_quietly(wrapper)

    def acquire(self, cursor, params):
        """Return ``(row, ahead)``: row (token, acquired_at, expires_at) if granted, else None, the call queued
        if ``params["queue"]``; ``ahead`` the live waiters queued before the call, or None if not counted."""
        raise NotImplementedError

    def release(self, cursor, params):
        cursor.execute(self.RELEASE, params)
        return cursor.fetchone()

    def leave(self, cursor, params):
        """Delete the place in the queue of the call whose owner is ``params["owner"]``."""
        raise NotImplementedError

    def extend(self, cursor, params):
        cursor.execute(self.EXTEND, params)
        return cursor.fetchone()

    def extend_many(self, cursor, requests):
        """Extend each ``(name, owner, ttl)`` of ``requests``; return the set of ``(name, owner)`` extended."""
        raise NotImplementedError

    def held(self, cursor, params):
        cursor.execute(self.HELD, params)
        return cursor.fetchall()

    @staticmethod
    def aware(value):
        """Return the database's datetime ``value`` as an aware one."""
        raise NotImplementedError

    def close(self):
        pass


class _PostgreSQL(_Dialect):
    """The PostgreSQL side of the protocol: statements, connect timeout, and a timer that cuts statements off.

    psycopg has no client-side statement timeout, and TCP keeps the connection to a paused or
    black-holed server open indefinitely: shutting its socket down makes the blocked call fail at
    once. The timer's keys are the connection wrappers themselves; its callback runs under the timer's
    lock, so once a statement's watch is cancelled, the timer cannot touch that connection any more.
    An interrupt may skip that cancel, but the call then closes the connection through ``disconnect``,
    which cancels first; and until then the timer's reference keeps the wrapper (its socket) alive. So
    the timer never shuts down a socket of another call, even one that reuses the file descriptor.
    """

    label = "PostgreSQL"
    EXTEND, HELD = PG_EXTEND, PG_HELD

    def __init__(self):
        self.timer = DeadlineTimer(_sever, name="distlock-db-watchdog", under_lock=True)

    def connect(self, wrapper, bound, configured_options):
        if wrapper.connection is None:
            # The caller's bound, unless the project configured a shorter connect_timeout.
            configured = configured_options.get("connect_timeout") or math.inf
            wrapper.settings_dict["OPTIONS"]["connect_timeout"] = max(MIN_CONNECT_TIMEOUT,
                                                                      math.ceil(min(bound, configured)))
            wrapper.ensure_connection()

    def watch(self, wrapper, deadline):
        return _Watch(self.timer, wrapper, deadline)

    def disconnect(self, wrapper):
        self.timer.cancel(wrapper)  # before the socket is closed and its descriptor reused
        close_quietly(wrapper)

    def extend_many(self, cursor, requests):
        names, owners, ttls = (list(column) for column in zip(*requests, strict=True))
        cursor.execute(PG_EXTEND_MANY, {"names": names, "owners": owners, "ttls": ttls})
        return set(cursor.fetchall())

    def acquire(self, cursor, params):
        key = int.from_bytes(hashlib.blake2b(params["name"].encode(), digest_size=4).digest(), "big", signed=True)
        cursor.execute(PG_ACQUIRE, {**params, "guard_namespace": GUARD_NAMESPACE, "guard_key": key,
                                    "waiter_ttl": WAITER_TTL})
        return cursor.fetchone(), None  # waiters are woken by NOTIFY

    def release(self, cursor, params):
        cursor.execute(PG_RELEASE, {**params, "channel": NOTIFY_CHANNEL})
        return cursor.fetchone()

    def leave(self, cursor, params):
        cursor.execute(PG_LEAVE, {**params, "channel": NOTIFY_CHANNEL})
        cursor.fetchall()

    @staticmethod
    def aware(value):
        # With USE_TZ, Django's psycopg loaders give aware datetimes; without it, naive ones in the
        # connection's time zone, which Django sets to TIME_ZONE.
        if timezone.is_aware(value):
            return value
        return timezone.make_aware(value, zoneinfo.ZoneInfo(settings.TIME_ZONE)).astimezone(dt_timezone.utc)

    def close(self):
        self.timer.stop()


def _sever(wrapper):
    """Shut the socket of ``wrapper``'s connection down for both directions (the timer's callback).

    Its call still owns the connection and closes it; only the blocked statement fails, at once.
    """
    connection = wrapper.connection
    if connection is None or connection.closed:
        return
    try:
        with socket.socket(fileno=os.dup(connection.fileno())) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except (OSError, wrapper.Database.Error):
        pass  # libpq already dropped the socket: nothing left to interrupt


class _SQLite(_Dialect):
    """The SQLite side of the protocol: statements, and the busy timeout as the bound."""

    label = "SQLite"
    RELEASE, EXTEND, HELD = SQLITE_RELEASE, SQLITE_EXTEND, SQLITE_HELD

    def connect(self, wrapper, bound, configured_options):
        wrapper.ensure_connection()
        # The busy timeout is how long a statement waits for the write slot: SQLite's only way to hang.
        # Set unless this very connection has it already: calls without a timeout of their own ask for the
        # same one, call after call. Forgotten before the PRAGMA, so an interrupt leaves nothing remembered.
        connection, busy_timeout = wrapper.connection, int(bound * 1000)
        if getattr(wrapper, "distlock_busy_timeout", None) != (connection, busy_timeout):
            wrapper.distlock_busy_timeout = None
            connection.execute(f"PRAGMA busy_timeout = {busy_timeout}")
            wrapper.distlock_busy_timeout = (connection, busy_timeout)

    def disconnect(self, wrapper):
        wrapper.distlock_busy_timeout = None  # keeps no closed connection alive
        close_quietly(wrapper)

    def extend_many(self, cursor, requests):
        extended = set()
        for start in range(0, len(requests), SQLITE_EXTEND_CHUNK):
            chunk = requests[start:start + SQLITE_EXTEND_CHUNK]
            cursor.execute(SQLITE_EXTEND_MANY.format(rows=", ".join(["(?, ?, ?)"] * len(chunk))),
                           [value for request in chunk for value in request])
            extended.update(cursor.fetchall())
        return extended

    def acquire(self, cursor, params):
        params = {**params, "waiter_ttl": WAITER_TTL}
        try:
            cursor.execute(SQLITE_BEGIN)  # inside: an interrupt just after it must roll back too
            cursor.execute(SQLITE_TURN, params)
            turn, ahead = cursor.fetchone()
            row = None
            if turn:
                cursor.execute(SQLITE_NEXT_TOKEN)
                (token,) = cursor.fetchone()
                cursor.execute(SQLITE_ACQUIRE, {**params, "token": token})
                row = cursor.fetchone()
            if row is not None:
                cursor.execute(SQLITE_GRANTED, params)
            elif params["queue"]:
                cursor.execute(SQLITE_QUEUE, params)
            cursor.execute("COMMIT" if row is not None or params["queue"] else "ROLLBACK")
        except BaseException:
            cursor.connection.rollback()
            raise
        return row, ahead

    def leave(self, cursor, params):
        cursor.execute(SQLITE_LEAVE, params)

    @staticmethod
    def aware(value):
        return value.replace(tzinfo=dt_timezone.utc)  # SQLite's clock is UTC; Django parses the text naive


#: The dialect of each supported database vendor.
DIALECTS = {"postgresql": _PostgreSQL, "sqlite": _SQLite}
