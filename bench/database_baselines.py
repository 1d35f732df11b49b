"""The database backend against its protocol floor on the same database (SQLite, PostgreSQL), in one run.

- the protocol floor: distlock's own statements (``distlock.backends._sql``) on one DB-API connection
  (sqlite3 or psycopg, opened as Django opens the alias's connection, then used directly, in
  autocommit). PostgreSQL: acquire is the one ``INSERT … ON CONFLICT`` statement with its advisory
  name guard, its look at the waiter queue and ``nextval()`` token; release the owner-checked ``DELETE``
  (which would notify a waiter). SQLite: acquire is the ``BEGIN IMMEDIATE`` transaction looking at the
  queue, drawing the next token, upserting the row and deleting the call's place, then ``COMMIT``;
  release the owner-checked ``DELETE``. Same table (``distlock_lock``), same token sequence, same
  columns, so the database does the same work per operation. Nothing else: no pool, no request
  bound, no holder lookup per call, no signals, no metrics.
- distlock's backend, through the public API and alone.

The floor never waits (a held name raises): uncontended only.

    python -m tests.servers --servers postgres -- python -m bench.database_baselines [--rounds 10]
"""

import argparse
import hashlib
import os
import secrets
import socket
import statistics

from django.conf import settings
from django.db import connections
from django.db.utils import load_backend

from bench import run_standalone
from bench.harness import Contender, ContenderSpec, print_uncontended, uncontended
from distlock.backends._sql import (
    GUARD_NAMESPACE,
    NOTIFY_CHANNEL,
    PG_ACQUIRE,
    PG_RELEASE,
    SQLITE_ACQUIRE,
    SQLITE_BEGIN,
    SQLITE_GRANTED,
    SQLITE_NEXT_TOKEN,
    SQLITE_RELEASE,
    SQLITE_TURN,
    WAITER_TTL,
    engine_vendor,
)
from distlock.conf import sqlite_memory


def dbapi_connection(database):
    """Return a new DB-API connection to ``DATABASES[database]``, in autocommit, as Django opens it.

    Opened through a Django wrapper of its own (outside Django's per-thread connections and pool), so
    that it gets the alias's connection options (SQLite's ``init_command`` pragmas, psycopg's cursor
    class and type loaders), as distlock's connections do; only the DB-API object is used afterwards.
    """
    if sqlite_memory(database):
        raise ValueError(f"DATABASES['{database}'] is an in-memory SQLite database: the floor needs a file")
    databases = {alias: {**entry, "OPTIONS": dict(entry.get("OPTIONS", {})), "TEST": dict(entry.get("TEST", {}))}
                 for alias, entry in settings.DATABASES.items()}
    entry = connections.configure_settings(databases)[database]
    entry["OPTIONS"].pop("pool", None)
    entry["AUTOCOMMIT"] = True
    wrapper = load_backend(entry["ENGINE"]).DatabaseWrapper(entry, database)
    wrapper.ensure_connection()
    return wrapper.connection


