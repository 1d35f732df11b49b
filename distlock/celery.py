"""``@single_instance_task``: a Celery task that holds a distlock lease for its whole run.

The lock protocol, in Celery terms:

- **Run lock** ``<key>``: acquired non-blocking in ``SingleInstanceTask.__call__`` (so in the worker
  process or thread that runs the task, in eager mode too), renewed every ``ttl/3`` while the task
  runs, released in ``finally``. A pool child killed mid-run stops renewing, so the server frees the
  lock within ``ttl``; when the kill is ``revoke(terminate=True, signal="SIGKILL")`` (``task_revoked``)
  or the pool child dies on its own (SIGKILL, the OOM killer: ``WorkerLostError``, seen by
  ``SingleInstanceRequest.on_failure``) the worker's main process releases it at once, by owner id,
  found through the task id, host and pid stored with the lock, before Celery requeues an
  ``acks_late`` message. A delivery that finds its own task id's lock held by a dead process of its
  host (the main process could not release it) releases it and runs. The lock name is exactly the
  formatted key.
- **Queued marker** ``<key>:queued`` (only with ``dedupe=True``): acquired non-blocking by
  ``apply_async()`` with ``dedupe_ttl`` and no renewal; its name and owner id travel in the message
  header ``distlock_queued``, signed with ``django.core.signing`` (a header that is unsigned, tampered
  with or names another key's marker is ignored and logged). The run releases it when it finishes; a
  retry hands it on to the retried message; a revoked or expired message releases it in the worker
  that drops it. Every release is a compare-and-delete on the owner id, so nobody ever deletes a
  marker or lock that is not theirs. A message lost with its worker leaves the marker until
  ``dedupe_ttl`` passes.
"""

import functools
import inspect
import logging
import os
import signal
import socket
import string

from billiard.einfo import ExceptionWithTraceback
from celery import shared_task
from celery.contrib.django.task import DjangoTask
from celery.exceptions import Retry, WorkerLostError
from celery.signals import task_revoked
from celery.worker.request import Request
from django.core import signing

from distlock import metrics
from distlock.api import acquire
from distlock.conf import DEFAULT_ALIAS
from distlock.exceptions import LockError, LockLost, LockNotAcquired
from distlock.handler import locks
from distlock.holder import current_task_id
from distlock.signals import task_skipped
from distlock.validation import validate_alias, validate_flag, validate_seconds

__all__ = [
    "AlreadyQueued",
    "CONFLICT_OUTCOMES",
    "FATAL_SIGNALS",
    "ON_CONFLICT_CHOICES",
    "QUEUED_HEADER",
    "QUEUED_HEADER_SALT",
    "SingleInstanceRequest",
    "SingleInstanceTask",
    "check_options",
    "release_after_revoke",
    "single_instance_task",
]

logger = logging.getLogger(__name__)

ON_CONFLICT_CHOICES = ("skip", "retry", "raise")

#: ``on_conflict`` -> the outcome ``metrics.record_task_conflict`` counts; "refused" counts dedupe refusals.
CONFLICT_OUTCOMES = {"skip": "skip", "retry": "retry", "raise": "fail"}

#: Message header that carries the queued marker's name and owner id from ``apply_async()`` to the run.
QUEUED_HEADER = "distlock_queued"

#: ``django.core.signing`` salt of the ``QUEUED_HEADER`` value: anyone who can publish to the broker
#: could otherwise name any marker and owner id and have a worker delete it, or skip ``dedupe``.
QUEUED_HEADER_SALT = "distlock.celery.queued"

#: Signals after which a terminated run can never reach its ``finally``, so the worker's main process
#: releases on its behalf. Not SIGTERM (``revoke(terminate=True)``'s default): billiard's pool child
#: turns it into ``SystemExit``, so the run unwinds and releases by itself, and releasing for it while
#: its own ``finally`` clauses still run could let the next run overlap them.
FATAL_SIGNALS = frozenset({signal.SIGKILL})


class AlreadyQueued(LockError):
    """``dedupe=True``: a call with the same key is already queued or running; nothing was enqueued."""


