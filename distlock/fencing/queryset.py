"""``FencedQuerySet``: the claim and bulk paths of ``FencedModel`` (``Model.objects.claim(...)``)."""

from django.core.exceptions import FieldDoesNotExist
from django.db import models

from distlock.fencing import statements
from distlock.fencing.offers import lease_for_lookup, offer
from distlock.fencing.statements import TOKEN_FIELD
from distlock.lease import LeaseSet

__all__ = ["FencedQuerySet"]


class FencedQuerySet(models.QuerySet):
    """A queryset whose writes carry a fencing token; the manager of every ``FencedModel``.

    A model that declares its own manager keeps these methods by building it from this class
    (``FencedQuerySet.as_manager()`` or ``MyManager.from_queryset(FencedQuerySet)``).

    ``update()``, ``bulk_update()`` and ``bulk_create(update_conflicts=True)`` refuse to set the
    token unless the queryset comes from ``unfenced()``: a lowered token lets stale writes through.
    """

    #: True on a queryset from ``unfenced()``: its bulk writes may set the token.
    _token_writable = False

    def _clone(self):
        clone = super()._clone()
        clone._token_writable = self._token_writable
        return clone

    def _writing(self):
        """Return a copy bound to the database routers pick for writes, as ``update()`` is.

        A claim and a fenced update read the stale rows and write on one database, in one
        transaction; with a read-replica router, ``self.db`` alone would name the replica.
        """
        clone = self._chain()
        clone._for_write = True
        return clone

    def unfenced(self):
        """Return a copy of this queryset whose ``update()``, ``bulk_update()`` and ``bulk_create()`` may set the token.

        Setting the token yourself can lower it, and a row with a lowered token accepts the writes
        of stale holders again: use it for maintenance (e.g. resetting rows after moving to another
        lock alias), never in the path of a fenced write.
        """
        clone = self._chain()
        clone._token_writable = True
        return clone

    def update(self, **kwargs):
        _refuse_token_write(self, "update()", kwargs)
        return super().update(**kwargs)

    def bulk_update(self, objs, fields, batch_size=None):
        _refuse_token_write(self, "bulk_update()", fields)
        return super().bulk_update(objs, fields, batch_size=batch_size)

    def bulk_create(self, objs, batch_size=None, ignore_conflicts=False, update_conflicts=False,
                    update_fields=None, unique_fields=None):
        if update_conflicts and update_fields:
            _refuse_token_write(self, "bulk_create(update_conflicts=True)", update_fields)
        return super().bulk_create(objs, batch_size=batch_size, ignore_conflicts=ignore_conflicts,
                                   update_conflicts=update_conflicts, update_fields=update_fields,
                                   unique_fields=unique_fields)

    def claim(self, lease_or_token, **lookup):
        """Raise the matching row's token to the lease's token and return the row as stored after that.

        Claim a row *before* reading it for a read-modify-write: once claimed, any later write
        carrying an older token is refused, so an update made from a stale read cannot land.

        The claim commits at once, so it refuses to run inside an open transaction: a rollback would
        take it back while you still hold the lock (see ``claim_in_transaction()``).

        :param lease_or_token: a ``Lease`` (checked first: ``LockLost``, ``UnsafeFencingToken``), an int
            token, or a ``LeaseSet`` (``lock_many()``): its lease on the lock ``model.lock_name_for()``
            builds from ``lookup``, which must give the template's fields exactly (e.g. ``pk=7``).
        :param lookup: as for ``get()``; exactly one row must match.
        :raises StaleFencingToken: a higher token has claimed or written the row; nothing changed.
        :raises DoesNotExist: no row matches (``MultipleObjectsReturned`` if several do).
        :raises TransactionManagementError: called inside ``transaction.atomic()`` (or with autocommit off).
        """
        return statements.claim(self._writing(), self._claim_offer(lease_or_token, lookup), lookup)

    def claim_in_transaction(self, lease_or_token, **lookup):
        """``claim()`` as part of the caller's open transaction: the raised token commits or rolls back with it.

        After a rollback the claim is void: older holders' writes are accepted again, so claim again
        before reading. For callers that must commit the claim together with other rows.
        """
        return statements.claim(self._writing(), self._claim_offer(lease_or_token, lookup), lookup,
                                in_transaction=True)

    def _claim_offer(self, lease_or_token, lookup):
        if isinstance(lease_or_token, LeaseSet):
            lease_or_token = lease_for_lookup(self.model, lease_or_token, lookup)
        return offer(self.model, lease_or_token, "lease_or_token")

    def fenced_update(self, token, **fields):
        """Set ``fields`` (and the token) on every row of this queryset whose token is not newer; return the count.

        ``token`` is a ``Lease`` or an int. Each row skipped because it holds a higher token is a
        rejection like a refused save (counted, logged, signalled), but nothing is raised: compare
        the count with what you expected.
        """
        return statements.fenced_update(self._writing(), offer(self.model, token, "token"), fields)


def _refuse_token_write(queryset, method, names):
    """Raise ``ValueError`` if ``names`` (field names or attnames) set the token and ``queryset`` is not ``unfenced()``.

    ``method`` is the call as the caller wrote it, for the message.
    """
    if queryset._token_writable:
        return
    model = queryset.model
    for name in names:
        try:
            field = model._meta.get_field(name)
        except FieldDoesNotExist:
            continue  # Django reports it, with its own message
        if getattr(field, "attname", None) == TOKEN_FIELD:
            raise ValueError(
                f"{model._meta.label}: {method} would set {TOKEN_FIELD} outside the fence; a lowered token "
                f"lets stale holders' writes through. Write under the fence with fenced_update(lease, **fields) "
                f"or save(lease=lease); to set the token yourself (e.g. to reset rows after moving to another "
                f"lock alias), ask for it: {model.__name__}.objects.unfenced().{method.split('(')[0]}(...)."
            )
