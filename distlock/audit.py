"""Force release by an operator, audited: the one road of the admin's release view and ``distlock release``.

Every attempt is logged, whatever its outcome, as a WARNING of the ``distlock.audit`` logger (the
record carries ``alias``, ``lock_name``, ``owner``, ``outcome`` and ``actor`` for structured handlers)
and, when a user is known and ``django.contrib.admin`` is installed, as an admin ``LogEntry``: a
deletion when a lease was released, a change otherwise (the message says why nothing was released).
A ``LogEntry`` needs a user, so the command writes one only with ``--user``; the log record is always
written.
"""

import logging
from dataclasses import dataclass

from django.apps import apps

from distlock import inventory
from distlock.handler import locks
from distlock.redaction import redact

__all__ = [
    "Attempt",
    "ERROR",
    "NOT_HELD",
    "OUTCOMES",
    "OWNER_CHANGED",
    "READ_ERROR",
    "RELEASED",
    "force_release",
    "record",
]

logger = logging.getLogger(__name__)

# django.contrib.admin.models.CHANGE and DELETION: that module cannot be imported without the admin app.
_CHANGE, _DELETION = 2, 3

RELEASED = "released"
NOT_HELD = "not_held"
OWNER_CHANGED = "owner_changed"
READ_ERROR = "read_error"
ERROR = "error"

#: What each outcome means, in the audit trail.
OUTCOMES = {
    RELEASED: "released",
    NOT_HELD: "nothing released: the lock is not held",
    OWNER_CHANGED: "nothing released: the lock is held by another owner",
    READ_ERROR: "nothing released: the lock could not be read",
    ERROR: "outcome unknown: the release failed and may or may not have reached the server",
}


@dataclass
class Attempt:
    """One force release: what was asked, what was found (``info``, a ``LockInfo`` or None), what happened.

    ``owner`` is the owner the operator named, or, if none was named, the one found holding the lock.
    """

    alias: str
    name: str
    owner: str | None
    actor: str
    outcome: str
    info: object = None
    error: str = ""

    @property
    def released(self):
        return self.outcome == RELEASED

    def describe(self):
        """Return the audit text: the lease asked for, the outcome, the holder found and any error."""
        owner = f"owner {self.owner}" if self.owner is not None else "any owner"
        text = f"Force release of lock {self.name!r} on alias '{self.alias}', {owner}: {OUTCOMES[self.outcome]}"
        if self.info is not None:
            info = self.info
            holder = f"host {info.host or '?'}, pid {info.pid if info.pid is not None else '?'}"
            text += f" (held by owner {info.owner}, fencing token {info.token}, {holder})"
        if self.error:
            text += f": {self.error}"
        return f"{text}; by {self.actor}."


def force_release(alias, name, owner=None, *, actor, user=None):
    """Release lock ``name`` on ``alias`` if ``owner`` (None: whoever holds it now) holds it; audit the attempt.

    The release is a compare-and-delete on the owner read just before, so a lock released and acquired
    again meanwhile is left alone. Return the ``Attempt``; backend errors are caught and recorded in it.
    """
    info = None
    try:
        info = inventory.find(alias, name)
        if info is None:
            outcome = NOT_HELD
        elif owner is not None and info.owner != owner:
            outcome = OWNER_CHANGED
        else:
            outcome = RELEASED if locks[alias].release_owned(name, info.owner) else OWNER_CHANGED
    except Exception as exc:  # noqa: BLE001 - recorded in the attempt, reported by the caller
        # A failed read released nothing; a failed release may or may not have reached the server.
        outcome, error = (ERROR if info is not None else READ_ERROR), redact(f"{type(exc).__name__}: {exc}")
    else:
        error = ""
    if owner is None and info is not None:
        owner = info.owner
    attempt = Attempt(alias, name, owner, actor, outcome, info, error)
    record(attempt, user=user)
    return attempt


def record(attempt, *, user=None):
    """Write the attempt to the ``distlock.audit`` logger and, with a user, to the admin's history."""
    logger.warning(
        "%s", attempt.describe(),
        extra={"alias": attempt.alias, "lock_name": attempt.name, "owner": attempt.owner,
               "outcome": attempt.outcome, "actor": attempt.actor},
    )
    if user is None or not apps.is_installed("django.contrib.admin"):
        return
    log_entry = apps.get_model("admin", "LogEntry")
    content_type = apps.get_model("contenttypes", "ContentType").objects.get_for_model(
        apps.get_model("distlock", "Lock"), for_concrete_model=False)
    log_entry.objects.create(
        user_id=user.pk,
        content_type_id=content_type.pk,
        object_id=None,
        object_repr=f"{attempt.name} (alias {attempt.alias})"[:200],
        action_flag=_DELETION if attempt.released else _CHANGE,
        change_message=attempt.describe(),
    )