class SingleInstanceRequest(Request):
    """The worker's request of a ``SingleInstanceTask``: frees the lock of a run whose pool child died.

    ``on_failure`` runs in the worker's main process. When the pool child that ran the task died
    (``WorkerLostError``: SIGKILL, the OOM killer, a segfault; billiard reports it only once the
    child has exited), the run can never reach its ``finally``, so its lock is released here, by
    owner id, *before* Celery acts on the message: with ``acks_late`` and
    ``task_reject_on_worker_lost`` the message is requeued (same task id), with
    ``retry_on_worker_lost`` it is retried, and that next delivery must find the key free instead of
    being skipped for up to ``ttl``. Celery sends no ``task_failure`` for a requeued message, which
    is why this is a request hook and not a signal receiver.
    """

    def on_failure(self, exc_info, send_failed_event=True, return_ok=False):
        exc = exc_info.exception
        if isinstance(exc, ExceptionWithTraceback):
            exc = exc.exc
        if isinstance(exc, WorkerLostError) and isinstance(self.task, SingleInstanceTask):
            try:
                self.task._release_lock_of_dead_run(self, cause=str(exc))
            except Exception:  # never keep Celery from requeueing or failing the message
                logger.exception("Could not release the lock of %s[%s] after its worker was lost; "
                                 "it expires after its ttl", self.task.name, self.id)
        return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)


