"""The ``distlock`` migrations: reversible without lowering fencing tokens, printable by ``sqlmigrate``,
and checked by ``distlock check``."""

import sqlite3
import subprocess
from contextlib import closing
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connections
from django.db.migrations.loader import MigrationLoader

import distlock
from distlock.handler import locks
from tests.conftest import require_alias
from tests.fencing_app.models import Account
from tests.generated_project import fresh_postgres_database, postgres_address, write_project

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

#: An hour in microseconds: how far a clock stepped back leaves SQLite's token counter ahead of it.
HOUR_IN_MICROSECONDS = 3600 * 10**6

#: The suite's database of each vendor, where ``sqlmigrate`` prints that vendor's SQL.
SUITE_DATABASE = {"sqlite": "default", "postgresql": "postgres"}

PROJECT_SETTINGS = """
SECRET_KEY = "generated"
USE_TZ = True
INSTALLED_APPS = ["distlock"]
DATABASES = {{"default": {database!r}}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
"""

# Run by `manage.py shell -c`: prints the tokens of two locks taken one after the other.
TAKE_TWO_LOCKS = """
import distlock
for _ in range(2):
    with distlock.lock("sql-only-deploy", ttl=10) as lease:
        print(lease.token)
"""


def migrate_distlock(database, *target):
    call_command("migrate", "distlock", *target, database=database, verbosity=0)


def migrate_down_and_up(database, target):
    """``migrate distlock <target>`` then ``migrate distlock``, as an operator rolling back and forth does."""
    try:
        migrate_distlock(database, target)
    finally:
        migrate_distlock(database)  # up again even if down failed: the tests that follow need the tables


def put_sqlite_counter_ahead_of_its_clock(database):
    """Leave the token counter an hour ahead of SQLite's clock, as a clock stepped back an hour does.

    SQLite's tokens never fall below its clock in microseconds, so only a counter ahead of the clock can
    show tokens going down.
    """
    with connections[database].cursor() as cursor:
        cursor.execute("UPDATE distlock_tokensequence SET value = value + %s", [HOUR_IN_MICROSECONDS])
        assert cursor.rowcount == 1


@pytest.mark.parametrize(("alias", "target"), [("default", "zero"), ("postgres", "zero"), ("postgres", "0001")])
def test_migrating_down_and_up_never_lowers_tokens(alias, target, lock_name):
    """A fenced row written under a lease accepts the next lease after ``migrate distlock <target>`` and back."""
    require_alias(alias)
    backend = locks[alias]
    account = Account.objects.using(backend.database).create(name="fenced")
    if backend.vendor == "sqlite":
        distlock.acquire(lock_name, ttl=30, using=alias).release()  # the counter row exists from here on
        put_sqlite_counter_ahead_of_its_clock(backend.database)
    with distlock.lock(lock_name, ttl=30, using=alias) as before:
        Account.objects.using(backend.database).claim(before, pk=account.pk)

    migrate_down_and_up(backend.database, target)

    with distlock.lock(lock_name, ttl=30, using=alias) as after:
        assert after.token > before.token, f"the token went down from {before.token} to {after.token}"
        assert Account.objects.using(backend.database).claim(after, pk=account.pk).fencing_token == after.token


def test_check_names_the_missing_sequence_and_its_migration():
    """PostgreSQL with only 0001 applied has the lock table but no token sequence: every acquire fails."""
    require_alias("postgres")
    database = locks["postgres"].database
    out = StringIO()
    migrate_distlock(database, "0001")
    try:
        with pytest.raises(CommandError, match=r"1 backend\(s\) failed: postgres"):
            call_command("distlock", "check", "--using", "postgres", stdout=out)
    finally:
        migrate_distlock(database)
    report = out.getvalue()
    assert "sequence distlock_token_seq (migration distlock.0002_token_sequence)" in report, report
    assert "table distlock_lock (" not in report, report
    assert f"manage.py migrate distlock --database {database}" in report, report
    call_command("distlock", "check", "--using", "postgres", stdout=StringIO())


