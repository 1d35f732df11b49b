"""The rejection log: every fenced write or claim refused for a stale token is counted, logged and signalled.

The log is the ``FencingRejection`` table, written so that its rows outlive the caller's
transaction (``log_rejections`` says how, per database).
"""

import logging
import threading
import time

from django.db import DatabaseError, OperationalError, connections, router

from distlock import metrics
from distlock.holder import current_holder
from distlock.models import FencingRejection
from distlock.signals import fencing_token_rejected

__all__ = ["SQLITE_LOG_PATIENCE", "log_rejections", "record_rejections"]

logger = logging.getLogger(__name__)

#: Seconds a deferred SQLite log write keeps retrying while the caller's transaction holds the database.
SQLITE_LOG_PATIENCE = 600

def record_rejections(model, offer, using, stale_rows):
    """Count, log and signal each refused row; ``stale_rows`` is ``[(pk, current_token), ...]``.

    The counter and the log are keyed by the lease's lock alias (and the counter by its lock name); a
    bare int token names no lock, so its rejections are keyed by the database alias ``using`` instead.
    """
    alias = offer.alias or using
    holder = current_holder()
    entries = []
    for pk, current in stale_rows:
        metrics.record_rejection(alias, offer.lock_name or "")
        logger.warning(
            "Refused a stale write to %s pk=%r: token %s < stored %s (lock %r, alias %r).",
            model._meta.label, pk, offer.token, current, offer.lock_name, alias,
        )
        entries.append(FencingRejection(
            model_label=model._meta.label, object_pk=str(pk), offered_token=offer.token, current_token=current,
            lock_name=offer.lock_name or "", alias=alias, host=holder.host, pid=holder.pid,
        ))
    # Where the routers keep distlock's own tables, not necessarily the fenced model's database.
    log_rejections(entries, router.db_for_write(FencingRejection))
    for pk, current in stale_rows:
        responses = fencing_token_rejected.send_robust(
            sender=model, model=model, pk=pk, offered_token=offer.token, current_token=current,
            lock_name=offer.lock_name,
        )
        for receiver, response in responses:
            if isinstance(response, Exception):
                logger.error("fencing_token_rejected receiver %r failed", receiver, exc_info=response)


def log_rejections(entries, using):
    """Write ``entries`` to database ``using`` so that they outlive the caller's transaction.

    Outside a transaction they go in at once on the caller's connection. Inside one they go in on a
    connection of their own, from a helper thread:

    - PostgreSQL (any database with concurrent writers): the insert commits at once; we wait for it.
    - SQLite has a single writer, and the caller's transaction holds it (it just ran the refused
      UPDATE). The helper's insert waits in SQLite's busy handler, retrying for
      ``SQLITE_LOG_PATIENCE`` seconds, until that transaction commits or rolls back; the caller does
      not wait. The thread is not a daemon, so the process finishes the write before exiting.
    """
    connection = connections[using]
    if not connection.in_atomic_block and connection.get_autocommit():
        _insert(entries, using)
        return
    sqlite = connection.vendor == "sqlite"
    writer = threading.Thread(
        target=_insert_on_own_connection, args=(entries, using, SQLITE_LOG_PATIENCE if sqlite else 0),
        name="distlock-rejection-log",
    )
    writer.start()
    if not sqlite:
        writer.join()


def _insert(entries, using):
    """Insert the rows; a failure is logged, never raised, so it cannot hide the rejection itself."""
    try:
        FencingRejection._base_manager.using(using).bulk_create(entries)
    except DatabaseError:
        logger.exception("Could not log %d fencing rejection(s) to database %r.", len(entries), using)


def _insert_on_own_connection(entries, using, patience):
    deadline = time.monotonic() + patience
    try:
        while True:
            try:
                FencingRejection._base_manager.using(using).bulk_create(entries)
                return
            except OperationalError as exc:
                # SQLite: "database is locked" once the busy timeout ran out (or "database table is
                # locked" on a shared-cache database): the caller's transaction is still open. Anything
                # else, or patience exhausted, is logged below.
                if "locked" not in str(exc) or time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)
    except DatabaseError:
        logger.exception("Could not log %d fencing rejection(s) to database %r.", len(entries), using)
    finally:
        connections[using].close()
