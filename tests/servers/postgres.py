"""PostgreSQL for the tests: the machine's server on 127.0.0.1:5432 if it answers, else a private one."""

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


def machine_server_usable(host="127.0.0.1", port=5432):
    """Return True if a server on host:port accepts user postgres with trust auth on database 'test'."""
    if not port_open(port, host):
        return False
    probe = subprocess.run(
        [shutil.which("psql") or "psql", "-h", host, "-p", str(port), "-U", "postgres", "-d", "test", "-w",
         "-Atc", "select 1"], capture_output=True, text=True, timeout=10, check=False,
    )
    return probe.returncode == 0


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
                "-c", "fsync=off", "-c", "max_connections=200"]

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
    """Use the machine's PostgreSQL if it answers on 127.0.0.1:5432 with trust auth, else start a private one."""
    if machine_server_usable():
        return {"DISTLOCK_TEST_PG": "127.0.0.1:5432"}, []
    server = PostgresServer(workdir=f"{tmp}/postgres").start()
    return {"DISTLOCK_TEST_PG": f"127.0.0.1:{server.port}"}, [server]
