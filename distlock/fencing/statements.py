"""The statements of fenced writes: each refuses, inside the database, a token lower than the row's.

See ``distlock.fencing`` for the statements and the invariant they keep.
"""

from django.core.exceptions import EmptyResultSet
from django.db import connections, transaction
from django.db.models.lookups import LessThanOrEqual
from django.db.models.sql.where import AND
from django.db.transaction import TransactionManagementError

from distlock.exceptions import StaleFencingToken
from distlock.fencing.rejections import record_rejections

__all__ = ["ATTEMPTS", "CLAIM_BY_PK_SQL", "CLAIM_SQL", "TOKEN_FIELD", "claim", "fenced_update", "guards",
           "refuse_open_transaction", "update_row", "updates_return_rows"]

#: The column ``FencedModel`` keeps the token in; every statement below guards it.
TOKEN_FIELD = "fencing_token"

# Claim: raise the row's token to t unless a higher token holds it, and return the row as stored.
#   {matched}    the caller's lookup, compiled by the ORM: SELECT pk FROM <table> WHERE <lookup>
#   <= t         the invariant: the token only goes up, so a stale holder changes nothing
#   COUNT = 1    get() semantics: unless the lookup matches exactly one row, nothing changes
#   RETURNING    the claimed row as stored, in the same round trip; no row back means "not claimed",
#                and a read then tells "no row", "several rows" and "stale" apart (see ``claim``).
CLAIM_SQL = (
    "UPDATE {table} SET {token} = %s"
    " WHERE {pk} IN ({matched}) AND {token} <= %s"
    " AND (SELECT COUNT(*) FROM ({first_two}) distlock_matched) = 1"
    " RETURNING {columns}"
)
# Claim by primary key alone, the common case: one row at most, so no subquery and no count.
CLAIM_BY_PK_SQL = "UPDATE {table} SET {token} = %s WHERE {pk} = %s AND {token} <= %s RETURNING {columns}"

#: Statements a save or a claim retries when its row changed between the refused statement and the
#: read that explains the refusal (a row inserted, or a token lowered by an unfenced ``update()``).
ATTEMPTS = 3


def guards(table_model, model):
    """Return True if ``table_model``'s table holds ``model``'s token (False for the other tables of
    multi-table inheritance, which are written unconditionally inside the same save)."""
    owner = model._meta.get_field(TOKEN_FIELD).model
    return owner._meta.concrete_model is table_model._meta.concrete_model


def _token_writer(queryset):
    """Return ``queryset`` allowed to set the token: distlock's own statements keep the invariant in their WHERE."""
    unfenced = getattr(queryset, "unfenced", None)
    return unfenced() if unfenced is not None else queryset


def refuse_open_transaction(model, using):
    """Raise ``TransactionManagementError`` if the connection of ``using`` is inside a transaction.

    A claim made inside a transaction that rolls back is taken back with it: the row's token goes
    down again while the claimer still holds the lock, and the older holder's stale writes land.
    """
    connection = transaction.get_connection(using)
    if connection.in_atomic_block or not connection.get_autocommit():
        raise TransactionManagementError(
            f"{model._meta.label}: claim() refuses to run inside an open transaction on database '{using}': "
            "a rollback would take the claim back, and an older holder's stale writes would be accepted again "
            "while you hold the lock. Claim before transaction.atomic() (the claim commits at once; a view "
            "under ATOMIC_REQUESTS needs @transaction.non_atomic_requests), or call claim_in_transaction() to "
            "make the claim part of your transaction and claim again after any rollback."
        )


