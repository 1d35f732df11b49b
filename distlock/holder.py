"""Who holds a lock: the random owner id and the host/pid/task id stored beside it for operators."""

import contextvars
import json
import os
import secrets
import socket
from dataclasses import dataclass
from json.encoder import encode_basestring

__all__ = ["Holder", "current_holder", "current_task_id", "holder_record", "new_owner", "read_holder_record"]

#: The Celery task id of the run in progress, set by ``distlock.celery`` so lock records name their task.
current_task_id = contextvars.ContextVar("distlock_current_task_id", default="")


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    task_id: str


def new_owner():
    """Return an unguessable owner id: release and extend compare it, so nobody can forge it."""
    return secrets.token_hex(16)


def current_holder():
    """Return the host, pid and Celery task id of the caller."""
    return Holder(host=socket.gethostname(), pid=os.getpid(), task_id=current_task_id.get())


#: ((pid, task id), the holder's JSON members) of the last ``holder_record()`` call: encoded again, with
#: the host name, only when the process (a fork) or the Celery task changes.
_encoded_holder = (None, "")


def holder_record(**fields):
    """Return the JSON object of ``fields`` (str values) and the caller's host, pid and Celery task id.

    The record backends store beside a lock, written on every acquisition: the holder's part is
    encoded once per holder, the call's own fields (owner id, time) each time.
    """
    global _encoded_holder  # noqa: PLW0603 - a one-entry cache; replacing the tuple is atomic
    holder = (os.getpid(), current_task_id.get())
    cached, encoded = _encoded_holder
    if cached != holder:
        pid, task_id = holder
        encoded = json.dumps({"host": socket.gethostname(), "pid": pid, "task_id": task_id})[1:-1]
        _encoded_holder = (holder, encoded)
    members = [f"{encode_basestring(name)}: {encode_basestring(value)}" for name, value in fields.items()]
    return "{" + ", ".join([*members, encoded]) + "}"


#: What ``read_holder_record`` gives for a member a record lacks.
_MISSING_MEMBERS = {"owner": "", "host": "", "pid": None, "task_id": ""}


def read_holder_record(data):
    """Return the members of a ``holder_record()`` (bytes or str) as a dict; missing ones as empty.

    A record that is not JSON (written by hand or by another program) reads as empty: listing the
    locks must not fail on it.
    """
    try:
        record = json.loads(data)
    except (TypeError, ValueError):
        record = None
    return {**_MISSING_MEMBERS, **record} if isinstance(record, dict) else dict(_MISSING_MEMBERS)
