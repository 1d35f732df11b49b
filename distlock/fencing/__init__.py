"""Fenced writes: the conditional statements that refuse stale tokens, and the record of every refusal.

Invariant kept by every statement: a row's ``fencing_token`` never goes down, and a write carrying
token ``t`` changes a row only while its stored token is ``<= t``. The decision is taken by the
database inside one statement, so two holders racing cannot both pass a check made earlier.

Save (``FencedModel._do_update``; Django builds it from the model's fields)::

    UPDATE <table> SET <fields>, fencing_token = t WHERE pk = %s AND fencing_token <= t
    -- 1 row: written. 0 rows: a read tells "no such row" (Django inserts it) from "stale" (refused).

Bulk (``FencedQuerySet.fenced_update``), in one transaction::

    UPDATE <table> SET <fields>, fencing_token = t WHERE <filter> AND fencing_token <= t
    SELECT pk, fencing_token FROM <table> WHERE <filter> AND fencing_token > t   -- each one a rejection

Claim (``FencedQuerySet.claim``): ``CLAIM_BY_PK_SQL`` or, for any other lookup, ``CLAIM_SQL`` where
``UPDATE … RETURNING`` exists (PostgreSQL, SQLite >= 3.35); elsewhere ``SELECT … FOR UPDATE`` then
the same conditional UPDATE, in a transaction. ``claim()`` refuses to run inside the caller's open
transaction: a rollback would lower the token again (``claim_in_transaction()`` accepts that, explicitly).

Every other statement that can set the token (``QuerySet.update()``, ``bulk_update()``,
``bulk_create(update_conflicts=True)``) is refused on a ``FencedQuerySet`` unless the caller asked
for it with ``unfenced()``.

Rejections are counted, logged to ``FencingRejection`` so that the row outlives the caller's
transaction, and signalled.

The modules, each importing only those after it: ``model`` (``FencedModel``), ``queryset``
(``FencedQuerySet``), ``offers`` (what a caller offers: a lease or a bare token, checked before any
I/O), ``statements`` (the SQL above), ``rejections`` (the count, the log and the signal). Importing
this package defines a model class: do it where models are defined, once Django has loaded the apps.
"""

from distlock.fencing.model import FencedModel
from distlock.fencing.queryset import FencedQuerySet
from distlock.fencing.statements import TOKEN_FIELD

__all__ = ["TOKEN_FIELD", "FencedModel", "FencedQuerySet"]