def update_row(instance, base_qs, pk_val, values, offer):
    """Run the conditional UPDATE of a fenced save; return False if the row does not exist (Django inserts it).

    Raise ``StaleFencingToken``, writing nothing, if the row holds a higher token.
    """
    model = type(instance)
    conditional = base_qs.filter(pk=pk_val)
    # The hot path: the token condition goes straight into the WHERE clause. Built by filter() from
    # "fencing_token__lte" it costs twice the Python time (bench/fencing.py); the SQL is the same.
    query = conditional.query
    query.where.add(
        LessThanOrEqual(model._meta.get_field(TOKEN_FIELD).get_col(query.get_initial_alias()), offer.token), AND)
    for _ in range(ATTEMPTS):
        if conditional._update(values) > 0:
            return True
        current = next(iter(base_qs.filter(pk=pk_val).values_list(TOKEN_FIELD, flat=True)[:1]), None)
        if current is None:
            return False
        if current > offer.token:
            record_rejections(model, offer, base_qs.db, [(pk_val, current)])
            raise StaleFencingToken(model=model, pk=pk_val, offered_token=offer.token, current_token=current,
                                    lock_name=offer.lock_name)
    raise _kept_changing(model, {"pk": pk_val})


def updates_return_rows(connection):
    """Return True if ``connection``'s database has ``UPDATE … RETURNING``."""
    if connection.vendor == "postgresql":
        return True
    return connection.vendor == "sqlite" and connection.Database.sqlite_version_info >= (3, 35)


def claim(queryset, offer, lookup, *, in_transaction=False):
    """Raise the token of the one row ``queryset.filter(**lookup)`` matches to ``offer.token``; return that row.

    Raise ``DoesNotExist`` / ``MultipleObjectsReturned`` like ``get()``, and ``StaleFencingToken``
    if a higher token has claimed the row; in every such case nothing changes. Unless
    ``in_transaction``, raise ``TransactionManagementError`` inside an open transaction (see
    ``refuse_open_transaction``).
    """
    model = queryset.model
    if not in_transaction:
        refuse_open_transaction(model, queryset.db)
    if not guards(model, model):
        owner = model._meta.get_field(TOKEN_FIELD).model
        raise TypeError(
            f"{model._meta.label} keeps its fencing token in the table of {owner._meta.label} (multi-table "
            f"inheritance): claim the row through {owner.__name__}.objects.claim(...)."
        )
    returning = updates_return_rows(connections[queryset.db])
    pk = _pk_of(queryset, lookup) if returning else _NOT_BY_PK
    # Built only when needed: the claim by primary key skips the ORM's filter machinery (the hot path).
    matched = queryset.filter(**lookup).order_by() if pk is _NOT_BY_PK else None
    for _ in range(ATTEMPTS):
        if matched is None:
            rows = _claim_by_pk(queryset, pk, offer.token)
        elif returning:
            rows = _claim_returning(matched, offer.token)
        else:
            rows = _claim_locking(matched, offer.token)
        if rows:
            return rows[0]
        # Not claimed: find out why. Tokens only go up, so a higher token seen now was there before.
        if matched is None:
            matched = queryset.filter(**lookup).order_by()
        found = list(matched.values_list("pk", TOKEN_FIELD)[:2])
        if not found:
            raise model.DoesNotExist(f"{model._meta.object_name} matching query does not exist.")
        if len(found) > 1:
            raise model.MultipleObjectsReturned(
                f"claim() matched more than one {model._meta.object_name}; claim one row at a time."
            )
        ((pk, current),) = found
        if current > offer.token:
            record_rejections(model, offer, queryset.db, [(pk, current)])
            raise StaleFencingToken(model=model, pk=pk, offered_token=offer.token, current_token=current,
                                    lock_name=offer.lock_name)
    raise _kept_changing(model, lookup)


_NOT_BY_PK = object()


def _pk_of(queryset, lookup):
    """Return the primary key ``lookup`` names, or ``_NOT_BY_PK`` unless it is the queryset's only condition."""
    opts = queryset.model._meta
    if len(lookup) != 1 or queryset.query.where or queryset.query.is_sliced:
        return _NOT_BY_PK
    ((key, value),) = lookup.items()
    if key not in ("pk", opts.pk.name, opts.pk.attname) or value is None or hasattr(value, "resolve_expression"):
        return _NOT_BY_PK
    return value


def _claim_by_pk(queryset, pk, token):
    """Run ``CLAIM_BY_PK_SQL``; return the claimed row, or no row."""
    opts = queryset.model._meta
    connection = connections[queryset.db]
    quote = connection.ops.quote_name
    sql = CLAIM_BY_PK_SQL.format(
        table=quote(opts.db_table), token=quote(opts.get_field(TOKEN_FIELD).column), pk=quote(opts.pk.column),
        columns=", ".join(quote(f.column) for f in opts.concrete_fields),
    )
    return _returned_rows(queryset, sql, [token, opts.pk.get_db_prep_value(pk, connection), token])


