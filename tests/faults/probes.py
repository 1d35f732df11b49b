"""Functions a client process runs on request (``probe`` command) to show the parent what it cannot see."""

import time
from datetime import datetime, timezone


def wall_clock(client):
    """Return the client's wall clock as ``time.time()`` and ``datetime.now()`` see it."""
    return {"time": time.time(), "datetime": datetime.now(timezone.utc).timestamp()}


def zookeeper_session(client):
    """Return the ``(session id, password)`` of the client's ZooKeeper session, hex-encoded password."""
    from distlock.handler import locks  # noqa: PLC0415

    session_id, password = locks[client.alias]._session.client.client_id
    return {"session_id": session_id, "password": password.hex()}
