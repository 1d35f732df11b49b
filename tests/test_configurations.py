"""Django configurations real projects have: USE_TZ=False, with times still aware UTC inside distlock."""

import json
from datetime import datetime, timedelta, timezone
from io import StringIO

import pytest
from django.core.management import call_command

import distlock
from distlock.handler import locks
from distlock.models import FencingRejection
from tests.conftest import require_alias
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
