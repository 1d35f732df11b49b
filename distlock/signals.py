"""Signals sent by distlock; ``sender`` is always the backend class (or the model class for fencing)."""

import logging

from django.dispatch import Signal

__all__ = ["fencing_token_rejected", "lock_acquired", "lock_lost", "lock_released", "send_robustly", "task_skipped",
           "token_regression"]

logger = logging.getLogger(__name__)

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

#: Sent once per alias and process when its server went back: a grant's token, or a reply's revision, below
#: one it showed this process before (``distlock.backends.token_order``). Arguments: ``alias``, ``reason``.
token_regression = Signal()

#: Sent when ``@single_instance_task`` skips a run because its key is held. Arguments: ``task``, ``key``, ``task_id``.
task_skipped = Signal()


def send_robustly(signal, name, **kwargs):
    """Send ``signal`` (named ``name`` in the log) with ``send_robust``; log each receiver that raised.

    Receivers are user code and run on the caller's thread, a renewal scheduler's or a backend's own
    thread: none of them may stop the others from running, leave a lease half-marked, or kill the
    thread that sends. Exceptions other than ``Exception`` (a time limit, ``KeyboardInterrupt``)
    are not caught by ``send_robust`` and propagate.
    """
    for receiver, result in signal.send_robust(**kwargs):
        if isinstance(result, Exception):
            logger.error("A %s receiver, %s, raised; the other receivers ran and distlock carried on.",
                         name, _receiver_name(receiver), exc_info=result)


def _receiver_name(receiver):
    return getattr(receiver, "__qualname__", None) or repr(receiver)
