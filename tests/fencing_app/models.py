"""Fenced models the fencing tests and benchmark write to, on SQLite and PostgreSQL."""

from django.db import models

from distlock.fencing import FencedModel


class Account(FencedModel):
    """The usual case: every update must carry a token."""

    #: How a ``LeaseSet`` (``lock_many()``) names the lock of each row (``tests/test_lock_many.py``).
    lock_name_template = "account:{pk}"

    name = models.CharField(max_length=100, blank=True)
    balance = models.IntegerField(default=0)
    note = models.CharField(max_length=100, blank=True)


class LooseAccount(FencedModel):
    """Plain saves allowed (``fencing_required = False``)."""

    fencing_required = False

    balance = models.IntegerField(default=0)


class RedlockAccount(FencedModel):
    """Accepts leases whose tokens may go backwards."""

    allow_unsafe_tokens = True

    balance = models.IntegerField(default=0)


class SavingsAccount(Account):
    """Multi-table inheritance: the token lives in ``Account``'s table, the rate in this one."""

    rate = models.IntegerField(default=0)


class PlainAccount(models.Model):
    """``Account``'s table seen by a plain Django model: the benchmark's baseline for the same row."""

    name = models.CharField(max_length=100, blank=True)
    balance = models.IntegerField(default=0)
    note = models.CharField(max_length=100, blank=True)
    fencing_token = models.BigIntegerField(default=0)

    class Meta:
        managed = False
        db_table = "fencing_app_account"
