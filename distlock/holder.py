"""Who holds a lock: the random owner id and the host/pid/task id stored beside it for operators."""

import contextvars
import os
import secrets
import socket
from dataclasses import dataclass

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
