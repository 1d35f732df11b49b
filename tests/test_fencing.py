"""FencedModel: the store refuses stale fencing tokens, on SQLite and PostgreSQL, with real processes and lock servers."""

import inspect
import os
import re
import signal
import threading
import time
from io import StringIO

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import connections, models, router, transaction
from django.db.models import F
from django.db.transaction import TransactionManagementError
from django.test.utils import CaptureQueriesContext

import distlock
from distlock import metrics
from distlock.backends.base import SAFE_FENCING_TOKENS
from distlock.backends.locmem import LocMemBackend
from distlock.fencing import FencedModel, FencedQuerySet, statements
from distlock.models import FencingRejection
from distlock.signals import fencing_token_rejected
from tests.conftest import LONG, long_only, require_alias
from tests.fencing_app.models import Account, LooseAccount, RedlockAccount, SavingsAccount
from tests.fencing_workers import Worker

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

#: The databases fenced rows live on: SQLite and PostgreSQL.
DATABASE_ALIASES = ["default", "postgres"]
#: The lock aliases of the multi-process timelines: the database backend on each database, Redis (one instance and
#: a cluster), ZooKeeper, etcd.
LOCK_ALIASES = ["default", "postgres", "redis", "redis_cluster", "zookeeper", "etcd"]
#: (lock alias, database) pairs of the long 8-process run: ``make test`` runs the default-default one (the
#: pause timelines cover every lock backend there), every lock backend once with DISTLOCK_FAULTS_LONG=1.
SOAK_PAIRS = [("default", "default"), pytest.param("postgres", "postgres", marks=long_only),
              pytest.param("redis", "default", marks=long_only), pytest.param("zookeeper", "postgres", marks=long_only),
              pytest.param("etcd", "default", marks=long_only)]
#: Claimed increments per process of that run: 100 with DISTLOCK_FAULTS_LONG=1, 70 in ``make test`` (its time
#: budget). The pauses are seeded: 70 still gives about six pauses past the ttl followed by a write with the
#: bare token, hence stale writes, which the test requires (5 in every run tried; 50 gave only 2 or 3).
SOAK_COUNT = 100 if LONG else 70


#: (lock alias, database) pairs of the pause timelines in ``make test``: every lock backend once, both
#: databases; the other pairs run with ``DISTLOCK_FAULTS_LONG=1`` (the suite's time budget).
TIMELINE_PAIRS = [("default", "default"), ("postgres", "postgres"), ("redis", "default"), ("redis_cluster", "default"),
                  ("zookeeper", "postgres"), ("etcd", "default")]
ALL_PAIRS = [pytest.param(alias, db, marks=() if (alias, db) in TIMELINE_PAIRS else long_only)
             for alias in LOCK_ALIASES for db in DATABASE_ALIASES]
#: The pause timelines' workers: ZooKeeper and etcd free a paused holder's lock when its session expires,
#: not at its ttl, so their sessions last 3 s (as in the fault suite) instead of the default 10 s.
SHORT_SESSIONS = {"DISTLOCK_TEST_SESSION_TIMEOUT": "3"}


def require_database(alias):
    """Return ``alias``; PostgreSQL fails the test if ``make test`` started it but it is missing."""
    if alias not in settings.DATABASES:
        if "postgres" in os.environ.get("DISTLOCK_TEST_REQUIRE", "").split(","):
            pytest.fail(f"database {alias!r} is missing although its server was started")
        pytest.skip(f"database {alias!r} needs a PostgreSQL server; run the suite with `make test`")
    return alias


@pytest.fixture(params=DATABASE_ALIASES)
def db(request):
    """Each database alias in turn."""
    return require_database(request.param)


@pytest.fixture(params=LOCK_ALIASES)
def lock_alias(request):
    """Each lock alias whose server runs."""
    return require_alias(request.param)


@pytest.fixture
def recorded(monkeypatch):
    """The (alias, lock name) of each counted rejection (metrics) and the arguments of each ``fencing_token_rejected``."""
    seen = {"metrics": [], "signals": []}
    count = metrics.record_rejection

    def counting(alias, name=""):
        seen["metrics"].append((alias, name))
        return count(alias, name)

    def receiver(sender, **kwargs):
        seen["signals"].append({"sender": sender, **kwargs})

    monkeypatch.setattr(metrics, "record_rejection", counting)
    fencing_token_rejected.connect(receiver)
    yield seen
    fencing_token_rejected.disconnect(receiver)


class UnsafeTokenBackend(LocMemBackend):
    """Tokens without the ``safe_fencing_tokens`` capability, as Redlock's are."""

    capabilities = LocMemBackend.capabilities - {SAFE_FENCING_TOKENS}


def rejections(db, account):
    """The logged rejections of ``account`` (from database ``db``): they go where the routers keep
    distlock's tables, the default database here, whichever database the fenced row is on."""
    return list(FencingRejection.objects.using(router.db_for_read(FencingRejection))
                .filter(model_label=account._meta.label, object_pk=str(account.pk)).order_by("id"))


def stored(db, account):
    return type(account).objects.using(db).get(pk=account.pk)


def in_another_thread(function):
    """Return ``function()`` run on another thread, hence on another database connection."""
    result = []

    def run():
        try:
            result.append(function())
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    return result[0]


def eventually(predicate, timeout=30):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# -- save ------------------------------------------------------------------------------------------

def test_do_update_is_the_hook_django_calls():
    """FencedModel overrides the private Model._do_update: a Django upgrade that changes it must fail here."""
    assert list(inspect.signature(models.Model._do_update).parameters) == [
        "self", "base_qs", "using", "pk_val", "values", "update_fields", "forced_update"]
    assert "_do_update" in FencedModel.__dict__