class SingleInstanceTask(DjangoTask):
    """A task that runs at most once at a time per lock key, holding a renewed lease for the whole run.

    Use it through ``@single_instance_task(...)``, or as ``base=`` of a task whose class attributes
    below are set. A call whose key is held is skipped, retried or failed (``on_conflict``).
    """

    #: Lock name: a format string over the task's arguments, a callable ``(args, kwargs) -> str``,
    #: or None for the task's name (one running instance of the task at all).
    lock_key = None
    #: Seconds the lease lives without renewal: how long a killed worker keeps the key (None: the
    #: alias's ``DEFAULT_TTL``).
    lock_ttl = None
    #: The ``DISTLOCK`` alias.
    lock_using = DEFAULT_ALIAS
    #: Seconds after which renewal stops and the lease is released and marked lost (None: never).
    lock_max_hold = None
    #: What a run whose key is held does: "skip" (return None), "retry" or "raise" ``LockNotAcquired``.
    on_conflict = "skip"
    #: Countdown of an ``on_conflict="retry"`` retry (None: the task's ``default_retry_delay``).
    retry_countdown = None
    #: Refuse ``apply_async()`` with ``AlreadyQueued`` while a call with the same key is queued or running.
    dedupe = False
    #: Seconds a queued marker blocks duplicates at most if its run never releases it (None: ``lock_ttl``).
    dedupe_ttl = None

    #: The worker's request class: releases the lock of a run whose pool child died (see its docstring).
    Request = "distlock.celery:SingleInstanceRequest"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        key = cls.__dict__.get("lock_key")
        if inspect.isfunction(key):
            cls.lock_key = staticmethod(key)  # a callable key is not a method: no ``self``
        check_options(cls.__name__, key=cls.lock_key, ttl=cls.lock_ttl, using=cls.lock_using,
                      max_hold=cls.lock_max_hold, on_conflict=cls.on_conflict,
                      retry_countdown=cls.retry_countdown, dedupe=cls.dedupe, dedupe_ttl=cls.dedupe_ttl)

    # -- the key -------------------------------------------------------------------------------

    @functools.cached_property
    def _key_signature(self):
        """The signature callers bind to: ``run``'s, without the injected ``lease`` parameter."""
        signature = inspect.signature(self.run)
        return signature.replace(parameters=[p for p in signature.parameters.values() if p.name != "lease"])

    @functools.cached_property
    def _accepts_lease(self):
        return "lease" in inspect.signature(self.run).parameters

    def lock_name(self, args, kwargs):
        """Return the lock name of a call with ``args`` and ``kwargs``."""
        key = self.lock_key
        if key is None:
            return self.name
        if callable(key):
            name = key(tuple(args), dict(kwargs))
            if not isinstance(name, str):
                raise TypeError(f"key callable of task {self.name} must return a str, got {name!r}.")
            return name
        try:
            bound = self._key_signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"Task {self.name}: cannot build lock key {key!r} from args={args!r} "
                            f"kwargs={kwargs!r}: {exc}") from exc
        bound.apply_defaults()
        return key.format_map(bound.arguments)

    # -- the run -------------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        name = self.lock_name(args, kwargs)
        # Set before acquiring, so the lock record on the server names this task run.
        task_id_context = current_task_id.set(self.request.id or "")
        handed_on = False
        try:
            return self._run_locked(name, args, kwargs)
        except Retry:
            handed_on = True  # the retried message carries the queued marker on
            raise
        finally:
            current_task_id.reset(task_id_context)
            if not handed_on:
                self._release_queued_marker(self.request.headers, args, kwargs)

    def _acquire_run_lock(self, name):
        return acquire(name, ttl=self.lock_ttl, blocking=False, using=self.lock_using,
                       auto_renew=True, max_hold=self.lock_max_hold)

    def _run_locked(self, name, args, kwargs):
        try:
            lease = self._acquire_run_lock(name)
        except LockNotAcquired as exc:
            lease = self._take_over_from_dead_delivery(name) if self._redelivered() else None
            if lease is None:
                return self._conflict(name, exc)
        lost = False
        try:
            if self._accepts_lease:
                kwargs = {**kwargs, "lease": lease}
            result = super().__call__(*args, **kwargs)
            lost = lease.lost
        finally:
            lease.release()
        if lost:
            # The lease's loss was already logged and counted (Lease.mark_lost); fail the run so its
            # result shows that another run may have overlapped it.
            raise LockLost(
                f"Task {self.name}[{self.request.id}] finished, but its lock {name!r} (token {lease.token}) "
                "was lost during the run, so another run may have overlapped it; the return value is discarded. "
                "Raise ttl or fix the renewal path (see the distlock.lease warning)."
            )
        return result

    def _redelivered(self):
        """Return True if the broker marked this message redelivered (requeued, or restored after a lost worker)."""
        return bool((self.request.delivery_info or {}).get("redelivered"))

    def _take_over_from_dead_delivery(self, name):
        """Return the run lock taken over from an earlier, dead delivery of this message, or None.

        Only for a redelivered message whose key is held by a lock record of this very task id,
        written on this host by a process that no longer exists: the worker's main process could
        not release it (it died too, or the backend was unreachable then), so nobody else ever
        will before ``ttl``. A holder on another host, or a pid that still exists, may be a live
        run of the same message (a broker that redelivers a message still running): left alone.
        """
        task_id = self.request.id
        if not task_id:
            return None
        backend = locks[self.lock_using]
        for info in backend.held_locks(prefix=name):
            if info.name != name or info.task_id != task_id:
                continue
            if info.host != socket.gethostname() or not info.pid or _process_exists(info.pid):
                logger.warning("%s[%s] was redelivered while lock %r is held by an earlier delivery of it "
                               "(host %s, pid %s) that may still be running", self.name, task_id, name,
                               info.host, info.pid)
                return None
            if backend.release_owned(name, info.owner):
                logger.warning("Released lock %r of a dead earlier delivery of %s[%s] (host %s, pid %s no "
                               "longer exists)", name, self.name, task_id, info.host, info.pid)
            try:
                return self._acquire_run_lock(name)
            except LockNotAcquired:
                return None
        return None

    def _conflict(self, name, exc):
        """Skip, retry or fail a run whose key another run holds, loudly."""
        metrics.record_task_conflict(self.lock_using, name, CONFLICT_OUTCOMES[self.on_conflict])
        if self.on_conflict == "skip":
            if self._redelivered():
                logger.warning("Skipped redelivered %s[%s]: lock %r is held by another run; this message "
                               "will not run (use on_conflict='retry' with acks_late to keep it)",
                               self.name, self.request.id, name)
            else:
                logger.info("Skipped %s[%s]: lock %r is held by another run", self.name, self.request.id, name)
            task_skipped.send(sender=type(self), task=self, key=name, task_id=self.request.id)
            return None
        if self.on_conflict == "retry":
            countdown = self.default_retry_delay if self.retry_countdown is None else self.retry_countdown
            logger.info("Retrying %s[%s] in %ss: lock %r is held by another run",
                        self.name, self.request.id, countdown, name)
            raise self.retry(countdown=countdown, exc=exc)
        logger.info("Failing %s[%s]: lock %r is held by another run", self.name, self.request.id, name)
        raise exc

    # -- enqueueing ----------------------------------------------------------------------------

    def apply_async(self, args=None, kwargs=None, *more, **options):
        """Enqueue the call; with ``dedupe`` raise ``AlreadyQueued`` if its key is queued or running."""
        if not self.dedupe:
            return super().apply_async(args, kwargs, *more, **options)
        headers = options.pop("headers", None) or {}
        if QUEUED_HEADER in headers:
            if self._queued_marker(headers, args or (), kwargs or {}) is not None:  # a retry carries its marker on
                return super().apply_async(args, kwargs, *more, headers=headers, **options)
            headers = {key: value for key, value in headers.items() if key != QUEUED_HEADER}
        marker = self.lock_name(args or (), kwargs or {}) + ":queued"
        ttl = self.dedupe_ttl or self.lock_ttl or locks[self.lock_using].settings["DEFAULT_TTL"]
        try:
            lease = acquire(marker, ttl=ttl, blocking=False, using=self.lock_using, auto_renew=False)
        except LockNotAcquired as exc:
            metrics.record_task_conflict(self.lock_using, marker, "refused")
            logger.info("Refused to enqueue %s: %r is held (a call with this key is queued or running)",
                        self.name, marker)
            raise AlreadyQueued(
                f"Task {self.name}: a call with key {marker[:-len(':queued')]!r} is already queued or running "
                f"(marker {marker!r} on alias '{self.lock_using}'); retry after it finishes or after "
                f"dedupe_ttl={ttl:g}s."
            ) from exc
        signed = signing.dumps({"name": marker, "owner": lease.owner}, salt=QUEUED_HEADER_SALT)
        headers = {**headers, QUEUED_HEADER: signed}
        try:
            return super().apply_async(args, kwargs, *more, headers=headers, **options)
        except BaseException:
            lease.release()
            raise

    def _queued_marker(self, headers, args, kwargs):
        """Return ``{"name", "owner"}`` of the queued marker in ``headers``, or None if absent or not to be trusted.

        Trusted only when signed by ``apply_async()`` with this project's ``SECRET_KEY`` (or one of
        ``SECRET_KEY_FALLBACKS``) and naming this call's own marker; anything else is logged and ignored.
        """
        value = (headers or {}).get(QUEUED_HEADER)
        if value is None:
            return None
        try:
            if not isinstance(value, str):
                raise signing.BadSignature("not a signed string")
            marker = signing.loads(value, salt=QUEUED_HEADER_SALT)
        except signing.BadSignature as exc:
            logger.warning("Ignored the %s header of %s: not signed by this project (%s)",
                           QUEUED_HEADER, self.name, exc)
            return None
        expected = self.lock_name(args, kwargs) + ":queued"
        if (not isinstance(marker, dict) or marker.get("name") != expected
                or not isinstance(marker.get("owner"), str) or not marker["owner"]):
            logger.warning("Ignored the %s header of %s: it does not name this call's marker %r",
                           QUEUED_HEADER, self.name, expected)
            return None
        return marker

    def _release_queued_marker(self, headers, args, kwargs):
        """Delete the queued marker named in ``headers`` if its owner id still holds it."""
        marker = self._queued_marker(headers, args, kwargs)
        if marker:
            locks[self.lock_using].release_owned(marker["name"], marker["owner"])

    def _release_lock_of_dead_run(self, request, cause):
        """Release the run lock of ``request`` (its pool child is dead): only the record that run wrote.

        Runs in the worker's main process. The record is found by the task id and host stored with
        the lock, and by the pid of the pool child that accepted the request when ``request`` is the
        worker's request (``WorkerLostError``); it is deleted by its owner id. The next delivery of
        the message comes only after this returns, so it is never the one released.
        """
        name = self.lock_name(request.args or (), request.kwargs or {})
        backend = locks[self.lock_using]
        host, pid = socket.gethostname(), getattr(request, "worker_pid", None)  # a revoke's Context has none
        for info in backend.held_locks(prefix=name):
            if (info.name == name and info.task_id and info.task_id == request.id and info.host == host
                    and (pid is None or info.pid == pid)):
                if backend.release_owned(name, info.owner):
                    logger.info("Released lock %r of %s[%s] (pool child pid %s): %s",
                                name, self.name, request.id, info.pid, cause)


