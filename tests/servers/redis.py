"""A private redis-server on its own loopback port."""

import shutil

from tests.servers import ManagedProcess, free_port, port_open


class RedisServer(ManagedProcess):
    """redis-server without persistence by default (``--save '' --appendonly no``), like a cache node.

    ``persistent=True`` gives ``appendonly yes`` + ``appendfsync always`` for the fault scenarios
    that compare the two.
    """

    def __init__(self, port=None, *, persistent=False, workdir=None, name=None):
        self.port = port or free_port()
        super().__init__(name or f"redis-{self.port}", workdir)
        self.persistent = persistent

    @property
    def url(self):
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self):
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.persistent else [
            "--save", "", "--appendonly", "no"]
        return [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.workdir),
                "--daemonize", "no", "--protected-mode", "no", *persistence]

    def ready(self):
        return port_open(self.port) and "Ready to accept connections" in self.new_logs()


def start_redis(tmp):
    """The single Redis instance of the contract suite."""
    server = RedisServer(workdir=f"{tmp}/redis").start()
    return {"DISTLOCK_TEST_REDIS_URL": server.url}, [server]


def start_redlock(tmp):
    """Five independent Redis masters for the Redlock backend."""
    servers = [RedisServer(workdir=f"{tmp}/redlock-{i}").start() for i in range(5)]
    return {"DISTLOCK_TEST_REDLOCK_URLS": ",".join(server.url for server in servers)}, servers
