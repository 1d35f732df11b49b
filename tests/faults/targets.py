"""The backends under test and the ``DISTLOCK`` entries that point a scenario's clients at them.

Scenarios that disturb only client processes (pause, crash, contention, clock, slow network) use
the shared servers ``python -m tests.servers`` started; scenarios that break a server build their
entries from servers of their own (``tests/faults/conftest.py``). Session timeouts are short (3 s)
so that a dead holder is freed within seconds, as a ttl of 2 s frees it on the other backends.
"""

import os
import uuid
from dataclasses import dataclass

import pytest

#: ZooKeeper session / etcd session-lease timeout of the scenarios, seconds.
SESSION_TIMEOUT = 3


@dataclass(frozen=True)
class Target:
    """One backend: its name in the report, the server kind it needs, and how to configure an alias on it."""

    key: str
    label: str
    #: The ``tests.servers`` kind whose shared instance the non-destructive scenarios use.
    server: str
    backend: str

    def options(self, **address):
        """Return the ``OPTIONS`` of an alias on the server at ``address``, in a namespace of its own."""
        unique = uuid.uuid4().hex[:8]
        if self.key == "database":
            return {"DATABASE": address["database"]}
        if self.key == "redis":
            return {"URL": address["url"], "KEY_PREFIX": f"faults-{unique}"}
        if self.key == "redlock":
            return {"URLS": list(address["urls"]), "KEY_PREFIX": f"faults-{unique}"}
        if self.key == "zookeeper":
            return {"HOSTS": address["hosts"], "KEY_PREFIX": f"/faults-{unique}", "SESSION_TIMEOUT": SESSION_TIMEOUT}
        return {"ENDPOINTS": address["endpoints"], "KEY_PREFIX": f"/faults-{unique}/", "LEASE_TTL": SESSION_TIMEOUT}

    def entry(self, **address):
        return {"BACKEND": self.backend, "OPTIONS": self.options(**address)}

    def shared_entry(self):
        """The entry on the shared server, or skip (fail under ``make test``) when it was not started."""
        address = shared_address(self.server)
        if address is None:
            if self.server in os.environ.get("DISTLOCK_TEST_REQUIRE", "").split(","):
                pytest.fail(f"the {self.server} server was started but its address is missing")
            pytest.skip(f"{self.label} needs a {self.server} server; run the suite with `make test`")
        return self.entry(**address)


TARGETS = {
    target.key: target for target in [
        Target("database", "database (PostgreSQL)", "postgres", "distlock.backends.database.DatabaseBackend"),
        Target("redis", "Redis", "redis", "distlock.backends.redis.RedisBackend"),
        Target("redlock", "Redlock", "redlock", "distlock.backends.redlock.RedlockBackend"),
        Target("zookeeper", "ZooKeeper", "zookeeper", "distlock.backends.zookeeper.ZooKeeperBackend"),
        Target("etcd", "etcd", "etcd", "distlock.backends.etcd.EtcdBackend"),
    ]
}


def shared_address(server):
    """Return the address of the shared ``server`` from the environment ``python -m tests.servers`` set, or None."""
    if server == "postgres":
        return {"database": "postgres"} if os.environ.get("DISTLOCK_TEST_PG") else None
    if server == "redis":
        url = os.environ.get("DISTLOCK_TEST_REDIS_URL")
        return {"url": url} if url else None
    if server == "redlock":
        urls = os.environ.get("DISTLOCK_TEST_REDLOCK_URLS")
        return {"urls": urls.split(",")} if urls else None
    if server == "zookeeper":
        hosts = os.environ.get("DISTLOCK_TEST_ZK_HOSTS")
        return {"hosts": hosts} if hosts else None
    endpoints = os.environ.get("DISTLOCK_TEST_ETCD_ENDPOINTS")
    return {"endpoints": endpoints} if endpoints else None