@task_revoked.connect
def release_after_revoke(sender=None, request=None, terminated=False, signum=None, **kwargs):
    """Free what a revoked run can no longer free itself.

    Runs in the worker's main process. A message revoked before it ran (or expired) releases its
    queued marker. A run terminated with SIGKILL is dead, so its lock and marker are released by
    owner id at once instead of after ``ttl``; a run sent a signal its pool child handles (SIGTERM,
    the soft time limit's SIGUSR1) unwinds and releases in its own ``finally``.
    """
    if not isinstance(sender, SingleInstanceTask) or request is None:
        return
    if terminated and signum not in FATAL_SIGNALS:
        return
    sender._release_queued_marker(request.headers, request.args or (), request.kwargs or {})
    if terminated:
        sender._release_lock_of_dead_run(request, cause=f"killed by signal {signum}")


def _process_exists(pid):
    """Return False only if no process ``pid`` exists on this host (a zombie, or another user's process, exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_options(task_name, *, key, ttl, using, max_hold, on_conflict, retry_countdown, dedupe, dedupe_ttl,
                  parameters=None):
    """Raise ``TypeError``/``ValueError`` naming the bad option; no I/O, so it runs at import time."""
    if key is not None and not callable(key):
        if not isinstance(key, str) or not key:
            raise TypeError(f"key of task {task_name} must be a non-empty format string or a callable "
                            f"(args, kwargs) -> str, got {key!r}.")
        if parameters is not None:
            _check_key_fields(task_name, key, parameters)
    validate_seconds("ttl", ttl, allow_none=True)
    validate_alias(using)
    validate_seconds("max_hold", max_hold, allow_none=True)
    if on_conflict not in ON_CONFLICT_CHOICES:
        raise ValueError(f"on_conflict of task {task_name} must be one of {', '.join(ON_CONFLICT_CHOICES)}, "
                         f"got {on_conflict!r}.")
    validate_seconds("retry_countdown", retry_countdown, allow_none=True, allow_zero=True)
    validate_flag("dedupe", dedupe)
    validate_seconds("dedupe_ttl", dedupe_ttl, allow_none=True)


def _check_key_fields(task_name, key, parameters):
    """Raise ``ValueError`` if the format string ``key`` names something that is not one of ``parameters``."""
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    names = [p.name for p in parameters if p.name != "lease"]
    for _, field, _, _ in string.Formatter().parse(key):
        if field is None:
            continue
        root = field.split(".", 1)[0].split("[", 1)[0]
        if root not in names:
            raise ValueError(
                f"key {key!r} of task {task_name} names {{{field}}}, which is not a parameter of the task "
                f"(parameters: {', '.join(names) or 'none'}); use parameter names, or a callable key."
            )


def single_instance_task(*args, key=None, ttl=None, on_conflict="skip", using=DEFAULT_ALIAS, retry_countdown=None,
                         dedupe=False, dedupe_ttl=None, max_hold=None, **celery_options):
    """Decorate a function as a shared Celery task that runs at most once at a time per ``key``.

    Use it instead of ``@shared_task``; every other keyword is a Celery task option (``bind``,
    ``max_retries``, ``time_limit``, ...).

    :param key: the lock name: a format string over the task's arguments (``"report:{customer_id}"``),
        a callable ``(args, kwargs) -> str``, or None (default) for the task name.
    :param ttl: seconds the lease lives unless renewed; it is renewed every ``ttl/3`` during the run,
        so it is how long a killed worker keeps the key (default: the alias's ``DEFAULT_TTL``).
    :param on_conflict: "skip" (default: return None, log at INFO, count, send ``task_skipped``),
        "retry" (``self.retry()`` honouring ``max_retries``) or "raise" (``LockNotAcquired``).
    :param using: the ``DISTLOCK`` alias.
    :param retry_countdown: seconds before an ``on_conflict="retry"`` retry (default: ``default_retry_delay``).
    :param dedupe: refuse ``delay()``/``apply_async()`` with ``AlreadyQueued`` while the key is queued or running.
    :param dedupe_ttl: seconds after which a queued marker whose run never came expires (default: ``ttl``).
    :param max_hold: seconds after which renewal stops and the run's lease is released and lost.
    """
    options = dict(key=key, ttl=ttl, using=using, max_hold=max_hold, on_conflict=on_conflict,
                   retry_countdown=retry_countdown, dedupe=dedupe, dedupe_ttl=dedupe_ttl)

    def decorate(func):
        parameters = list(inspect.signature(func).parameters.values())
        if celery_options.get("bind"):
            parameters = parameters[1:]  # ``self``, the task
        check_options(func.__name__, parameters=parameters, **options)
        return shared_task(
            base=SingleInstanceTask, lock_key=key, lock_ttl=ttl, lock_using=using, lock_max_hold=max_hold,
            on_conflict=on_conflict, retry_countdown=retry_countdown, dedupe=dedupe, dedupe_ttl=dedupe_ttl,
            **celery_options,
        )(func)

    if args:  # used bare: @single_instance_task
        if len(args) != 1 or not callable(args[0]) or celery_options:
            raise TypeError("single_instance_task takes keyword options only: @single_instance_task(key=...).")
        return decorate(args[0])
    return decorate