def floor(database, ttl=30):
    """The protocol floor on ``DATABASES[database]``: distlock's acquire and release statements, nothing else."""
    vendor = engine_vendor(settings.DATABASES[database]["ENGINE"])
    if vendor not in ("postgresql", "sqlite"):
        raise ValueError(f"DATABASES['{database}'] is {vendor}; the database backend runs on PostgreSQL and SQLite")
    connection = dbapi_connection(database)
    cursor = connection.cursor()
    # The holder columns distlock fills on every acquisition, computed once: their values cost nothing to write.
    holder = {"host": socket.gethostname()[:255], "pid": os.getpid(), "task_id": "", "ttl": ttl, "queue": False,
              "waiter_ttl": WAITER_TTL, "channel": NOTIFY_CHANNEL}

    def acquire_postgresql(name, owner):
        # The name guard's key, as distlock's PostgreSQL dialect derives it (_sql._PostgreSQL.acquire).
        key = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "big", signed=True)
        cursor.execute(PG_ACQUIRE, {**holder, "name": name, "owner": owner, "guard_namespace": GUARD_NAMESPACE,
                                    "guard_key": key})
        return cursor.fetchone()

    def acquire_sqlite(name, owner):
        try:
            cursor.execute(SQLITE_BEGIN)
            cursor.execute(SQLITE_TURN, {"name": name, "owner": owner})
            row = None
            if cursor.fetchone()[0]:
                cursor.execute(SQLITE_NEXT_TOKEN)
                (token,) = cursor.fetchone()
                cursor.execute(SQLITE_ACQUIRE, {**holder, "name": name, "owner": owner, "token": token})
                row = cursor.fetchone()
                cursor.execute(SQLITE_GRANTED, {"name": name, "owner": owner})
            cursor.execute("COMMIT" if row is not None else "ROLLBACK")
        except BaseException:
            connection.rollback()
            raise
        return row

    run_acquire, release_statement = ((acquire_postgresql, PG_RELEASE) if vendor == "postgresql"
                                      else (acquire_sqlite, SQLITE_RELEASE))

    def acquire(name):
        name, owner = f"bench-floor:{name}", secrets.token_hex(16)
        if run_acquire(name, owner) is None:
            raise RuntimeError("the floor does not wait: use it uncontended only")
        return name, owner

    def release(handle):
        name, owner = handle
        cursor.execute(release_statement, {"name": name, "owner": owner, "channel": NOTIFY_CHANNEL})
        cursor.fetchone()

    return Contender(acquire, release)


def database_aliases():
    """Return the aliases of ``settings.DISTLOCK`` that use the database backend (``default`` is SQLite)."""
    return [alias for alias, entry in settings.DISTLOCK.items()
            if entry.get("BACKEND") == "distlock.backends.database.DatabaseBackend"]


def lock_database(alias):
    """Return the ``DATABASES`` alias of ``alias``'s lock rows: the one its floor writes to."""
    from distlock.handler import locks  # noqa: PLC0415 - after django.setup()

    return locks[alias].database


def run(*, seconds=0.25, rounds=20):
    """Print, for every database alias, distlock's uncontended figures next to the floor's, and their ratio."""
    aliases = database_aliases()
    if not aliases:
        print("\nDatabase baselines: no DISTLOCK alias uses DatabaseBackend; skipped.")
        return
    for alias in aliases:
        database = lock_database(alias)
        api = ContenderSpec(f"distlock '{alias}' (public API)", "bench.harness.alias_contender", {"alias": alias})
        backend = ContenderSpec(f"distlock '{alias}' (backend only)", "bench.harness.backend_contender",
                                {"alias": alias})
        bare = ContenderSpec("floor: its statements, DB-API", "bench.database_baselines.floor", {"database": database})
        vendor = engine_vendor(settings.DATABASES[database]["ENGINE"])
        print(f"\n== Database baselines: alias '{alias}' ({vendor}, DATABASES['{database}']) against its protocol "
              "floor ==")
        alone = uncontended([api, backend, bare], seconds=seconds, rounds=rounds)
        print_uncontended(alone, f"Uncontended acquire+release, 1 process ({rounds} interleaved rounds of "
                                 f"{seconds:g} s, median ops/s)")
        for spec in (api, backend):
            ratio = statistics.median(a / b for a, b in zip(alone[spec.label].rounds, alone[bare.label].rounds) if b)
            print(f"  {spec.label + ' vs the floor:':<52}{ratio:5.2f}x  (median over rounds side by side)")


def main(argv):
    parser = argparse.ArgumentParser(prog="python -m bench.database_baselines", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=0.25, help="length of an uncontended round (default 0.25)")
    parser.add_argument("--rounds", type=int, default=20, help="uncontended rounds (default 20)")
    run(**vars(parser.parse_args(argv)))


if __name__ == "__main__":
    run_standalone(main)
