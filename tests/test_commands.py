"""``manage.py distlock list|release|check|stats`` on real backends, in-process and as a real command line."""

import json
import logging
import subprocess
import sys
import uuid
from datetime import datetime
from io import StringIO

import pytest
from django.contrib.admin.models import CHANGE, DELETION, LogEntry
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command

import distlock
from distlock import inventory
from distlock.metrics import Recorder
from tests.conftest import BACKEND_ALIASES, SHARED_ALIASES, alias_params, require_alias
from tests.servers import free_port
from tests.test_metrics import acquire_n
from tests.workers import ROOT, child_env, read_events, spawn

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


@pytest.fixture(params=alias_params(BACKEND_ALIASES))
def backend_alias(request):
    """Each backend alias in turn (``tests.conftest.backend_alias``), with only the databases it needs; a test
    whose command reads every database (``check``: the fenced rows) says so."""
    return require_alias(request.param)


@pytest.fixture(params=alias_params(SHARED_ALIASES))
def shared_alias(request):
    """Each alias whose locks exclude other processes (``tests.conftest.shared_alias``), with only its databases."""
    return require_alias(request.param)


JSON_FIELDS = {"alias", "name", "owner", "token", "acquired_at", "expires_at", "host", "pid"}


def run(*args):
    """Run the command in this process; return its stdout and stderr."""
    out, err = StringIO(), StringIO()
    call_command("distlock", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def manage(*args):
    """Run ``python -m django distlock ...`` as operators do; return the finished process."""
    return subprocess.run([sys.executable, "-m", "django", "distlock", *args], capture_output=True, text=True,
                          env=child_env(), cwd=ROOT, timeout=120)


@pytest.fixture
def down_alias(settings):
    settings.DISTLOCK = {**settings.DISTLOCK, "down": {
        "BACKEND": "distlock.backends.redis.RedisBackend",
        "OPTIONS": {"URL": f"redis://127.0.0.1:{free_port()}/0", "SOCKET_CONNECT_TIMEOUT": 2}}}
    return "down"


# -- list -----------------------------------------------------------------------------------------


def test_list_json_has_exactly_the_documented_fields(backend_alias, lock_name):
    with distlock.lock(lock_name, ttl=30, using=backend_alias) as lease:
        out, _ = run("list", "--using", backend_alias, "--json")
    [found] = [item for item in json.loads(out) if item["name"] == lock_name]
    assert set(found) == JSON_FIELDS
    assert found["alias"] == backend_alias and found["owner"] == lease.owner and found["token"] == lease.token
    assert isinstance(found["pid"], int) and found["host"]
    assert datetime.fromisoformat(found["acquired_at"]).tzinfo is not None
    assert found["expires_at"] is None or datetime.fromisoformat(found["expires_at"]) > lease.acquired_at


def test_list_shows_a_lock_held_by_another_process(shared_alias, lock_name):
    holder = spawn("hold", alias=shared_alias, name=lock_name, ttl=30)
    try:
        held = json.loads(holder.stdout.readline())
        result = manage("list", "--using", shared_alias, "--json")
        assert result.returncode == 0, result.stderr
        [found] = [item for item in json.loads(result.stdout) if item["name"] == lock_name]
        assert found["owner"] == held["owner"] and found["pid"] == held["pid"] and found["token"] == held["token"]
    finally:
        holder.kill()
        holder.communicate()


def test_list_text_and_an_unreachable_alias(down_alias, lock_name):
    with distlock.lock(lock_name, using="locmem"):
        with pytest.raises(CommandError, match="could not be read: down"):
            run("list")
        out, _ = run("list", "--using", "locmem")
    assert lock_name in out and "token=" in out


def test_list_streams_json_lines_of_a_prefix_page_by_page_up_to_the_limit(lock_name, monkeypatch):
    monkeypatch.setattr(inventory, "PAGE_SIZE", 2)  # five locks come in three pages
    leases = [distlock.acquire(f"{lock_name}:{index}", ttl=30, using="locmem") for index in range(5)]
    other = distlock.acquire(f"{lock_name}-other", ttl=30, using="locmem")
    try:
        out, _ = run("list", "--using", "locmem", "--prefix", f"{lock_name}:", "--json-lines")
        assert [json.loads(line)["name"] for line in out.splitlines()] == [lease.name for lease in leases]
        assert set(json.loads(out.splitlines()[0])) == JSON_FIELDS
        out, _ = run("list", "--using", "locmem", "--prefix", f"{lock_name}:", "--limit", "3")
        assert [line.split("\t")[1] for line in out.splitlines()] == [lease.name for lease in leases[:3]]
        with pytest.raises(CommandError, match="not at least 1"):
            run("list", "--limit", "0")
    finally:
        for lease in [*leases, other]:
            lease.release()


def test_an_unknown_alias_is_named():
    with pytest.raises(CommandError, match="no alias 'nowhere'.*'locmem'"):
        run("list", "--using", "nowhere")


# -- release ----------------------------------------------------------------------------------------


def test_release_without_force_releases_nothing_and_says_why(lock_name):
    with distlock.lock(lock_name, ttl=30, using="locmem") as lease:
        with pytest.raises(CommandError, match="without --force"):
            run("release", lock_name, "--using", "locmem")
        assert lease.extend()


def test_release_without_force_exits_non_zero(shared_alias, lock_name):
    holder = spawn("hold", alias=shared_alias, name=lock_name, ttl=30)
    try:
        holder.stdout.readline()
        result = manage("release", lock_name, "--using", shared_alias)
        assert result.returncode != 0 and "without --force" in result.stderr
        # What the server holds, read in this process (listing from a command line of its own is
        # test_list_shows_a_lock_held_by_another_process): two command lines fewer per alias.
        listed, _ = run("list", "--using", shared_alias, "--json")
        assert lock_name in {item["name"] for item in json.loads(listed)}
        result = manage("release", lock_name, "--using", shared_alias, "--force")
        assert result.returncode == 0, result.stderr
        assert f"Released lock {lock_name!r}" in result.stdout
        listed, _ = run("list", "--using", shared_alias, "--json")
        assert lock_name not in {item["name"] for item in json.loads(listed)}
    finally:
        holder.kill()
        holder.communicate()


def test_release_with_force(backend_alias, lock_name):
    lease = distlock.acquire(lock_name, ttl=30, using=backend_alias)
    out, _ = run("release", lock_name, "--using", backend_alias, "--force")
    assert lease.owner in out and str(lease.token) in out
    assert not lease.extend()
    with pytest.raises(CommandError, match="not held"):
        run("release", lock_name, "--using", backend_alias, "--force")


def test_release_with_a_stale_owner_touches_nothing(lock_name):
    first = distlock.acquire(lock_name, ttl=30, using="locmem")
    first.release()
    with distlock.lock(lock_name, ttl=30, using="locmem") as second:
        with pytest.raises(CommandError, match="now held by owner"):
            run("release", lock_name, "--using", "locmem", "--owner", first.owner, "--force")
        assert second.extend()


def audit_records(caplog):
    return [record for record in caplog.records if record.name == "distlock.audit"]


def test_every_release_attempt_is_audited_with_its_outcome(lock_name, caplog):
    first = distlock.acquire(lock_name, ttl=30, using="locmem")
    first.release()
    with caplog.at_level(logging.WARNING, logger="distlock.audit"):
        with pytest.raises(CommandError, match="not held"):
            run("release", lock_name, "--using", "locmem", "--force")
        second = distlock.acquire(lock_name, ttl=30, using="locmem")
        with pytest.raises(CommandError, match="now held by owner"):
            run("release", lock_name, "--using", "locmem", "--owner", first.owner, "--force")
        assert second.extend()
        run("release", lock_name, "--using", "locmem", "--force")
    assert not second.extend()
    records = audit_records(caplog)
    assert [record.outcome for record in records] == ["not_held", "owner_changed", "released"]
    assert all(record.lock_name == lock_name and record.alias == "locmem" for record in records)
    assert all(record.actor.startswith("manage.py distlock release") for record in records)
    assert records[1].owner == first.owner and records[2].owner == second.owner
    assert second.owner in records[2].getMessage() and "released" in records[2].getMessage()
    assert not LogEntry.objects.exists(), "no LogEntry without --user"


def test_release_with_a_user_writes_a_log_entry_too(lock_name, caplog):
    User.objects.create_user("ops", is_staff=True)
    lease = distlock.acquire(lock_name, ttl=30, using="locmem")
    with caplog.at_level(logging.WARNING, logger="distlock.audit"):
        out, _ = run("release", lock_name, "--using", "locmem", "--force", "--user", "ops")
        with pytest.raises(CommandError, match="not held"):
            run("release", lock_name, "--using", "locmem", "--force", "--user", "ops")
    assert lease.owner in out and not lease.extend()
    released, refused = LogEntry.objects.order_by("pk")
    assert released.action_flag == DELETION and released.user.username == "ops"
    assert lease.owner in released.change_message and "manage.py distlock release" in released.change_message
    assert refused.action_flag == CHANGE and "nothing released" in refused.change_message
    assert [record.actor for record in audit_records(caplog)] == ["manage.py distlock release as user 'ops'"] * 2


def test_release_with_an_unknown_user_releases_nothing(lock_name):
    with distlock.lock(lock_name, ttl=30, using="locmem") as lease:
        with pytest.raises(CommandError, match="no user 'nobody'"):
            run("release", lock_name, "--using", "locmem", "--force", "--user", "nobody")
        assert lease.extend()
    assert not LogEntry.objects.exists()


def test_no_password_of_a_backend_url_shows_in_a_release_attempt(settings, lock_name, caplog):
    secret = f"pw-{uuid.uuid4().hex}"
    settings.DISTLOCK = {**settings.DISTLOCK, "down": {
        "BACKEND": "distlock.backends.redis.RedisBackend",
        "OPTIONS": {"URL": f"redis://ops:{secret}@127.0.0.1:{free_port()}/0", "SOCKET_CONNECT_TIMEOUT": 2}}}
    with caplog.at_level(logging.DEBUG), pytest.raises(CommandError, match="nothing released") as failed:
        run("release", lock_name, "--using", "down", "--force")
    assert secret not in str(failed.value) and "BackendUnavailable" in str(failed.value)
    [record] = audit_records(caplog)
    assert record.outcome == "read_error" and secret not in record.getMessage()
    assert not [record for record in caplog.records if secret in record.getMessage()]


# -- check ------------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True, databases="__all__")
def test_check_reports_the_round_trip_of_each_backend(backend_alias):
    out, _ = run("check", "--using", backend_alias)
    assert out.startswith(f"{backend_alias}: ok ") and " ms (" in out


def test_check_fails_when_a_backend_is_down(down_alias):
    with pytest.raises(CommandError, match="1 backend\\(s\\) failed: down"):
        run("check")


def test_check_as_a_health_probe_exits_non_zero():
    healthy = manage("check", "--using", "locmem")
    assert healthy.returncode == 0 and "locmem: ok" in healthy.stdout
    # A real command line, with an alias pointing at a closed port, as a probe would see it.
    script = (
        "import django, sys; from django.conf import settings; django.setup();"
        f"settings.DISTLOCK['down'] = {{'BACKEND': 'distlock.backends.redis.RedisBackend', "
        f"'OPTIONS': {{'URL': 'redis://127.0.0.1:{free_port()}/0', 'SOCKET_CONNECT_TIMEOUT': 2}}}};"
        "from django.core.management import execute_from_command_line;"
        "execute_from_command_line(['manage.py', 'distlock', 'check', '--using', 'down'])"
    )
    failing = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=child_env(),
                             cwd=ROOT, timeout=120)
    assert failing.returncode == 1 and "down: FAILED" in failing.stdout and "BackendUnavailable" in failing.stdout


