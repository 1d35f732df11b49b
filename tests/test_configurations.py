"""Django configurations real projects have: USE_TZ=False, with times still aware UTC inside distlock."""

import json
import uuid
from datetime import datetime, timedelta, timezone
from io import StringIO

import pytest
from django.core import checks
from django.core.management import call_command

import distlock
from distlock.handler import locks
from distlock.models import FencingRejection, Lock
from tests.conftest import require_alias
from tests.generated_project import database_left_behind, postgres_address, write_project
from tests.test_admin import PAGE, lock_row

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


@pytest.fixture(params=["default", "postgres"])
def db_alias(request):
    """The database backend on SQLite (``default``) and on PostgreSQL (``postgres``)."""
    return require_alias(request.param)


@pytest.fixture
def naive_settings(settings):
    """USE_TZ off and a time zone far from UTC, as many older projects run; backends rebuilt under it."""
    settings.USE_TZ = False
    settings.TIME_ZONE = "America/Chicago"
    locks.close_all()
    yield settings
    locks.close_all()


def assert_aware_utc_near_now(value, within=timedelta(minutes=2)):
    assert value.tzinfo is not None, f"{value!r} is naive"
    assert abs(value - datetime.now(timezone.utc)) < within, f"{value!r} is not now in UTC"


def test_without_use_tz_leases_and_listings_are_aware_utc(naive_settings, db_alias, lock_name):
    with distlock.lock(lock_name, ttl=30, using=db_alias) as lease:
        assert_aware_utc_near_now(lease.acquired_at)
        (info,) = locks[db_alias].held_locks(lock_name)
        assert_aware_utc_near_now(info.acquired_at)
        assert_aware_utc_near_now(info.expires_at - timedelta(seconds=30))
        out = StringIO()
        call_command("distlock", "list", "--using", db_alias, "--json", stdout=out)
        (listed,) = [row for row in json.loads(out.getvalue()) if row["name"] == lock_name]
        assert_aware_utc_near_now(datetime.fromisoformat(listed["expires_at"]) - timedelta(seconds=30))


def test_without_use_tz_the_held_locks_page_and_stats_work(naive_settings, admin_client, db_alias, lock_name):
    FencingRejection.objects.create(alias=db_alias, lock_name=lock_name, model_label="tests.Account", object_pk="1",
                                    offered_token=1, current_token=2)
    with distlock.lock(lock_name, ttl=30, using=db_alias):
        response = admin_client.get(PAGE)
        assert response.status_code == 200
        assert lock_row(response.content.decode(), db_alias, lock_name) is not None
    out = StringIO()
    call_command("distlock", "stats", "--using", db_alias, stdout=out)
    assert db_alias in out.getvalue()


class ReadReplicaRouter:
    """Reads of the fenced models go to a replica ("postgres" here), writes to the primary ("default")."""

    def db_for_read(self, model, **hints):
        return "postgres" if model._meta.app_label == "fencing_app" else None

    def db_for_write(self, model, **hints):
        return "default" if model._meta.app_label == "fencing_app" else None


@pytest.fixture
def read_replica_router(settings):
    require_alias("postgres")
    settings.DATABASE_ROUTERS = [f"{__name__}.ReadReplicaRouter"]


def test_claims_and_fenced_updates_go_to_the_primary_under_a_read_replica_router(read_replica_router):
    from tests.fencing_app.models import Account  # noqa: PLC0415

    account = Account.objects.using("default").create(name="primary-only")
    claimed = Account.objects.claim(7, pk=account.pk)  # the row exists on the primary only
    assert claimed.fencing_token == 7
    assert Account.objects.filter(pk=account.pk).fenced_update(8, note="updated") == 1
    stored = Account.objects.using("default").get(pk=account.pk)
    assert (stored.fencing_token, stored.note) == (8, "updated")
    assert not Account.objects.using("postgres").filter(name="primary-only").exists()


class LocksDatabaseRouter:
    """Keeps the distlock app's own models (lock rows, rejections, metrics) on the "locks" database."""

    def db_for_read(self, model, **hints):
        return "locks" if model._meta.app_label == "distlock" else None

    db_for_write = db_for_read


