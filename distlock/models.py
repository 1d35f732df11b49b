"""Tables of distlock: the database backend's locks, ``FencedModel`` and the log of refused fenced writes."""

from django.db import models
from django.utils.translation import gettext_lazy as _

from distlock import fencing
from distlock.querysets import FencedQuerySet


class Lock(models.Model):
    """A lock held through the database backend; a row whose ``expires_at`` has passed is free.

    Expiry is judged by the database server's clock (``now()`` in the statements of
    ``distlock.backends.database``), never the client's.
    """

    name = models.CharField(_("name"), max_length=255, unique=True)
    owner = models.CharField(_("owner"), max_length=64)
    token = models.BigIntegerField(_("fencing token"))
    acquired_at = models.DateTimeField(_("acquired at"))
    expires_at = models.DateTimeField(_("expires at"), db_index=True)
    host = models.CharField(_("host"), max_length=255, blank=True)
    pid = models.IntegerField(_("pid"), null=True, blank=True)
    task_id = models.CharField(_("Celery task id"), max_length=255, blank=True)

    class Meta:
        verbose_name = _("held lock")
        verbose_name_plural = _("held locks")
        permissions = [("force_release_lock", _("Can force-release a lock held by another process"))]

    def __str__(self):
        return self.name


class TokenSequence(models.Model):
    """The counter the database backend draws fencing tokens from where the database has no sequences.

    One row per database; tokens are shared by every lock name, so they are comparable across names.
    """

    value = models.BigIntegerField(default=0)

    class Meta:
        verbose_name = _("fencing token sequence")


class FencingRejection(models.Model):
    """One fenced write or claim the store refused: two holders acted at once and must be investigated."""

    model_label = models.CharField(_("model"), max_length=255)
    object_pk = models.CharField(_("object pk"), max_length=255, blank=True)
    offered_token = models.BigIntegerField(_("offered token"))
    current_token = models.BigIntegerField(_("current token"), null=True, blank=True)
    lock_name = models.CharField(_("lock name"), max_length=255, blank=True)
    alias = models.CharField(_("alias"), max_length=255, blank=True)
    host = models.CharField(_("host"), max_length=255, blank=True)
    pid = models.IntegerField(_("pid"), null=True, blank=True)
    created_at = models.DateTimeField(_("rejected at"), auto_now_add=True, db_index=True)

    class Meta:
        verbose_name = _("fencing rejection")
        verbose_name_plural = _("fencing rejections")
        ordering = ["-created_at"]

    def __str__(self):
        return f"{self.model_label} pk={self.object_pk}: token {self.offered_token} < {self.current_token}"


class MetricSample(models.Model):
    """Lock metrics of every process, summed per minute: one counter, or one histogram bucket, per row.

    Processes add to these rows (``distlock.metrics.store``), so the figures cover the whole cluster.
    ``period_start`` 0 holds the totals of minutes older than ``DISTLOCK_METRICS['HISTORY']``.
    """

    period_start = models.BigIntegerField(_("period start (Unix seconds)"))
    alias = models.CharField(_("alias"), max_length=255)
    prefix = models.CharField(_("lock-name prefix"), max_length=255)
    series = models.CharField(_("series"), max_length=32)
    bucket = models.SmallIntegerField(_("histogram bucket"), default=0)
    count = models.BigIntegerField(_("count"), default=0)

    class Meta:
        verbose_name = _("metric sample")
        verbose_name_plural = _("metric samples")
        constraints = [
            models.UniqueConstraint(fields=["period_start", "alias", "prefix", "series", "bucket"],
                                    name="distlock_metricsample_key"),
        ]

    def __str__(self):
        return f"{self.period_start} {self.alias}/{self.prefix} {self.series}[{self.bucket}] = {self.count}"


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
    ``QuerySet.update()``, ``bulk_update()`` and ``delete()`` are not fenced; use ``fenced_update()``.
    """

    fencing_token = models.BigIntegerField(_("fencing token"), default=0, editable=False)

    #: True: an update without a token raises ``ValueError``. False: a plain ``save()`` updates the
    #: row unconditionally, but never lowers its token.
    fencing_required = True
    #: True: accept leases whose backend cannot promise tokens that never go backwards (Redlock).
    allow_unsafe_tokens = False

    objects = FencedQuerySet.as_manager()

    #: The ``fencing.Offer`` of the save in progress, read by ``_do_update``.
    _fenced_offer = None

    class Meta:
        abstract = True

    def save(self, *, lease=None, fencing_token=None, **kwargs):
        """Save the row; with ``lease=`` or ``fencing_token=`` an update lands only if no higher token came first.

        ``lease`` is checked before any I/O (``LockLost``, ``UnsafeFencingToken``). An insert stores
        the token (``fencing_token`` stays 0 without one). ``update_fields`` always includes the token.

        :raises StaleFencingToken: the row holds a higher token; nothing was written.
        :raises ValueError: an update without a token while ``fencing_required`` is True.
        """
        offer = fencing.offer_for_save(type(self), lease, fencing_token)
        if offer is None:
            return super().save(**kwargs)
        if kwargs.get("update_fields"):
            kwargs["update_fields"] = {*kwargs["update_fields"], fencing.TOKEN_FIELD}
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
        if not fencing.guards(base_qs.model, type(self)):
            return super()._do_update(base_qs, using, pk_val, values, update_fields, forced_update)
        if self._fenced_offer is not None:
            return fencing.update_row(self, base_qs, pk_val, values, self._fenced_offer)
        if self.fencing_required:
            if base_qs.filter(pk=pk_val).exists():
                raise ValueError(
                    f"{self._meta.label} pk={pk_val!r} is fenced: update it with save(lease=lease) or "
                    f"save(fencing_token=token), or set fencing_required = False on {type(self).__name__} "
                    "to allow plain saves."
                )
            return False
        # A plain save may carry a token read long ago: writing it back could lower the stored one.
        values = [value for value in values if value[0].attname != fencing.TOKEN_FIELD]
        return super()._do_update(base_qs, using, pk_val, values, update_fields, forced_update)