def test_the_old_import_paths_still_work_and_warn():
    """Kept for one release after the move to ``distlock.fencing``; each warning names the new path and the caller."""
    with pytest.warns(DeprecationWarning, match=r"use `from distlock\.fencing import FencedModel`") as model_warning:
        from distlock.models import FencedModel as old_model  # noqa: PLC0415
    with pytest.warns(DeprecationWarning, match=r"use `from distlock\.fencing import FencedQuerySet`"):
        from distlock.models import FencedQuerySet as old_queryset  # noqa: PLC0415
    with pytest.warns(DeprecationWarning, match=r"use `from distlock\.fencing import FencedQuerySet`"):
        from distlock.querysets import FencedQuerySet as older_queryset  # noqa: PLC0415
    assert (old_model, old_queryset, older_queryset) == (FencedModel, FencedQuerySet, FencedQuerySet)
    assert model_warning[0].filename == __file__
    with pytest.raises(ImportError):
        from distlock.models import NoSuchName  # noqa: F401, PLC0415


def test_insert_stores_the_given_token_or_zero(db):
    plain = Account.objects.using(db).create(balance=1)
    assert stored(db, plain).fencing_token == 0
    fenced = Account(balance=2)
    fenced.save(using=db, fencing_token=7)
    assert stored(db, fenced).fencing_token == 7


def test_fenced_save_is_one_conditional_update(db):
    account = Account.objects.using(db).create(balance=1)
    account.balance = 5
    with CaptureQueriesContext(connections[db]) as queries:
        account.save(fencing_token=10)
    assert len(queries) == 1, [q["sql"] for q in queries]
    sql = queries[0]["sql"]
    assert sql.startswith("UPDATE ")
    assert re.search(r'"fencing_token" = 10\b', sql) and re.search(r'"fencing_token" <= 10\b', sql), sql
    account.refresh_from_db()
    assert (account.balance, account.fencing_token) == (5, 10)


def test_equal_token_rewrite_is_accepted(db, recorded):
    account = Account.objects.using(db).create(balance=1)
    account.save(fencing_token=10)
    account.balance = 2
    account.save(fencing_token=10)
    assert (stored(db, account).balance, stored(db, account).fencing_token) == (2, 10)
    assert recorded["metrics"] == [] and rejections(db, account) == []


def test_stale_token_is_refused_counted_logged_and_signalled(db, recorded):
    account = Account.objects.using(db).create(balance=1)
    newer = stored(db, account)
    newer.balance, newer.note = 2, "newer"
    newer.save(fencing_token=34)

    account.balance, account.note = 3, "stale"
    with pytest.raises(distlock.StaleFencingToken) as caught:
        account.save(fencing_token=33)
    error = caught.value
    assert (error.model, error.pk, error.offered_token, error.current_token, error.lock_name) == (
        Account, account.pk, 33, 34, None)
    assert account.fencing_token == 0, "a refused save leaves the instance's token as it was"
    row = stored(db, account)
    assert (row.balance, row.note, row.fencing_token) == (2, "newer", 34), "nothing of the stale write landed"

    (logged,) = rejections(db, account)
    assert (logged.offered_token, logged.current_token, logged.lock_name, logged.alias, logged.pid) == (
        33, 34, "", db, os.getpid())
    assert recorded["metrics"] == [(db, "")]
    (sent,) = recorded["signals"]
    assert (sent["sender"], sent["model"], sent["pk"], sent["offered_token"], sent["current_token"],
            sent["lock_name"]) == (Account, Account, account.pk, 33, 34, None)


def test_stale_lease_is_refused_and_names_its_lock(db, recorded, lock_name):
    older = distlock.acquire(f"{lock_name}:a", ttl=30, using="locmem")
    newer = distlock.acquire(f"{lock_name}:b", ttl=30, using="locmem")
    account = Account.objects.using(db).create(balance=1)
    # Tokens of one alias are comparable across lock names: either name may guard the row.
    copy = stored(db, account)
    copy.save(lease=newer)
    account.balance = 9
    with pytest.raises(distlock.StaleFencingToken) as caught:
        account.save(lease=older)
    assert (caught.value.offered_token, caught.value.current_token, caught.value.lock_name) == (
        older.token, newer.token, older.name)
    (logged,) = rejections(db, account)
    assert (logged.lock_name, logged.alias) == (older.name, "locmem")
    assert recorded["metrics"] == [("locmem", older.name)]
    assert stored(db, account).balance == 1
    older.release()
    newer.release()


def test_update_without_token_is_refused_when_required(db):
    account = Account.objects.using(db).create(balance=1)
    account.balance = 2
    with pytest.raises(ValueError, match=r"save\(lease=lease\).*fencing_required = False"):
        account.save()
    assert stored(db, account).balance == 1
    # An explicit pk that is not in the table yet makes an insert, which needs no token.
    Account(pk=account.pk + 1000, balance=5).save(using=db)
    assert Account.objects.using(db).get(pk=account.pk + 1000).balance == 5


def test_plain_save_when_not_required_never_lowers_the_token(db):
    loose = LooseAccount.objects.using(db).create(balance=1)
    read_long_ago = stored(db, loose)
    stored(db, loose).save(fencing_token=9)
    read_long_ago.balance = 5
    read_long_ago.save()
    row = stored(db, loose)
    assert (row.balance, row.fencing_token) == (5, 9)
    with pytest.raises(distlock.StaleFencingToken):
        read_long_ago.save(fencing_token=8)


def test_update_fields_writes_the_listed_fields_and_the_token(db):
    account = Account.objects.using(db).create(balance=1, note="original")
    account.balance, account.note = 2, "not saved"
    with CaptureQueriesContext(connections[db]) as queries:
        account.save(update_fields=["balance"], fencing_token=5)
    assert len(queries) == 1 and '"note"' not in queries[0]["sql"]
    row = stored(db, account)
    assert (row.balance, row.note, row.fencing_token) == (2, "original", 5)
    account.balance = 3
    with pytest.raises(distlock.StaleFencingToken):
        account.save(update_fields=["balance"], fencing_token=4)
    assert stored(db, account).balance == 2


