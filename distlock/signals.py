"""Signals sent by distlock; ``sender`` is always the backend class (or the model class for fencing)."""

from django.dispatch import Signal

#: Sent after a lease is acquired. Arguments: ``alias``, ``lease``.
lock_acquired = Signal()

#: Sent after ``lease.release()``. Arguments: ``alias``, ``lease``, ``released`` (False if it was no longer ours).
lock_released = Signal()

#: Sent once when a lease is found lost (failed renewal, expired session, ``max_hold``).
#: Arguments: ``alias``, ``lease``, ``reason``.
lock_lost = Signal()

#: Sent when a fenced write or claim is refused. Arguments: ``model``, ``pk``, ``offered_token``,
#: ``current_token``, ``lock_name``.
fencing_token_rejected = Signal()

#: Sent when ``@single_instance_task`` skips a run because its key is held. Arguments: ``task``, ``key``, ``task_id``.
task_skipped = Signal()
