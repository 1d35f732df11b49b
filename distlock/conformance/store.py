"""The fenced store of a conformance run: counter rows of a ``FencedModel`` and the log of their commits.

Both tables are made for one run (``FencedStore.create()``) and dropped after it, on a database of
the project, so a deployment is checked without a model of its own. The models live in a private
app registry: the project's migrations never see them.

Commit order (invariant the checker relies on): an accepted claim or write and its log row are one
transaction, and the row stays locked by the fenced UPDATE until that transaction commits, so the
log's ids follow the order in which the store accepted writes to a row. A refused write is logged
after the store refused it, so every accepted write it lost to has a lower id.
"""

import secrets
import time
from functools import lru_cache

from django.apps import apps as project_apps
from django.apps.registry import Apps
from django.db import connections, models, router, transaction

from distlock.exceptions import LockLost, LockSuspended, StaleFencingToken, UnsafeFencingToken
from distlock.fencing import FencedModel
from distlock.lease import Lease

__all__ = ["APP_LABEL", "FencedStore"]

APP_LABEL = "distlock_conformance"


@lru_cache(maxsize=None)
def _models(suffix):
    """Return the ``(Row, Commit)`` models of the tables ``distlock_conformance_<suffix>[_log]``."""
    registry = Apps()

    def meta(table):
        return type("Meta", (), {"apps": registry, "app_label": APP_LABEL, "db_table": table})

    row = type(f"Row_{suffix}", (FencedModel,), {
        "__module__": __name__,
        "value": models.BigIntegerField(default=0),
        "Meta": meta(f"{APP_LABEL}_{suffix}"),
    })
    commit = type(f"Commit_{suffix}", (models.Model,), {
        "__module__": __name__,
        "id": models.BigAutoField(primary_key=True),
        "row": models.BigIntegerField(),
        "kind": models.CharField(max_length=8),
        "token": models.BigIntegerField(),
        "accepted": models.BooleanField(),
        "current": models.BigIntegerField(null=True),
        "value": models.BigIntegerField(null=True),  # read by a claim, written by a write: the register check
        "delta": models.IntegerField(default=0),
        "owner": models.CharField(max_length=64),
        "proc": models.CharField(max_length=64),
        "t": models.BigIntegerField(),
        "Meta": meta(f"{APP_LABEL}_{suffix}_log"),
    })
    return row, commit


class FencedStore:
    """The two tables of one run on database ``database``; every process of the run builds it from the same suffix."""

    def __init__(self, database, suffix=None):
        self.database = database
        self.suffix = suffix or secrets.token_hex(4)
        self.Row, self.Commit = _models(self.suffix)

    @property
    def config(self):
        """What a client process needs to open the same store."""
        return {"database": self.database, "suffix": self.suffix}

    @property
    def model_label(self):
        """The label ``FencingRejection.model_label`` records for refused writes to these rows."""
        return self.Row._meta.label

    # -- set-up, by the process that runs the scenario ----------------------------------------------

    def create(self):
        with connections[self.database].schema_editor() as editor:
            editor.create_model(self.Row)
            editor.create_model(self.Commit)
        return self

    def drop(self):
        """Drop both tables and the rejection log entries the run made (they are not the project's)."""
        with connections[self.database].schema_editor() as editor:
            editor.delete_model(self.Commit)
            editor.delete_model(self.Row)
        self._rejection_log().delete()

    def add_row(self, value=0):
        """Insert a counter row (token 0) and return its pk."""
        return self.Row.objects.using(self.database).create(value=value).pk

    # -- fenced operations, by client processes -------------------------------------------------------

    def claim(self, pk, lease_or_token, *, token, owner, proc):
        """Claim row ``pk`` before reading it; return ``(outcome, value, current)``.

        ``outcome`` is "accepted", "stale" (the store refused it), "lost" or "suspended" (the lease
        refused itself before any I/O) or "unsafe" (the store refuses this backend's tokens).
        """
        try:
            with transaction.atomic(using=self.database):
                row = self.Row.objects.using(self.database).claim_in_transaction(lease_or_token, pk=pk)
                self._log("claim", pk, token, True, value=row.value, owner=owner, proc=proc)
        except StaleFencingToken as exc:
            self._log("claim", pk, token, False, current=exc.current_token, owner=owner, proc=proc)
            return "stale", None, exc.current_token
        except LockLost:
            return "lost", None, None
        except LockSuspended:
            return "suspended", None, None
        except UnsafeFencingToken:
            return "unsafe", None, None
        return "accepted", row.value, None

    def write(self, pk, value, lease_or_token, *, delta, token, owner, proc):
        """Store ``value`` (the value read plus ``delta``) in row ``pk``; return ``(outcome, current)`` as ``claim``."""
        row = self.Row(pk=pk, value=value)
        carried = {"lease": lease_or_token} if isinstance(lease_or_token, Lease) else {"fencing_token": lease_or_token}
        try:
            with transaction.atomic(using=self.database):
                row.save(using=self.database, update_fields=["value"], **carried)
                self._log("write", pk, token, True, value=value, delta=delta, owner=owner, proc=proc)
        except StaleFencingToken as exc:
            self._log("write", pk, token, False, current=exc.current_token, delta=delta, owner=owner, proc=proc)
            return "stale", exc.current_token
        except LockLost:
            return "lost", None
        except LockSuspended:
            return "suspended", None
        except UnsafeFencingToken:
            return "unsafe", None
        return "accepted", None

    def _log(self, kind, pk, token, accepted, *, owner, proc, current=None, value=None, delta=0):
        self.Commit.objects.using(self.database).create(
            row=pk, kind=kind, token=token, accepted=accepted, current=current, value=value, delta=delta,
            owner=owner, proc=proc, t=time.monotonic_ns())

    # -- what the store saw, for the checker ------------------------------------------------------------

    def commits(self, pks):
        """Return the log of rows ``pks`` as ``store_commit`` events, in commit order (``seq``)."""
        return [
            {"t": c.t, "proc": c.proc, "op": "store_commit", "seq": c.id, "row": c.row, "kind": c.kind,
             "token": c.token, "accepted": c.accepted, "current": c.current, "value": c.value, "owner": c.owner,
             "delta": c.delta if c.accepted else 0}
            for c in self.Commit.objects.using(self.database).filter(row__in=pks).order_by("id")
        ]

    def values(self):
        """Return ``{pk: value}`` of every row."""
        return dict(self.Row.objects.using(self.database).values_list("pk", "value"))

    def _rejection_log(self):
        rejection = project_apps.get_model("distlock", "FencingRejection")
        # Logged where the routers keep distlock's tables, not necessarily on the store's database.
        return rejection._base_manager.using(router.db_for_write(rejection)).filter(model_label=self.model_label)

    def rejection_rows(self, pks):
        """Return how many refusals of writes to rows ``pks`` the store logged in ``FencingRejection``."""
        return self._rejection_log().filter(object_pk__in=[str(pk) for pk in pks]).count()