def test_lost_lease_is_refused_before_touching_the_database(db, lock_name):
    account = Account.objects.using(db).create(balance=1)
    lease = distlock.acquire(lock_name, ttl=0.2, using="locmem")
    time.sleep(0.3)
    account.balance = 2
    with CaptureQueriesContext(connections[db]) as queries:
        with pytest.raises(distlock.LockLost):
            account.save(lease=lease)
        with pytest.raises(distlock.LockLost):
            Account.objects.using(db).claim(lease, pk=account.pk)
        with pytest.raises(distlock.LockLost):
            Account.objects.using(db).filter(pk=account.pk).fenced_update(lease, balance=2)
    assert len(queries) == 0
    assert stored(db, account).balance == 1


def test_unsafe_tokens_are_refused_unless_the_model_opts_in(db, lock_name):
    lease = UnsafeTokenBackend("unsafe-tokens", {}).acquire(lock_name, ttl=30, timeout=0, blocking=False)
    assert lease.token_is_safe is False
    account = Account.objects.using(db).create(balance=1)
    account.balance = 2
    with CaptureQueriesContext(connections[db]) as queries:
        with pytest.raises(distlock.UnsafeFencingToken, match="allow_unsafe_tokens = True on Account"):
            account.save(lease=lease)
        with pytest.raises(distlock.UnsafeFencingToken):
            Account.objects.using(db).claim(lease, pk=account.pk)
        with pytest.raises(distlock.UnsafeFencingToken):
            Account.objects.using(db).filter(pk=account.pk).fenced_update(lease, balance=2)
    assert len(queries) == 0

    opted_in = RedlockAccount.objects.using(db).create(balance=1)
    claimed = RedlockAccount.objects.using(db).claim(lease, pk=opted_in.pk)
    claimed.balance = 2
    claimed.save(lease=lease)
    assert (stored(db, opted_in).balance, stored(db, opted_in).fencing_token) == (2, lease.token)
    lease.release()


def test_redlock_lease_is_refused(db, lock_name):
    alias = require_alias("redlock")
    with distlock.lock(lock_name, ttl=10, using=alias) as lease:
        account = Account.objects.using(db).create(balance=1)
        with pytest.raises(distlock.UnsafeFencingToken):
            account.save(lease=lease)
        opted_in = RedlockAccount.objects.using(db).create(balance=1)
        opted_in.save(lease=lease)
        assert stored(db, opted_in).fencing_token == lease.token


def test_bad_arguments(db, lock_name):
    account = Account.objects.using(db).create(balance=1)
    for bad, error in [("5", TypeError), (True, TypeError), (1.0, TypeError), (0, ValueError), (-3, ValueError),
                       (2**63, ValueError)]:
        with pytest.raises(error, match="fencing_token"):
            account.save(fencing_token=bad)
        with pytest.raises(error, match="lease_or_token"):
            Account.objects.using(db).claim(bad, pk=account.pk)
        with pytest.raises(error, match="token"):
            Account.objects.using(db).fenced_update(bad, balance=2)
    with distlock.lock(lock_name, ttl=10, using="locmem") as lease:
        with pytest.raises(TypeError, match="not both"):
            account.save(lease=lease, fencing_token=lease.token)
        with pytest.raises(TypeError, match="fencing_token="):
            account.save(lease=lease.token)
    with pytest.raises(TypeError, match="at least one field"):
        Account.objects.using(db).fenced_update(5)
    with pytest.raises(TypeError, match="do not pass it"):
        Account.objects.using(db).fenced_update(5, fencing_token=6)
    assert stored(db, account).fencing_token == 0


def test_multi_table_child_is_fenced_through_the_parents_table(db):
    savings = SavingsAccount.objects.using(db).create(balance=1, rate=2)
    savings.balance, savings.rate = 5, 3
    savings.save(fencing_token=10)
    row = stored(db, savings)
    assert (row.balance, row.rate, row.fencing_token) == (5, 3, 10)
    savings.balance, savings.rate = 6, 4
    with pytest.raises(distlock.StaleFencingToken):
        savings.save(fencing_token=9)
    row = stored(db, savings)
    assert (row.balance, row.rate, row.fencing_token) == (5, 3, 10), "neither table was written"
    assert eventually(lambda: len(rejections(db, savings)) == 1)
    with pytest.raises(TypeError, match=r"Account.objects.claim"):
        SavingsAccount.objects.using(db).claim(11, pk=savings.pk)
    assert Account.objects.using(db).claim(11, pk=savings.pk).fencing_token == 11


# -- claim -----------------------------------------------------------------------------------------

def test_claim_returns_the_row_as_stored_in_one_statement(db):
    account = Account.objects.using(db).create(balance=7, note="mine")
    Account.objects.using(db).filter(pk=account.pk).update(note="written by someone else")
    with CaptureQueriesContext(connections[db]) as queries:
        claimed = Account.objects.using(db).claim(40, pk=account.pk)
    assert len(queries) == 1 and queries[0]["sql"].startswith("UPDATE ") and "RETURNING" in queries[0]["sql"]
    assert (claimed.pk, claimed.balance, claimed.note, claimed.fencing_token) == (
        account.pk, 7, "written by someone else", 40)
    assert claimed._state.db == db and not claimed._state.adding
    assert stored(db, account).fencing_token == 40
    claimed.balance = 8
    claimed.save(fencing_token=40)
    assert Account.objects.using(db).claim(40, pk=account.pk).balance == 8, "the same token may claim again"