def _claim_returning(matched, token):
    """Run ``CLAIM_SQL`` for any lookup; return the claimed row, or no row."""
    opts = matched.model._meta
    quote = connections[matched.db].ops.quote_name
    pks = matched.values("pk")
    try:
        matched_sql, matched_params = pks.query.get_compiler(matched.db).as_sql()
        two_sql, two_params = pks[:2].query.get_compiler(matched.db).as_sql()
    except EmptyResultSet:  # e.g. .none(): no row can match
        return []
    sql = CLAIM_SQL.format(
        table=quote(opts.db_table), token=quote(opts.get_field(TOKEN_FIELD).column), pk=quote(opts.pk.column),
        matched=matched_sql, first_two=two_sql, columns=", ".join(quote(f.column) for f in opts.concrete_fields),
    )
    return _returned_rows(matched, sql, [token, *matched_params, token, *two_params])


def _returned_rows(queryset, sql, params):
    """Run ``sql``, an UPDATE returning every concrete column, and return the rows as model instances."""
    model, using = queryset.model, queryset.db
    fields = model._meta.concrete_fields
    with connections[using].cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    # Convert each column as a SELECT of the model would (dates on SQLite, decimals, JSON, ...).
    compiler = queryset.query.get_compiler(using)
    converters = compiler.get_converters([field.get_col(model._meta.db_table) for field in fields])
    if converters:
        rows = compiler.apply_converters(rows, converters)
    return [model.from_db(using, [field.attname for field in fields], row) for row in rows]


def _claim_locking(matched, token):
    """Claim where ``UPDATE … RETURNING`` is missing: lock the row, check and raise its token, in one transaction."""
    with transaction.atomic(using=matched.db):
        rows = list(matched.select_for_update()[:2])
        if len(rows) != 1 or getattr(rows[0], TOKEN_FIELD) > token:
            return []
        # The row is locked until commit, so its token cannot have moved since the read. The condition
        # keeps the invariant where that lock does not hold (select_for_update() is a no-op on SQLite):
        # a token raised since the read makes this match nothing, and the caller's read explains why.
        raised = _token_writer(matched.model._base_manager.using(matched.db)).filter(
            pk=rows[0].pk, **{f"{TOKEN_FIELD}__lte": token}).update(**{TOKEN_FIELD: token})
        if not raised:
            return []
        setattr(rows[0], TOKEN_FIELD, token)
        return rows


def fenced_update(queryset, offer, fields):
    """Update the rows of ``queryset`` whose token is ``<= offer.token``; record every other one as a rejection.

    Return the number of rows updated. Runs in one transaction, so on SQLite the rows reported stale
    are exactly those the update skipped; on PostgreSQL (read committed) a row that starts matching the
    filter between the two statements with a higher token is reported too.
    """
    if TOKEN_FIELD in fields:
        raise TypeError(f"fenced_update() sets {TOKEN_FIELD} to the token it is given; do not pass it in the fields.")
    if not fields:
        raise TypeError("fenced_update() needs at least one field to set, e.g. fenced_update(token, status='done').")
    with transaction.atomic(using=queryset.db):
        updated = _token_writer(queryset).filter(**{f"{TOKEN_FIELD}__lte": offer.token}).update(
            **fields, **{TOKEN_FIELD: offer.token})
        stale = list(queryset.filter(**{f"{TOKEN_FIELD}__gt": offer.token}).order_by()
                     .values_list("pk", TOKEN_FIELD))
    if stale:
        record_rejections(queryset.model, offer, queryset.db, stale)
    return updated


def _kept_changing(model, lookup):
    return RuntimeError(
        f"{model._meta.label} matching {lookup!r} changed {ATTEMPTS} times between a refused fenced write and "
        "the read that explains it (rows inserted, or tokens lowered by an unfenced update()); retry the write."
    )
