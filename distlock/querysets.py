"""``FencedQuerySet``: the claim and bulk paths of ``FencedModel`` (``Model.objects.claim(...)``)."""

from django.db import models

from distlock import fencing


class FencedQuerySet(models.QuerySet):
    """A queryset whose writes carry a fencing token; the manager of every ``FencedModel``.

    A model that declares its own manager keeps these methods by building it from this class
    (``FencedQuerySet.as_manager()`` or ``MyManager.from_queryset(FencedQuerySet)``).
    """

    def claim(self, lease_or_token, **lookup):
        """Raise the matching row's token to the lease's token and return the row as stored after that.

        Claim a row *before* reading it for a read-modify-write: once claimed, any later write
        carrying an older token is refused, so an update made from a stale read cannot land.

        :param lease_or_token: a ``Lease`` (checked first: ``LockLost``, ``UnsafeFencingToken``) or an int token.
        :param lookup: as for ``get()``; exactly one row must match.
        :raises StaleFencingToken: a higher token has claimed or written the row; nothing changed.
        :raises DoesNotExist: no row matches (``MultipleObjectsReturned`` if several do).
        """
        return fencing.claim(self, fencing.offer(self.model, lease_or_token, "lease_or_token"), lookup)

    def fenced_update(self, token, **fields):
        """Set ``fields`` (and the token) on every row of this queryset whose token is not newer; return the count.

        ``token`` is a ``Lease`` or an int. Each row skipped because it holds a higher token is a
        rejection like a refused save (counted, logged, signalled), but nothing is raised: compare
        the count with what you expected.
        """
        return fencing.fenced_update(self, fencing.offer(self.model, token, "token"), fields)