def check_claim_refusals(db, recorded, lock_name):
    account = Account.objects.using(db).create(balance=1)
    with distlock.lock(lock_name, ttl=30, using="locmem") as lease:
        Account.objects.using(db).claim(lease.token + 10, pk=account.pk)
        with pytest.raises(distlock.StaleFencingToken) as caught:
            Account.objects.using(db).claim(lease, pk=account.pk)
        assert (caught.value.offered_token, caught.value.current_token, caught.value.lock_name) == (
            lease.token, lease.token + 10, lease.name)
        assert stored(db, account).fencing_token == lease.token + 10
        (logged,) = rejections(db, account)
        assert (logged.offered_token, logged.current_token, logged.lock_name) == (
            lease.token, lease.token + 10, lease.name)
        assert recorded["metrics"] == [("locmem", lease.name)] and len(recorded["signals"]) == 1

    with pytest.raises(Account.DoesNotExist):
        Account.objects.using(db).claim(5, pk=account.pk + 1000)
    with pytest.raises(Account.DoesNotExist):
        Account.objects.using(db).filter(balance__gt=100).claim(99, pk=account.pk)
    with pytest.raises(Account.DoesNotExist):
        Account.objects.using(db).none().claim(99, pk=account.pk)
    assert Account.objects.using(db).filter(balance=1).claim(lease.token + 10, id=account.pk).pk == account.pk
    twins = [Account.objects.using(db).create(name="twin") for _ in range(2)]
    with pytest.raises(Account.MultipleObjectsReturned):
        Account.objects.using(db).claim(5, name="twin")
    assert [stored(db, twin).fencing_token for twin in twins] == [0, 0], "a refused claim changes nothing"
    assert Account.objects.using(db).claim(5, name="twin", pk=twins[0].pk).fencing_token == 5


def test_claim_refusals(db, recorded, lock_name):
    check_claim_refusals(db, recorded, lock_name)


def test_claim_where_update_returning_is_missing(db, recorded, lock_name, monkeypatch):
    """Databases without UPDATE … RETURNING claim by locking the row in a transaction; same results."""
    monkeypatch.setattr(statements, "updates_return_rows", lambda connection: False)
    account = Account.objects.using(db).create(balance=7)
    with CaptureQueriesContext(connections[db]) as queries:
        claimed = Account.objects.using(db).claim(40, pk=account.pk)
    assert (claimed.balance, claimed.fencing_token, stored(db, account).fencing_token) == (7, 40, 40)
    assert not any("RETURNING" in q["sql"] for q in queries)
    if connections[db].vendor == "postgresql":
        assert any(q["sql"].endswith("FOR UPDATE") for q in queries)
    check_claim_refusals(db, recorded, lock_name)


def test_read_modify_write_needs_claim(db):
    """Write-side checks alone lose an update; claiming before reading refuses the older writer instead."""
    account = Account.objects.using(db).create(balance=100)
    first, second = stored(db, account), stored(db, account)  # both read 100
    first.balance += 1
    first.save(fencing_token=33)
    second.balance += 1
    second.save(fencing_token=34)  # accepted: 34 >= 33
    assert stored(db, account).balance == 101, "two accepted increments, one lost: the gap claim() closes"

    first = Account.objects.using(db).claim(35, pk=account.pk)
    second = Account.objects.using(db).claim(36, pk=account.pk)
    assert first.balance == second.balance == 101
    first.balance += 1
    with pytest.raises(distlock.StaleFencingToken):
        first.save(fencing_token=35)
    second.balance += 1
    second.save(fencing_token=36)
    assert stored(db, account).balance == 102, "one accepted increment, nothing lost"


# -- fenced_update -----------------------------------------------------------------------------------

def test_fenced_update_skips_and_records_stale_rows(db, recorded, lock_name):
    with distlock.lock(lock_name, ttl=30, using="locmem") as lease:
        rows = [Account.objects.using(db).create(name="bulk", balance=i) for i in range(3)]
        Account.objects.using(db).claim(lease.token + 40, pk=rows[1].pk)
        Account.objects.using(db).claim(lease.token, pk=rows[2].pk)
        updated = Account.objects.using(db).filter(name="bulk").fenced_update(lease, balance=F("balance") + 100)
        assert updated == 2
        assert [(stored(db, r).balance, stored(db, r).fencing_token) for r in rows] == [
            (100, lease.token), (1, lease.token + 40), (102, lease.token)]
        assert [(r.offered_token, r.current_token, r.lock_name) for r in rejections(db, rows[1])] == [
            (lease.token, lease.token + 40, lease.name)]
        assert rejections(db, rows[0]) == rejections(db, rows[2]) == []
        assert recorded["metrics"] == [("locmem", lease.name)]
        assert [(s["pk"], s["current_token"]) for s in recorded["signals"]] == [(rows[1].pk, lease.token + 40)]

    assert Account.objects.using(db).filter(name="bulk").fenced_update(lease.token + 40, note="all") == 3
    assert Account.objects.using(db).filter(name="nothing").fenced_update(1, note="none") == 0


# -- no path of distlock lowers a token ----------------------------------------------------------------

def claim_by_pk(db, account, lease_or_token, monkeypatch):
    Account.objects.using(db).claim(lease_or_token, pk=account.pk)


def claim_by_lookup(db, account, lease_or_token, monkeypatch):
    Account.objects.using(db).filter(balance__gte=0).claim(lease_or_token, name=account.name)


def claim_without_returning(db, account, lease_or_token, monkeypatch):
    monkeypatch.setattr(statements, "updates_return_rows", lambda connection: False)
    Account.objects.using(db).claim(lease_or_token, pk=account.pk)


def save_with(db, account, lease_or_token, monkeypatch):
    account.balance = 99
    if isinstance(lease_or_token, int):
        account.save(fencing_token=lease_or_token)
    else:
        account.save(lease=lease_or_token)


def fenced_update_with(db, account, lease_or_token, monkeypatch):
    assert Account.objects.using(db).filter(pk=account.pk).fenced_update(lease_or_token, balance=99) == 0


WRITE_PATHS = {"claim by pk": claim_by_pk, "claim by lookup": claim_by_lookup,
               "claim without RETURNING": claim_without_returning, "save": save_with,
               "fenced_update": fenced_update_with}