# -- stats ------------------------------------------------------------------------------------------


def test_stats_shows_the_figures_of_every_process_with_alerts():
    prefix = f"stats{uuid.uuid4().hex[:8]}"
    recorder = Recorder()
    acquire_n(recorder, "locmem", f"{prefix}:1", 10, result="timeout")  # 100% timeouts and contention
    recorder.flush()
    child = spawn("hammer", alias="locmem", name=f"{prefix}:2", count=5, ttl=10)  # another process, flushed at exit
    read_events(child)
    out, _ = run("stats", "--using", "locmem", "--json")
    figures = json.loads(out)
    [row] = [row for row in figures["recent"] if row["prefix"] == prefix]
    assert row["attempts"] == 15 and row["acquired"] == 5 and row["timeouts"] == 10
    assert row["alerts"] == ["contention_rate", "timeout_rate"]
    assert [row["attempts"] for row in figures["since_start"] if row["prefix"] == prefix] == [15]
    text, _ = run("stats", "--using", "locmem")
    lines = [line for line in text.splitlines() if line.strip().startswith(f"{prefix}:*")]
    assert len(lines) == 2, "one line in the recent window, one since start"
    for line in lines:
        assert "attempts=15" in line and "timeouts=66.7%!" in line and "contention=66.7%!" in line
        assert "hold_p99/ttl=" in line and "hold_p99/ttl=—!" not in line
