"""Throwaway Django projects, for tests that run ``manage.py`` the way a project using distlock does.

A project is a directory with ``manage.py``, a ``generated`` package holding ``settings.py``, and any
apps the test writes; its commands run in a subprocess that imports distlock (and ``tests``) from this
checkout.
"""

import os
import subprocess
import sys
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg

from tests.workers import ROOT

MANAGE_PY = "import sys\nfrom django.core.management import execute_from_command_line\nexecute_from_command_line(sys.argv)\n"


@dataclass
class GeneratedProject:
    root: Path

    def manage(self, *args, timeout=120):
        """Run ``manage.py *args`` in the project; return the finished process (text output)."""
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": "generated.settings", "PYTHONPATH": f"{self.root}:{ROOT}"}
        return subprocess.run([sys.executable, "manage.py", *args], cwd=self.root, env=env, capture_output=True,
                              text=True, timeout=timeout)


def write_project(root, settings, apps=None):
    """Write a project under ``root`` with ``settings`` (module text) and ``apps`` ({app: {file: text}})."""
    root = Path(root)
    packages = {"generated": {"settings.py": settings}, **(apps or {})}
    for package, files in packages.items():
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
        for name, text in files.items():
            (root / package / name).write_text(text)
    (root / "manage.py").write_text(MANAGE_PY)
    return GeneratedProject(root)


def postgres_address():
    """Return ``(host, port)`` of the test PostgreSQL server that ``python -m tests.servers`` started."""
    host, port = os.environ["DISTLOCK_TEST_PG"].rsplit(":", 1)
    return host, port


def _server_connection():
    host, port = postgres_address()
    return psycopg.connect(host=host, port=port, user="postgres", dbname="postgres", autocommit=True)


@contextmanager
def fresh_postgres_database(prefix):
    """Create an empty database on the test server, yield its name, and drop it (the server is shared)."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with _server_connection() as connection:
        connection.execute(f'CREATE DATABASE "{name}"')
    try:
        yield name
    finally:
        with _server_connection() as connection:
            connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def database_left_behind(name):
    """Return True if the test server still has a database ``name`` (and drop it: the server is shared)."""
    with _server_connection() as connection:
        found = connection.execute("SELECT count(*) FROM pg_database WHERE datname = %s", [name]).fetchone()[0]
        if found:
            connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return bool(found)
