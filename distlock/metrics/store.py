"""The shared store of lock metrics: the ``MetricSample`` table, added to by every process.

Invariant: every count recorded by any process is in exactly one row, once. Processes never read and
rewrite a row; they add to it in one statement, so concurrent flushes cannot lose each other's counts.
PostgreSQL and SQLite (3.24+) share the statements below; other databases are refused by name.
"""

from django.core.exceptions import ImproperlyConfigured
from django.db import connections, transaction

from distlock.models import MetricSample

__all__ = ["ADD", "BATCH", "FOLD", "KEY", "TABLE", "add", "fold"]

TABLE = MetricSample._meta.db_table
KEY = "period_start, alias, prefix, series, bucket"

#: Add a batch of counts, one ``(%s, %s, %s, %s, %s, %s)`` group per row of {rows}. A row whose key
#: exists gets the count added; the unique key makes two processes adding to the same minute sum.
ADD = f"""
INSERT INTO {TABLE} ({KEY}, count) VALUES {{rows}}
ON CONFLICT ({KEY}) DO UPDATE SET count = {TABLE}.count + excluded.count
"""

#: Fold the minutes before %s (Unix seconds) into period 0, the since-start totals, keeping the table
#: small. Each count must move exactly once even when two processes fold at the same time.
FOLD = {
    # One statement: a row that a concurrent fold already deleted is skipped by this DELETE, so its
    # count is never added twice.
    "postgresql": [f"""
        WITH moved AS (
            DELETE FROM {TABLE} WHERE period_start > 0 AND period_start < %s
            RETURNING alias, prefix, series, bucket, count
        )
        INSERT INTO {TABLE} ({KEY}, count)
        SELECT 0, alias, prefix, series, bucket, SUM(count) FROM moved GROUP BY alias, prefix, series, bucket
        ON CONFLICT ({KEY}) DO UPDATE SET count = {TABLE}.count + excluded.count
    """],
    # Two statements in one transaction: SQLite transactions are serializable, so a concurrent fold
    # waits or fails ("database is locked"), never adds twice. (The WHERE keeps SQLite from reading
    # ON CONFLICT as a join's ON.)
    "sqlite": [f"""
        INSERT INTO {TABLE} ({KEY}, count)
        SELECT 0, alias, prefix, series, bucket, SUM(count) FROM {TABLE}
        WHERE period_start > 0 AND period_start < %s GROUP BY alias, prefix, series, bucket
        ON CONFLICT ({KEY}) DO UPDATE SET count = {TABLE}.count + excluded.count
    """, f"DELETE FROM {TABLE} WHERE period_start > 0 AND period_start < %s"],
}

#: Rows per ADD statement: 6 parameters each stays under every supported database's limit.
BATCH = 500


def _connection(using):
    connection = connections[using]
    if connection.vendor not in FOLD:
        raise ImproperlyConfigured(
            f"The lock metrics store needs PostgreSQL or SQLite, but database {using!r} is {connection.vendor}; "
            "point settings.DISTLOCK_METRICS['DATABASE'] at one, or set 'ENABLED': False."
        )
    return connection


def add(counts, *, using):
    """Add ``{(period_start, alias, prefix, series, bucket): count}`` to the shared rows, atomically."""
    connection = _connection(using)
    items = [(*key, count) for key, count in counts.items() if count]
    with transaction.atomic(using=using), connection.cursor() as cursor:
        for start in range(0, len(items), BATCH):
            batch = items[start:start + BATCH]
            sql = ADD.format(rows=", ".join(["(%s, %s, %s, %s, %s, %s)"] * len(batch)))
            cursor.execute(sql, [value for row in batch for value in row])


def fold(*, before, using):
    """Move the counts of minutes starting before ``before`` (Unix seconds) into the since-start totals."""
    connection = _connection(using)
    with transaction.atomic(using=using), connection.cursor() as cursor:
        for statement in FOLD[connection.vendor]:
            cursor.execute(statement, [int(before)])
