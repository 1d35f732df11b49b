"""Tables of distlock: the database backend's locks, waiters and token counter, the rejection log and the metrics store.

The abstract ``FencedModel`` lives in ``distlock.fencing``. This module imports nothing from the rest
of distlock, so every other module may import it (see ``tests/test_architecture.py``).
"""

import warnings

from django.db import models
from django.utils.translation import gettext_lazy as _

__all__ = ["FencingRejection", "Lock", "LockWaiter", "MetricSample", "TokenSequence"]

#: Names that moved to ``distlock.fencing``; the old path keeps working, with a warning, for one release.
_MOVED_TO_FENCING = frozenset({"FencedModel", "FencedQuerySet"})


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


class LockWaiter(models.Model):
    """A blocking acquire waiting for a database lock: its place in the lock's queue, first come first served.

    The id is the ticket: a free lock goes to the waiter of that name with the lowest id whose row has
    not expired. A waiter refreshes its row at every try; the row of a waiter that died expires within
    ``distlock.backends._sql.WAITER_TTL`` and stops counting.
    """

    name = models.CharField(_("name"), max_length=255, db_index=True)
    owner = models.CharField(_("owner"), max_length=64, unique=True)
    expires_at = models.DateTimeField(_("expires at"))

    class Meta:
        verbose_name = _("lock waiter")
        verbose_name_plural = _("lock waiters")

    def __str__(self):
        return f"{self.name} #{self.pk}"


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


def __getattr__(name):
    """Return ``FencedModel`` or ``FencedQuerySet`` from their new module, with a ``DeprecationWarning``."""
    if name not in _MOVED_TO_FENCING:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"distlock.models.{name} has moved: use `from distlock.fencing import {name}`. "
                  "The old path will be removed in the next release.", DeprecationWarning, stacklevel=2)
    # Imported on use only: distlock.fencing imports this module (exempted in tests/test_architecture.py).
    from distlock import fencing  # noqa: PLC0415

    return getattr(fencing, name)