def test_with_distlock_routed_to_its_own_database_rejections_land_and_show_there(settings, admin_client):
    from distlock.metrics import conf, report  # noqa: PLC0415
    from tests.fencing_app.models import Account  # noqa: PLC0415

    settings.DATABASE_ROUTERS = [f"{__name__}.LocksDatabaseRouter"]
    assert conf.get().database == "locks"
    account = Account.objects.create(name="routed")
    Account.objects.claim(5, pk=account.pk)
    account.balance = 1
    with pytest.raises(distlock.StaleFencingToken):
        account.save(fencing_token=3)
    assert FencingRejection.objects.using("locks").count() == 1
    assert not FencingRejection.objects.using("default").exists()
    assert sum(row.fencing_rejections for row in report.summarize(None).rows if row.prefix == "") == 1
    out = StringIO()
    call_command("distlock", "stats", stdout=out)
    assert admin_client.get(PAGE).status_code == 200


def test_with_distlock_routed_to_its_own_database_lock_rows_land_there_unless_database_says_otherwise(
        settings, lock_name):
    """An alias without ``DATABASE`` keeps its lock rows where the routers write ``Lock`` (was: always on
    "default"); an explicit ``DATABASE`` still wins; a router naming no database is a system check error
    (the metrics' one crashed the checks with a KeyError)."""
    settings.DATABASE_ROUTERS = [f"{__name__}.LocksDatabaseRouter"]
    settings.DISTLOCK = {**settings.DISTLOCK,
                         "routed": {"BACKEND": "distlock.backends.database.DatabaseBackend"},
                         "pinned": {"BACKEND": "distlock.backends.database.DatabaseBackend",
                                    "OPTIONS": {"DATABASE": "default"}}}
    with distlock.lock(lock_name, using="routed"):
        assert Lock.objects.using("locks").filter(name=lock_name).exists()
        assert not Lock.objects.using("default").filter(name=lock_name).exists()
    with distlock.lock(f"{lock_name}:pinned", using="pinned"):
        assert Lock.objects.using("default").filter(name=f"{lock_name}:pinned").exists()
    settings.DATABASE_ROUTERS = [f"{__name__}.UnknownDatabaseRouter"]
    found = checks.run_checks()
    errors = [error.msg for error in found if error.id == "distlock.E004" and "'routed'" in error.msg]
    assert errors and "the database routers give for writing distlock's Lock is 'nowhere'" in errors[0], errors
    assert [error for error in found if error.id == "distlock.E006" and "MetricSample is 'nowhere'" in error.msg]


class UnknownDatabaseRouter:
    def db_for_write(self, model, **hints):
        return "nowhere" if model._meta.app_label == "distlock" else None


GENERATED_SETTINGS = """
SECRET_KEY = "generated"
USE_TZ = True
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "distlock", "lockuser"]
DATABASES = {{"default": {{"ENGINE": "django.db.backends.postgresql", "HOST": "{host}", "PORT": "{port}",
                         "USER": "postgres", "NAME": "{name}", "TEST": {{"NAME": "test_{name}"}}}}}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
"""

GENERATED_TESTS = """
import threading

from django.test import TransactionTestCase

import distlock


class LockTests(TransactionTestCase):
    def test_locks_from_two_threads(self):
        with distlock.lock("generated:one", ttl=10):
            pass
        thread = threading.Thread(target=lambda: distlock.acquire("generated:two", ttl=10).release())
        thread.start()
        thread.join()
"""


@pytest.mark.slow
def test_manage_py_test_on_postgresql_exits_0_and_drops_its_database(tmp_path):
    """A project whose tests take database locks on PostgreSQL: the test database is dropped at the end."""
    require_alias("postgres")
    host, port = postgres_address()
    name = f"generated_{uuid.uuid4().hex[:8]}"
    project = write_project(tmp_path, GENERATED_SETTINGS.format(host=host, port=port, name=name),
                            apps={"lockuser": {"tests.py": GENERATED_TESTS}})
    process = project.manage("test", "--noinput", "lockuser")
    left_behind = database_left_behind(f"test_{name}")
    assert process.returncode == 0, process.stderr[-3000:]
    assert not left_behind, "the test database was left behind"