@pytest.mark.parametrize("carried", ["lease", "token"])
@pytest.mark.parametrize("path", list(WRITE_PATHS))
def test_a_lower_token_never_lands(db, lock_name, monkeypatch, path, carried):
    """Every write path of distlock, given a token below the row's: refused and logged, the row unchanged."""
    with distlock.lock(lock_name, ttl=30, using="locmem") as older:
        account = Account.objects.using(db).create(name=f"lower:{lock_name}", balance=1)
        Account.objects.using(db).claim(older.token + 1, pk=account.pk)
        try:
            WRITE_PATHS[path](db, stored(db, account), older if carried == "lease" else older.token, monkeypatch)
        except distlock.StaleFencingToken:
            pass
    row = stored(db, account)
    assert (row.balance, row.fencing_token) == (1, older.token + 1)
    assert [(r.offered_token, r.current_token) for r in rejections(db, account)] == [(older.token, older.token + 1)]


def test_claim_without_returning_never_lowers_a_token_raised_after_its_read(db, monkeypatch):
    """The locking claim's UPDATE keeps its own condition, for databases where the row lock does not hold.

    Stand-in for a writer that slips in between the claim's SELECT and its UPDATE (SQLite ignores
    select_for_update()): the token is raised to 50 on the claim's own connection right after the SELECT.
    """
    monkeypatch.setattr(statements, "updates_return_rows", lambda connection: False)
    account = Account.objects.using(db).create(balance=1)
    table = connections[db].ops.quote_name(Account._meta.db_table)
    raised = []

    def raise_after_the_read(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if sql.startswith("SELECT") and table in sql and not raised:
            raised.append(sql)
            with connections[db].cursor() as cursor:  # the same connection, hence the same transaction
                cursor.execute(f"UPDATE {table} SET fencing_token = 50 WHERE id = %s", [account.pk])
        return result

    with connections[db].execute_wrapper(raise_after_the_read):
        with pytest.raises(distlock.StaleFencingToken) as caught:
            Account.objects.using(db).claim(40, pk=account.pk)
    assert raised, "the claim did not read the row first: the scenario did not happen"
    assert (caught.value.offered_token, caught.value.current_token) == (40, 50)
    assert stored(db, account).fencing_token == 50


# -- claim() and the caller's transaction ----------------------------------------------------------------

def test_claim_refuses_to_run_inside_a_transaction(db):
    """A claim rolled back with its transaction would hand the row back to the older holder: refused up front."""
    account = Account.objects.using(db).create(balance=1)
    Account.objects.using(db).claim(33, pk=account.pk)  # A, the older holder
    refused = r"fencing_app\.Account: claim\(\) refuses to run inside an open transaction on database '%s'.*" \
              r"before transaction\.atomic\(\).*claim_in_transaction\(\)" % db
    with transaction.atomic(using=db):
        with CaptureQueriesContext(connections[db]) as queries:
            with pytest.raises(TransactionManagementError, match=refused):
                Account.objects.using(db).claim(34, pk=account.pk)
            with transaction.atomic(using=db):  # a savepoint is a transaction too
                with pytest.raises(TransactionManagementError, match=refused):
                    Account.objects.using(db).filter(balance=1).claim(34, pk=account.pk)
        touched = [q["sql"] for q in queries if "SAVEPOINT" not in q["sql"]]  # the test's own savepoint aside
        assert touched == []
    transaction.set_autocommit(False, using=db)
    try:
        with pytest.raises(TransactionManagementError, match=refused):
            Account.objects.using(db).claim(34, pk=account.pk)
    finally:
        transaction.rollback(using=db)
        transaction.set_autocommit(True, using=db)
    assert stored(db, account).fencing_token == 33


def test_claim_before_the_transaction_survives_its_rollback(db):
    """The fix the refusal names: claim first (committed at once), then write in a transaction; a rollback
    of the writes keeps the fence."""

    class Rollback(Exception):
        pass

    account = Account.objects.using(db).create(balance=1)
    stale = stored(db, account)  # A's copy, read under token 33
    Account.objects.using(db).claim(33, pk=account.pk)
    claimed = Account.objects.using(db).claim(34, pk=account.pk)  # B
    with pytest.raises(Rollback):
        with transaction.atomic(using=db):
            claimed.balance = 2
            claimed.save(fencing_token=34)
            raise Rollback
    stale.balance = 3
    with pytest.raises(distlock.StaleFencingToken):
        stale.save(fencing_token=33)
    row = stored(db, account)
    assert (row.balance, row.fencing_token) == (1, 34)


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_claim_in_transaction_commits_or_rolls_back_with_it(db, outcome):
    """The explicit opt-in: the claim is part of the caller's transaction, rollback included."""

    class Rollback(Exception):
        pass

    account = Account.objects.using(db).create(balance=1)
    Account.objects.using(db).claim(33, pk=account.pk)
    try:
        with transaction.atomic(using=db):
            claimed = Account.objects.using(db).claim_in_transaction(34, pk=account.pk)
            assert claimed.fencing_token == 34
            if outcome == "rollback":
                raise Rollback
    except Rollback:
        pass
    stale = stored(db, account)
    stale.balance = 3
    if outcome == "commit":
        with pytest.raises(distlock.StaleFencingToken):
            stale.save(fencing_token=33)
        assert stored(db, account).fencing_token == 34
    else:  # what claim_in_transaction() accepts: the claim is void, the older holder writes again
        stale.save(fencing_token=33)
        assert (stored(db, account).balance, stored(db, account).fencing_token) == (3, 33)


# -- every ORM write path of a fenced model --------------------------------------------------------------

def fenced_row(db, token=34, **fields):
    account = Account.objects.using(db).create(balance=1, **fields)
    account.save(fencing_token=token)
    return account


def test_update_refuses_to_set_the_token_unless_unfenced(db):
    account = fenced_row(db)
    refused = r"fencing_app\.Account: update\(\) would set fencing_token .*fenced_update\(lease.*" \
              r"Account\.objects\.unfenced\(\)\.update\(\.\.\.\)"
    rows = Account.objects.using(db).filter(pk=account.pk)
    for lowered in ({"fencing_token": 1}, {"fencing_token": F("fencing_token") - 30},
                    {"balance": 5, "fencing_token": 0}):
        with pytest.raises(ValueError, match=refused):
            rows.update(**lowered)
    with pytest.raises(ValueError, match=refused):
        Account.objects.using(db).update(fencing_token=1)  # through the manager
    with pytest.raises(ValueError, match=r"fencing_app\.SavingsAccount: update\(\)"):
        SavingsAccount.objects.using(db).update(fencing_token=1)  # the token in the parent's table
    assert (stored(db, account).balance, stored(db, account).fencing_token) == (1, 34)
    stale = stored(db, account)
    with pytest.raises(distlock.StaleFencingToken):
        stale.save(fencing_token=33)

    assert rows.update(note="other columns are not fenced") == 1
    assert stored(db, account).fencing_token == 34
    # Asked for explicitly; the opt-in survives chaining and stays on that queryset only.
    assert Account.objects.using(db).unfenced().filter(pk=account.pk).update(fencing_token=1) == 1
    with pytest.raises(ValueError, match=refused):
        rows.update(fencing_token=2)
    assert stored(db, account).fencing_token == 1
    stale.save(fencing_token=33)  # what the opt-in risks: the older token is accepted again


def test_bulk_update_refuses_to_set_the_token_unless_unfenced(db):
    accounts = [fenced_row(db), fenced_row(db)]
    copies = [stored(db, account) for account in accounts]
    for copy in copies:
        copy.balance, copy.fencing_token = 7, 1
    with pytest.raises(ValueError, match=r"fencing_app\.Account: bulk_update\(\) would set fencing_token .*"
                                         r"Account\.objects\.unfenced\(\)\.bulk_update\(\.\.\.\)"):
        Account.objects.using(db).bulk_update(copies, ["balance", "fencing_token"])
    assert [(stored(db, a).balance, stored(db, a).fencing_token) for a in accounts] == [(1, 34), (1, 34)]

    assert Account.objects.using(db).bulk_update(copies, ["balance"]) == 2
    assert [(stored(db, a).balance, stored(db, a).fencing_token) for a in accounts] == [(7, 34), (7, 34)]
    assert Account.objects.using(db).unfenced().bulk_update(copies, ["fencing_token"]) == 2
    assert [stored(db, a).fencing_token for a in accounts] == [1, 1]


def test_bulk_create_update_conflicts_refuses_to_set_the_token_unless_unfenced(db):
    account = fenced_row(db)

    def upsert(queryset, update_fields):
        return queryset.bulk_create([Account(pk=account.pk, balance=7, fencing_token=1)], update_conflicts=True,
                                    unique_fields=["id"], update_fields=update_fields)

    with pytest.raises(ValueError, match=r"fencing_app\.Account: bulk_create\(update_conflicts=True\) would set "
                                         r"fencing_token .*Account\.objects\.unfenced\(\)\.bulk_create\(\.\.\.\)"):
        upsert(Account.objects.using(db), ["balance", "fencing_token"])
    assert (stored(db, account).balance, stored(db, account).fencing_token) == (1, 34)

    upsert(Account.objects.using(db), ["balance"])
    assert (stored(db, account).balance, stored(db, account).fencing_token) == (7, 34)
    upsert(Account.objects.using(db).unfenced(), ["fencing_token"])
    assert stored(db, account).fencing_token == 1
    # Plain inserts store the token given, as create() does.
    (inserted,) = Account.objects.using(db).bulk_create([Account(balance=1, fencing_token=5)])
    assert stored(db, inserted).fencing_token == 5


def test_update_or_create_on_a_fenced_model(db):
    """The update branch is a plain save(): refused where fencing is required, and it never writes the token."""
    account = fenced_row(db, name="upsert")
    with pytest.raises(ValueError, match=r"save\(lease=lease\)"):
        Account.objects.using(db).update_or_create(name="upsert", defaults={"balance": 5})
    assert (stored(db, account).balance, stored(db, account).fencing_token) == (1, 34)
    created, was_created = Account.objects.using(db).update_or_create(name="new", defaults={"balance": 5})
    assert was_created and stored(db, created).fencing_token == 0

    loose = LooseAccount.objects.using(db).create(balance=1)
    loose.save(fencing_token=34)
    LooseAccount.objects.using(db).update_or_create(pk=loose.pk, defaults={"balance": 5, "fencing_token": 1})
    row = LooseAccount.objects.using(db).get(pk=loose.pk)
    assert (row.balance, row.fencing_token) == (5, 34)


def test_delete_is_not_fenced_unless_filtered_by_token(db):
    """delete() writes no token, so it cannot lower one; to refuse a stale holder's delete, filter on the token."""
    account = fenced_row(db)
    assert Account.objects.using(db).filter(pk=account.pk, fencing_token__lte=33).delete()[0] == 0
    assert Account.objects.using(db).filter(pk=account.pk).exists()
    assert Account.objects.using(db).filter(pk=account.pk, fencing_token__lte=34).delete()[0] == 1
    other = fenced_row(db)
    Account.objects.using(db).filter(pk=other.pk).delete()  # unfenced: any caller may delete
    assert not Account.objects.using(db).filter(pk=other.pk).exists()


# -- the rejection log and the caller's transaction -----------------------------------------------------

@pytest.mark.parametrize("outcome", ["rollback", "commit"])
def test_rejection_log_outlives_the_callers_transaction(db, outcome):
    """PostgreSQL: written at once on a connection of its own. SQLite: written once the transaction ends."""

    class Rollback(Exception):
        pass

    account = Account.objects.using(db).create(balance=1)
    stored(db, account).save(fencing_token=34)
    account.balance = 2

    def logged_elsewhere():
        return in_another_thread(lambda: len(rejections(db, account)))

    try:
        with transaction.atomic(using=db):
            Account.objects.using(db).create(name="inside the transaction")
            with pytest.raises(distlock.StaleFencingToken):
                with transaction.atomic(using=db):  # a savepoint: the refusal rolls back only this
                    account.save(fencing_token=33)
            # While the transaction is open, other connections see the log row only on PostgreSQL.
            assert logged_elsewhere() == (0 if connections[db].vendor == "sqlite" else 1)
            if outcome == "rollback":
                raise Rollback
    except Rollback:
        pass
    assert Account.objects.using(db).filter(name="inside the transaction").exists() == (outcome == "commit")
    assert eventually(lambda: len(rejections(db, account)) == 1), "the rejection was not logged"
    (logged,) = rejections(db, account)
    assert (logged.offered_token, logged.current_token) == (33, 34)


def test_sqlite_log_waits_out_a_transaction_longer_than_the_busy_timeout(monkeypatch):
    account = Account.objects.using("default").create(balance=1)  # the test's connection exists from here
    stored("default", account).save(fencing_token=34)
    # New connections (the helper thread's) give up waiting after 0.1 s; it must retry until the end.
    monkeypatch.setitem(connections.settings["default"]["OPTIONS"], "timeout", 0.1)
    with transaction.atomic(using="default"):
        with pytest.raises(distlock.StaleFencingToken):
            with transaction.atomic(using="default"):
                account.save(fencing_token=33)
        time.sleep(1.0)
        assert in_another_thread(lambda: len(rejections("default", account))) == 0
    assert eventually(lambda: len(rejections("default", account)) == 1), "the rejection was not logged"


# -- real processes and real lock servers -------------------------------------------------------------

def pause(worker):
    os.kill(worker.pid, signal.SIGSTOP)


def resume(worker):
    os.kill(worker.pid, signal.SIGCONT)


def writes_of(events):
    return [event for event in events if event.get("event") == "write"]


@pytest.mark.slow
@pytest.mark.parametrize(("lock_alias", "db"), ALL_PAIRS, indirect=True)
def test_paused_holder_is_refused_by_the_store(lock_alias, db, lock_name):
    """A claims, is paused past its ttl; B takes the lock, claims, writes, releases; A wakes up and writes."""
    account = Account.objects.using(db).create(balance=100)
    common = dict(lock_alias=lock_alias, db=db, name=lock_name, pk=account.pk, env=SHORT_SESSIONS)
    holder_a = Worker("fenced_increment", **common, ttl=2, wait=True, writes=["token", "lease"], note="A")
    try:
        a_claimed = holder_a.next_event()
        pause(holder_a)
        try:
            b_events = Worker("fenced_increment", **common, ttl=30, wait=False, writes=["lease"], note="B").finish()
        finally:
            resume(holder_a)
        holder_a.go()
        a_events = holder_a.finish()
    finally:
        holder_a.kill()

    b_claimed, (b_write,) = b_events[0], writes_of(b_events)
    assert b_claimed["token"] > a_claimed["token"]
    assert b_write["outcome"] == "accepted"
    a_by_token, a_by_lease = writes_of(a_events)
    assert (a_by_token["outcome"], a_by_token["offered"], a_by_token["current"]) == (
        "StaleFencingToken", a_claimed["token"], b_claimed["token"])
    assert a_by_lease["outcome"] in ("LockLost", "StaleFencingToken")

    row = stored(db, account)
    assert (row.note, row.balance, row.fencing_token) == ("B", 101, b_claimed["token"]), "the row holds B's data"
    logged = rejections(db, account)
    stale_raised = sum(write["outcome"] == "StaleFencingToken" for write in writes_of(a_events))
    assert len(logged) == stale_raised == a_events[-1]["signals"]
    assert (logged[0].offered_token, logged[0].current_token) == (a_claimed["token"], b_claimed["token"])
    assert a_events[-1]["released"] is False, "releasing the expired lease reports False and touches nothing"


@pytest.mark.slow
@pytest.mark.parametrize(("lock_alias", "db"), ALL_PAIRS, indirect=True)
def test_read_modify_write_with_claim_loses_no_update(lock_alias, db, lock_name):
    """A claims and reads, is paused; B claims and reads the same value; A writes (refused); B writes."""
    account = Account.objects.using(db).create(balance=100)
    common = dict(lock_alias=lock_alias, db=db, name=lock_name, pk=account.pk, wait=True, env=SHORT_SESSIONS)
    holder_a = Worker("fenced_increment", **common, ttl=2, writes=["token"], note="A")
    holder_b = None
    try:
        a_claimed = holder_a.next_event()
        pause(holder_a)
        try:
            holder_b = Worker("fenced_increment", **common, ttl=60, writes=["lease"], note="B")
            b_claimed = holder_b.next_event(timeout=120)
        finally:
            resume(holder_a)
        holder_a.go()
        a_events = holder_a.finish()
        holder_b.go()
        b_events = holder_b.finish()
    finally:
        holder_a.kill()
        if holder_b is not None:
            holder_b.kill()

    assert a_claimed["balance"] == b_claimed["balance"] == 100, "both read the same value: the lost-update set-up"
    (a_write,), (b_write,) = writes_of(a_events), writes_of(b_events)
    assert (a_write["outcome"], a_write["current"]) == ("StaleFencingToken", b_claimed["token"])
    assert b_write["outcome"] == "accepted"
    accepted = [w for w in (a_write, b_write) if w["outcome"] == "accepted"]
    assert stored(db, account).balance == 100 + len(accepted)
    assert len(rejections(db, account)) == 1


@pytest.mark.slow
@pytest.mark.parametrize(("lock_alias", "db"), SOAK_PAIRS)
def test_many_processes_with_pauses_lose_no_increment(lock_alias, db, lock_name):
    """8 processes x ``SOAK_COUNT`` (100 in long mode) claimed increments, short ttls and random pauses past them."""
    require_alias(lock_alias)
    require_database(db)
    initial = 1000
    account = Account.objects.using(db).create(balance=initial)
    workers = [
        Worker("increment_loop", lock_alias=lock_alias, db=db, name=lock_name, pk=account.pk, count=SOAK_COUNT,
               ttl=0.3, pause_chance=0.02, pause_max=0.9, seed=seed)
        for seed in range(8)
    ]
    try:
        events = [event for worker in workers for event in worker.finish(timeout=900)]
    finally:
        for worker in workers:
            worker.kill()

    claims = [e for e in events if e["op"] == "claim"]
    writes = [e for e in events if e["op"] == "write"]
    assert len(claims) == 8 * SOAK_COUNT and len(writes) == sum(c["outcome"] == "accepted" for c in claims)
    accepted = [e for e in writes if e["outcome"] == "accepted"]
    stale = [e for e in claims + writes if e["outcome"] == "stale"]

    # Each accepted write stored the value its claim read, plus one: values order the commits.
    in_store_order = sorted(accepted, key=lambda e: e["value"])
    assert [e["value"] for e in in_store_order] == list(range(initial + 1, initial + len(accepted) + 1)), \
        "an increment was lost or applied twice"
    tokens = [e["token"] for e in in_store_order]
    assert tokens == sorted(tokens), "an accepted token was lower than one accepted before it"
    row = stored(db, account)
    assert row.balance == initial + len(accepted)
    assert row.fencing_token == max(c["token"] for c in claims if c["outcome"] == "accepted")
    assert len(rejections(db, account)) == len(stale) == sum(e["signals"] for e in events if e["op"] == "done")
    # The ttl means the same on every backend, so a pause past it lets the next process take over.
    assert stale, "pauses past the ttl produced no stale write: the test did not exercise the store"


# -- TOKEN_EPOCH: an alias pointed at another backend --------------------------------------------------

def check_command(alias):
    out = StringIO()
    call_command("distlock", "check", "--using", alias, stdout=out)
    return out.getvalue()


def moving_alias(settings, backend, **options):
    """Point the alias 'moving' at ``backend`` (as a deploy that changes its BACKEND does)."""
    settings.DISTLOCK = {**settings.DISTLOCK, "moving": {"BACKEND": backend, "OPTIONS": options}}
    return "moving"


def test_an_alias_pointed_at_another_backend_writes_again_once_its_token_epoch_is_raised(settings, lock_name):
    """The rows keep the old backend's tokens; the new backend restarts below them, so every write is refused
    and ``distlock check`` says why; ``TOKEN_EPOCH`` puts the new tokens above every old one."""
    require_alias("postgres")
    account = Account.objects.create(balance=1)
    alias = moving_alias(settings, "distlock.backends.locmem.LocMemBackend")  # microsecond tokens: ~2**50
    with distlock.lock(lock_name, ttl=30, using=alias) as lease:
        Account.objects.claim(lease, pk=account.pk)
    old_token = stored("default", account).fencing_token

    # PostgreSQL's token sequence: small tokens.
    alias = moving_alias(settings, "distlock.backends.database.DatabaseBackend", DATABASE="postgres")
    with distlock.lock(lock_name, ttl=30, using=alias) as lease, pytest.raises(distlock.StaleFencingToken) as caught:
        Account.objects.claim(lease, pk=account.pk)
    assert lease.token < old_token and "distlock check" in str(caught.value)
    out = check_command(alias)
    assert re.search(rf"WARNING .*Account rows .* up to {old_token}, .*\['TOKEN_EPOCH'\] to 1 ", out), out

    alias = moving_alias(settings, "distlock.backends.database.DatabaseBackend", DATABASE="postgres", TOKEN_EPOCH=1)
    with distlock.lock(lock_name, ttl=30, using=alias) as lease:
        claimed = Account.objects.claim(lease, pk=account.pk)
        claimed.balance = 2
        claimed.save(lease=lease)
    assert lease.token > old_token and lease.token >> 52 == 1
    assert stored("default", account).balance == 2
    out = check_command(alias)
    assert f"{alias}: ok" in out and "WARNING" not in out, out


def test_token_epoch_is_checked_with_the_other_options(settings):
    from django.core.checks import run_checks

    for backend, epoch, problem in [
        ("distlock.backends.locmem.LocMemBackend", 2**11, "must be between 0 and 2047"),
        ("distlock.backends.locmem.LocMemBackend", -1, "must be between 0 and 2047"),
        ("distlock.backends.locmem.LocMemBackend", "1", "must be int"),
        ("distlock.backends.redlock.RedlockBackend", 1, "issues no safe fencing tokens"),
    ]:
        options = {"TOKEN_EPOCH": epoch}
        if "redlock" in backend:
            options["URLS"] = ["redis://127.0.0.1:1/0", "redis://127.0.0.2:1/0", "redis://127.0.0.3:1/0"]
        moving_alias(settings, backend, **options)
        errors = [error for error in run_checks() if error.id == "distlock.E004" and "'moving'" in error.msg]
        assert errors and problem in errors[0].msg, (backend, epoch, errors)


def test_a_token_beyond_the_epoch_s_room_is_given_back(settings, lock_name):
    """A server token that does not fit below the epoch is no fencing token: the grant is given back."""
    alias = moving_alias(settings, "distlock.backends.locmem.LocMemBackend", TOKEN_EPOCH=3)
    backend = distlock.locks[alias]
    with distlock.lock(lock_name, ttl=30, using=alias) as lease:
        assert lease.token >> 52 == 3
        [info] = [info for info in backend.held_locks() if info.name == lock_name]
        assert info.token == lease.token
    backend._store.last_token = 2**52  # decades ahead of the clock, as a ZooKeeper zxid of a late epoch would be
    with pytest.raises(distlock.BackendUnavailable, match="does not fit below TOKEN_EPOCH 3"):
        distlock.acquire(lock_name, ttl=30, using=alias)
    assert not [info for info in backend.held_locks() if info.name == lock_name]
