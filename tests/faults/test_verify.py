"""``manage.py distlock verify``: the conformance run users point at their own aliases."""

import json
import re
import shutil
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.test import override_settings

from distlock.handler import locks
from tests.conftest import long_only, require_alias
from tests.faults.conftest import DATABASES

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=DATABASES)]

SMALL = ["--clients", "3", "--iterations", "4"]


@pytest.fixture
def children_use_test_databases(monkeypatch):
    """verify's client processes inherit this environment: point them at the test databases."""
    monkeypatch.setenv("DISTLOCK_TEST_CHILD", "1")


@pytest.mark.parametrize("alias", ["default", pytest.param("redis", marks=long_only)])
def test_verify_prints_the_table_and_passes_on_a_sound_backend(alias, store_database, children_use_test_databases,
                                                               capsys):
    require_alias(alias)
    call_command("distlock", "verify", "--using", alias, "--database", store_database, *SMALL)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| scenario | backend | runs |")
    cells = [line.strip("| ").split(" | ") for line in lines[2:]]
    assert [row[0] for row in cells] == ["contention", "client pause", "client crash", "bad input"]
    assert {row[1] for row in cells} == {f"{alias} ({type(locks[alias]).__name__})"}
    assert all(row[-1].startswith("ok") for row in cells), lines


@long_only
def test_verify_fails_on_a_backend_whose_tokens_do_not_fence(store_database, children_use_test_databases,
                                                              monkeypatch, capsys):
    """make test's own proof that a broken backend is caught is the soak's (``test_soak``), in half the time."""
    broken = {"BACKEND": "tests.faults.broken.ConstantTokenBackend", "OPTIONS": {"DATABASE": store_database}}
    monkeypatch.setenv("DJANGO_SETTINGS_MODULE", "tests.faults.settings")
    monkeypatch.setenv("DISTLOCK_FAULTS_ALIASES", json.dumps({"broken": broken}))
    with override_settings(DISTLOCK={**settings.DISTLOCK, "broken": broken}):
        with pytest.raises(CommandError, match="violated") as raised:
            call_command("distlock", "verify", "--using", "broken", "--database", store_database, *SMALL)
    assert "issued twice" in str(raised.value)
    assert "**VIOLATION**" in capsys.readouterr().out
    kept = Path(re.search(r"histories kept in (\S+?)\.$", str(raised.value), re.MULTILINE).group(1))
    assert list(kept.glob("*/*.jsonl")), "the histories of a failed run are kept for inspection"
    shutil.rmtree(kept)


def test_verify_refuses_a_process_local_alias():
    with pytest.raises(CommandError, match="LocMemBackend"):
        call_command("distlock", "verify", "--using", "locmem")