@pytest.mark.parametrize("alias", ["default", "postgres"])
def test_check_names_the_missing_waiter_table_and_its_migration(alias, lock_name):
    """With migrations up to 0003 only, the lock table is there but not the waiter queue every acquire reads."""
    require_alias(alias)
    database = locks[alias].database
    out = StringIO()
    migrate_distlock(database, "0003")
    try:
        with pytest.raises(CommandError, match=rf"1 backend\(s\) failed: {alias}"):
            call_command("distlock", "check", "--using", alias, stdout=out)
        with pytest.raises(distlock.BackendUnavailable, match=f"migrate distlock --database {database}"):
            distlock.acquire(lock_name, ttl=30, using=alias)
    finally:
        migrate_distlock(database)
    report = out.getvalue()
    assert "table distlock_lockwaiter (migration distlock.0004_lockwaiter)" in report, report
    assert "table distlock_lock (" not in report, report
    call_command("distlock", "check", "--using", alias, stdout=StringIO())
    distlock.acquire(lock_name, ttl=30, using=alias).release()


@pytest.fixture(params=["sqlite", "postgresql"])
def fresh_database(request, tmp_path):
    """``(vendor, DATABASES entry)`` of an empty database, never migrated; dropped afterwards."""
    if request.param == "sqlite":
        yield "sqlite", {"ENGINE": "django.db.backends.sqlite3", "NAME": str(tmp_path / "fresh.sqlite3")}
        return
    require_alias("postgres")
    host, port = postgres_address()
    with fresh_postgres_database("distlock_migrations") as name:
        yield "postgresql", {"ENGINE": "django.db.backends.postgresql", "HOST": host, "PORT": port,
                             "USER": "postgres", "NAME": name}


@pytest.fixture
def project(tmp_path, fresh_database):
    """A project whose only database is the fresh one, with distlock on its default (database) backend."""
    _vendor, database = fresh_database
    return write_project(tmp_path / "project", PROJECT_SETTINGS.format(database=database))


def sqlmigrate_output(vendor):
    """Return the SQL ``sqlmigrate`` prints for every distlock migration, in order, on ``vendor``."""
    names = sorted(name for app, name in MigrationLoader(None, ignore_no_migrations=True).disk_migrations
                   if app == "distlock")
    printed = []
    for name in names:
        out = StringIO()
        call_command("sqlmigrate", "distlock", name, database=SUITE_DATABASE[vendor], stdout=out)
        assert "CANNOT BE WRITTEN AS SQL" not in out.getvalue(), f"sqlmigrate distlock {name}:\n{out.getvalue()}"
        printed.append(out.getvalue())
    return "\n".join(printed)


def apply_sql(vendor, database, sql):
    """Apply ``sql`` to the database as an operator would: psql, or SQLite's own script runner."""
    if vendor == "sqlite":
        with closing(sqlite3.connect(database["NAME"])) as connection:
            connection.executescript(sql)
        return
    subprocess.run(["psql", "-v", "ON_ERROR_STOP=1", "-q", "-h", database["HOST"], "-p", database["PORT"], "-U",
                    "postgres", "-d", database["NAME"], "-f", "-"], input=sql, text=True, capture_output=True,
                   check=True, timeout=60)


def test_a_database_set_up_from_sqlmigrate_output_takes_locks(fresh_database, project):
    """An SQL-only deploy: the printed SQL of every distlock migration is all the backend needs."""
    vendor, database = fresh_database
    apply_sql(vendor, database, sqlmigrate_output(vendor))

    checked = project.manage("distlock", "check")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    taken = project.manage("shell", "-v", "0", "-c", TAKE_TWO_LOCKS)
    assert taken.returncode == 0, taken.stderr[-3000:]
    first, second = map(int, taken.stdout.split())
    assert 0 < first < second


def test_check_fails_on_an_unmigrated_database_and_passes_once_migrated(fresh_database, project):
    """``SELECT 1`` answers on a database never migrated; the check must name what is missing and the fix."""
    vendor, _database = fresh_database
    unmigrated = project.manage("distlock", "check")
    assert unmigrated.returncode == 1, unmigrated.stdout + unmigrated.stderr
    assert f"default: FAILED DATABASES['default'] ({vendor}) lacks what the database backend needs: " \
           "table distlock_lock (migration distlock.0001_initial)" in unmigrated.stdout, unmigrated.stdout
    if vendor == "postgresql":
        assert "sequence distlock_token_seq (migration distlock.0002_token_sequence)" in unmigrated.stdout
    assert "Run `manage.py migrate distlock --database default`" in unmigrated.stdout, unmigrated.stdout

    migrated = project.manage("migrate", "distlock", "-v", "0")
    assert migrated.returncode == 0, migrated.stderr[-3000:]
    checked = project.manage("distlock", "check")
    assert checked.returncode == 0 and checked.stdout.startswith("default: ok "), checked.stdout + checked.stderr
