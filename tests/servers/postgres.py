"""PostgreSQL for the tests and benches: a private cluster of their own, never the machine's server.

The machine's server syncs every commit to disk and is shared with whatever else runs there: a
checkpoint forced by another process's ``CREATE DATABASE``, or a bench's 10,000-row updates, can
stall the suite's statements past their 1 s bound. A private cluster that never syncs (its data is
thrown away) answers in the time the tests assume, and empties its tables faster after each test.
"""

import glob
import os
import pwd
import shutil
import subprocess

from tests.servers import ManagedProcess, free_port, port_open


def pg_bin(tool):
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{tool}"))
    if not found:
        raise FileNotFoundError(f"{tool} not found; install the Debian package 'postgresql'")
    return found[-1]


class PostgresServer(ManagedProcess):
    """A private PostgreSQL cluster (initdb) run as the ``postgres`` user, trust auth on loopback."""

    def __init__(self, port=None, workdir=None):
        self.port = port or free_port()
        super().__init__(f"postgres-{self.port}", workdir)
        self.datadir = self.workdir / "data"

    def popen_kwargs(self):
        # PostgreSQL refuses to run as root; the Debian package creates the postgres user.
        if os.geteuid() != 0:
            return {}
        return {"user": "postgres", "group": "postgres", "extra_groups": []}

    def prepare(self):
        if self.datadir.exists():
            return
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.workdir, user.pw_uid, user.pw_gid)
            self.log_path.touch()
            os.chown(self.log_path, user.pw_uid, user.pw_gid)
        subprocess.run([pg_bin("initdb"), "-D", str(self.datadir), "-U", "postgres",
                        "--auth=trust", "-E", "UTF8"], check=True, capture_output=True, **self.popen_kwargs())

    def command(self):
        return [pg_bin("postgres"), "-D", str(self.datadir), "-p", str(self.port),
                "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={self.workdir}",
                "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
                "-c", "max_connections=200"]

    def ready(self):
        if not port_open(self.port):
            return False
        probe = subprocess.run([shutil.which("psql") or "psql", "-h", "127.0.0.1", "-p", str(self.port),
                                "-U", "postgres", "-d", "postgres", "-Atc", "select 1"],
                               capture_output=True, timeout=10, check=False)
        return probe.returncode == 0

    def start(self):
        super().start()
        subprocess.run([shutil.which("psql") or "psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
                        "-d", "postgres", "-c", "CREATE DATABASE test"], capture_output=True, check=False)
        return self


def start_postgres(tmp):
    """Start a private PostgreSQL cluster under ``tmp``; return its address for the settings and the server."""
    server = PostgresServer(workdir=f"{tmp}/postgres").start()
    return {"DISTLOCK_TEST_PG": f"127.0.0.1:{server.port}"}, [server]
