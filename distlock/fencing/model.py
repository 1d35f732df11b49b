"""``FencedModel``: the abstract model whose saves carry a fencing token."""

from django.db import models
from django.utils.translation import gettext_lazy as _

from distlock.fencing import statements
from distlock.fencing.offers import lease_for_row, offer_for_save
from distlock.fencing.queryset import FencedQuerySet
from distlock.fencing.statements import TOKEN_FIELD
from distlock.lease import LeaseSet

__all__ = ["FencedModel"]


class FencedModel(models.Model):
    """An abstract model whose writes carry the fencing token of the lock guarding them; stale ones are refused.

    .. code-block:: python

        class Account(FencedModel):
            balance = models.IntegerField()

        with distlock.lock(f"account:{pk}", ttl=10) as lease:
            account = Account.objects.claim(lease, pk=pk)  # before reading: older tokens are locked out
            account.balance -= 10
            account.save(lease=lease)

    An update is one ``UPDATE … WHERE pk = … AND fencing_token <= t``: a row that has accepted a
    higher token is left alone and ``StaleFencingToken`` is raised (see ``distlock.fencing``).
    Tokens of different ``DISTLOCK`` aliases are not comparable: guard a table with one alias only.
    On a Redis Cluster alias tokens grow per lock name only: guard each row with one lock name.
    ``QuerySet.update()``, ``bulk_update()`` and ``delete()`` are not fenced; use ``fenced_update()``.
    """

    fencing_token = models.BigIntegerField(_("fencing token"), default=0, editable=False)

    #: True: an update without a token raises ``ValueError``. False: a plain ``save()`` updates the
    #: row unconditionally, but never lowers its token.
    fencing_required = True
    #: True: accept leases whose backend cannot promise tokens that never go backwards (Redlock).
    allow_unsafe_tokens = False
    #: The name of the lock that guards a row, as a format string over ``pk`` and the field names
    #: (e.g. ``"account:{pk}"``): how ``claim()`` and ``save()`` given a ``LeaseSet`` (``lock_many()``)
    #: pick the lease of each row. None: they refuse a ``LeaseSet``. Override ``lock_name_for()`` for
    #: names a format string cannot build.
    lock_name_template = None

    objects = FencedQuerySet.as_manager()

    #: The ``Offer`` of the save in progress, read by ``_do_update``.
    _fenced_offer = None

    class Meta:
        abstract = True

    @classmethod
    def lock_name_for(cls, values):
        """Return the name of the lock guarding the row with ``values`` (``pk`` and field names -> values).

        ``save(lease=lease_set)`` passes the instance's values; ``claim(lease_set, **lookup)`` the
        lookup's exact ones, so the name is known before the row is read. The default formats
        ``lock_name_template``; raise ``KeyError`` for a value that is needed and missing.
        """
        if cls.lock_name_template is None:
            raise TypeError(
                f"{cls._meta.label} cannot tell which lock of a LeaseSet guards a row: set lock_name_template "
                f'(e.g. lock_name_template = "account:{{pk}}") or override lock_name_for() on {cls.__name__}, '
                "or pass the one lease (lease_set.lease_for(name))."
            )
        return cls.lock_name_template.format_map(values)

    def save(self, *, lease=None, fencing_token=None, **kwargs):
        """Save the row; with ``lease=`` or ``fencing_token=`` an update lands only if no higher token came first.

        ``lease`` is checked before any I/O (``LockLost``, ``UnsafeFencingToken``). A ``LeaseSet``
        from ``lock_many()`` gives the lease of the lock ``lock_name_for()`` names for this row. An
        insert stores the token (``fencing_token`` stays 0 without one). ``update_fields`` always
        includes the token.

        :raises StaleFencingToken: the row holds a higher token; nothing was written.
        :raises ValueError: an update without a token while ``fencing_required`` is True, or a
            ``LeaseSet`` without the lock that guards this row.
        """
        if isinstance(lease, LeaseSet):
            lease = lease_for_row(type(self), lease, self)
        offer = offer_for_save(type(self), lease, fencing_token)
        if offer is None:
            return super().save(**kwargs)
        if kwargs.get("update_fields"):
            kwargs["update_fields"] = {*kwargs["update_fields"], TOKEN_FIELD}
        previous = self.fencing_token
        self.fencing_token, self._fenced_offer = offer.token, offer
        try:
            return super().save(**kwargs)
        except BaseException:
            self.fencing_token = previous
            raise
        finally:
            self._fenced_offer = None

    def _do_update(self, base_qs, using, pk_val, values, update_fields, forced_update):
        # Overrides Model._do_update (Django 5.2; pinned by tests/test_fencing.py): the one place an
        # UPDATE of a saved row is issued, so the fencing condition joins that very statement.
        if not statements.guards(base_qs.model, type(self)):
            return super()._do_update(base_qs, using, pk_val, values, update_fields, forced_update)
        if self._fenced_offer is not None:
            return statements.update_row(self, base_qs, pk_val, values, self._fenced_offer)
        if self.fencing_required:
            if base_qs.filter(pk=pk_val).exists():
                raise ValueError(
                    f"{self._meta.label} pk={pk_val!r} is fenced: update it with save(lease=lease) or "
                    f"save(fencing_token=token), or set fencing_required = False on {type(self).__name__} "
                    "to allow plain saves."
                )
            return False
        # A plain save may carry a token read long ago: writing it back could lower the stored one.
        values = [value for value in values if value[0].attname != TOKEN_FIELD]
        return super()._do_update(base_qs, using, pk_val, values, update_fields, forced_update)
