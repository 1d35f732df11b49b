"""``@single_instance_task``: eager-mode unit tests, then real prefork workers on the test Redis broker.

The worker tests start two ``celery -A project worker`` processes (prefork, concurrency 2) with the
test settings, so they take their locks on the test Redis and PostgreSQL, and record every run in
``tests.celery_app.models.TaskRun``.
"""

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from contextlib import suppress
from itertools import combinations

import pytest
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded, WorkerLostError
from django.core import signing

import distlock
from distlock import metrics
from distlock.celery import (
    QUEUED_HEADER,
    QUEUED_HEADER_SALT,
    AlreadyQueued,
    SingleInstanceTask,
    single_instance_task,
)
from distlock.exceptions import LockLost, LockNotAcquired
from distlock.handler import locks
from distlock.holder import current_task_id
from distlock.signals import task_skipped
from project.celery import app
from tests.celery_app import tasks
from tests.celery_app.models import TaskRun
from tests.conftest import BACKEND_ALIASES, require_alias
from tests.servers import ManagedProcess, port_open, wait_until
from tests.workers import child_env

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


@pytest.fixture
def counted(monkeypatch):
    """The ``(metric, alias, name, outcome)`` events counted through ``distlock.metrics`` during the test."""
    events = []
    real_conflict, real_lost = metrics.record_task_conflict, metrics.record_lost

    def record_task_conflict(alias, name, outcome):
        events.append(("task_conflict", alias, name, outcome))
        real_conflict(alias, name, outcome)

    def record_lost(lease):
        events.append(("lost", lease.alias, lease.name, ""))
        real_lost(lease)

    monkeypatch.setattr(metrics, "record_task_conflict", record_task_conflict)
    monkeypatch.setattr(metrics, "record_lost", record_lost)
    return events


# -- eager mode and in-process calls --------------------------------------------------------------

runs = []


@single_instance_task(name="test_celery.report", key="report:{customer_id}:{period}", using="locmem", ttl=5)
def report(customer_id, period="month", lease=None):
    runs.append(lease)
    holders = locks["locmem"].held_locks(prefix=lease.name)
    return {"name": lease.name, "token": lease.token, "task_ids": [info.task_id for info in holders],
            "task_id_var": current_task_id.get()}


@single_instance_task(name="test_celery.bound", key="bound:{item}", using="locmem", bind=True)
def bound(self, item):
    return self.request.id


@single_instance_task(name="test_celery.by_callable", key=lambda args, kwargs: f"callable:{args[0] * 2}",
                      using="locmem")
def by_callable(number):
    return number


@single_instance_task(name="test_celery.whole_task", using="locmem")
def whole_task():
    return "ran"


@single_instance_task(name="test_celery.raising", key="raising:{which}", using="locmem", on_conflict="raise")
def raising(which):
    raise ValueError(f"task body failed for {which}")


@single_instance_task(name="test_celery.retrying", key="retrying", using="locmem", on_conflict="retry",
                      retry_countdown=0, max_retries=2)
def retrying():
    return "ran"


attempts = []


@single_instance_task(name="test_celery.self_retrying", key="self-retrying", using="locmem", bind=True,
                      max_retries=1)
def self_retrying(self):
    attempts.append(self.request.retries)
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return "second attempt ran"


checks = []


@single_instance_task(name="test_celery.losing", key="losing", using="locmem", ttl=0.3)
def losing(lease=None):
    # Another party deletes our lock: the renewal (every 0.1 s) finds it gone and marks the lease lost.
    # Wait for that mark: the 0.3 s validity runs out by itself too, and a run that ends before the
    # renewal found out stops it before it counts the loss.
    locks["locmem"].release_owned(lease.name, lease.owner)
    wait_until(lambda: lease.lost_reason is not None, 10, "the renewal marking the lease lost")
    try:
        lease.check()
    except LockLost as exc:
        checks.append(exc)
    return "finished"


@single_instance_task(name="test_celery.deduped", key="deduped:{item}", using="locmem", dedupe=True, bind=True)
def deduped(self, item, fail=False):
    held = [info.name for info in locks["locmem"].held_locks(prefix=f"deduped:{item}")]
    if fail:
        raise ValueError("deduped run failed")
    return held


@single_instance_task(name="test_celery.deduped_header", key="deduped-header:{item}", using="locmem", dedupe=True,
                      bind=True)
def deduped_header(self, item):
    return self.request.headers[QUEUED_HEADER]


def token_of_run(name, lease=None):
    return lease.token


#: A run lock with a long ttl on a shared server, for a lock record left by another (dead) process.
redelivered = single_instance_task(name="test_celery.redelivered", key="redelivered:{name}", using="redis",
                                   ttl=60)(token_of_run)


#: One task per alias: the decorator works with any backend.
PER_ALIAS = {alias: single_instance_task(name=f"test_celery.per_alias_{alias}", key="per-alias:{name}",
                                         using=alias, ttl=10)(token_of_run)
             for alias in BACKEND_ALIASES}


@pytest.fixture
def eager():
    """``CELERY_TASK_ALWAYS_EAGER`` as users' unit tests set it: delay() runs the task in-process."""
    app.conf.task_always_eager = True
    yield
    app.conf.task_always_eager = False


def test_key_formats_the_bound_arguments_and_is_the_lock_name(eager):
    result = report.delay(42).get()
    assert result["name"] == "report:42:month"
    result = report.delay(period="week", customer_id=7).get()
    assert result["name"] == "report:7:week"
    assert report.apply((7, "day")).get()["name"] == "report:7:day"
    assert by_callable.lock_name((21,), {}) == "callable:42"
    assert whole_task.lock_name((), {}) == "test_celery.whole_task"
    assert bound.lock_name(("x",), {}) == "bound:x"


def test_run_holds_a_lease_with_the_task_id_and_releases_it(eager):
    result = report.apply((1,), task_id="run-1")
    assert result.state == "SUCCESS"
    assert result.result["task_ids"] == ["run-1"], "the lock record must carry the Celery task id"
    assert result.result["task_id_var"] == "run-1"
    assert current_task_id.get() == ""
    lease = runs[-1]
    assert lease.released and not lease.lost
    assert lease._renewer is not None, "the run's lease must be auto-renewed"
    again = report.apply((1,)).get()
    assert again["token"] > lease.token


def test_bound_task_gets_self(eager):
    assert bound.apply(("y",), task_id="bound-1").get() == "bound-1"


def test_works_with_every_alias(backend_alias):
    task = PER_ALIAS[backend_alias]
    first = task.apply(("a",)).get()
    second = task.apply(("a",)).get()
    assert isinstance(first, int) and second > first
    distlock.acquire("per-alias:a", blocking=False, using=backend_alias).release()


@single_instance_task(name="test_celery.slow", key="slow:{name}", using="redis", ttl=1)
def slow(name, lease=None):
    time.sleep(2.5)  # longer than ttl: only renewal keeps the lease
    lease.check()
    return lease.token


def test_renewal_and_exclusion_between_threads():
    """Two threads (as in ``--pool threads``) run one key at once: one runs past its ttl, the other skips."""
    require_alias("redis")
    name = run_key()
    outcomes = []
    threads = [threading.Thread(target=lambda: outcomes.append(slow.apply((name,)))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(result.state for result in outcomes) == ["SUCCESS", "SUCCESS"]
    values = [result.result for result in outcomes]
    assert values.count(None) == 1, f"exactly one of the two runs must skip: {values}"
    assert [value for value in values if value is not None][0] > 0


def test_skip_returns_none_logs_counts_and_signals(eager, caplog, counted):
    skipped = []

    def on_skip(sender, task, key, task_id, **kwargs):
        skipped.append((sender, key, task_id))

    task_skipped.connect(on_skip)
    caplog.set_level(logging.INFO, logger="distlock.celery")
    try:
        with distlock.lock("report:5:month", using="locmem"):
            result = report.apply((5,), task_id="skipped-1")
    finally:
        task_skipped.disconnect(on_skip)
    assert result.state == "SUCCESS" and result.result is None
    assert skipped == [(type(report._get_current_object()), "report:5:month", "skipped-1")]
    assert counted == [("task_conflict", "locmem", "report:5:month", "skip")]
    assert any("report:5:month" in record.getMessage() and record.levelno == logging.INFO
               for record in caplog.records)


def test_raise_fails_the_task_with_lock_not_acquired(eager, counted):
    with distlock.lock("raising:a", using="locmem"):
        result = raising.apply(("a",))
    assert result.state == "FAILURE" and isinstance(result.result, LockNotAcquired)
    assert "raising:a" in str(result.result)
    assert counted == [("task_conflict", "locmem", "raising:a", "fail")]


def test_retry_honours_max_retries_then_fails(eager, counted):
    with distlock.lock("retrying", using="locmem"):
        result = retrying.apply()
    assert result.state == "FAILURE" and isinstance(result.result, LockNotAcquired)
    assert counted == [("task_conflict", "locmem", "retrying", "retry")] * 3, \
        "the first run and its 2 retries all found the key held"
    assert retrying.apply().get() == "ran"


def test_released_on_failure_and_on_retry(eager):
    result = raising.apply(("b",))
    assert result.state == "FAILURE" and isinstance(result.result, ValueError)
    distlock.acquire("raising:b", blocking=False, using="locmem").release()
    attempts.clear()
    assert self_retrying.apply().get() == "second attempt ran"
    assert attempts == [0, 1], "the retry could only run because the first run released the key"


def test_lost_lease_is_visible_to_the_run_and_fails_the_result(eager, counted):
    checks.clear()
    result = losing.apply()
    assert len(checks) == 1, "lease.check() must raise LockLost inside the run"
    assert result.state == "FAILURE" and isinstance(result.result, LockLost)
    assert "losing" in str(result.result)
    assert counted == [("lost", "locmem", "losing", "")]


def test_dedupe_refuses_while_queued_and_clears_the_marker(eager, counted):
    with distlock.lock("deduped:1:queued", using="locmem"):  # as if a call were queued
        with pytest.raises(AlreadyQueued, match="deduped:1"):
            deduped.delay(1)
    assert counted == [("task_conflict", "locmem", "deduped:1:queued", "refused")]
    assert sorted(deduped.delay(1).get()) == ["deduped:1", "deduped:1:queued"], "marker held during the run"
    assert locks["locmem"].held_locks(prefix="deduped:1") == [], "marker and lock released after the run"
    result = deduped.delay(2, fail=True)
    assert result.state == "FAILURE"
    assert locks["locmem"].held_locks(prefix="deduped:2") == [], "released after a failed run too"


def test_dedupe_header_is_signed_and_names_the_marker(eager):
    header = deduped_header.delay(1).get()
    marker = signing.loads(header, salt=QUEUED_HEADER_SALT)
    assert marker["name"] == "deduped-header:1:queued" and len(marker["owner"]) == 32
    with pytest.raises(signing.BadSignature):
        signing.loads(header, salt="another.salt")
    assert locks["locmem"].held_locks(prefix="deduped-header:1") == []


def test_unsigned_tampered_or_foreign_queued_header_is_ignored(eager, caplog):
    """A header not signed by ``apply_async()`` for this call neither releases a marker nor skips dedupe."""
    caplog.set_level(logging.WARNING, logger="distlock.celery")
    queued = distlock.acquire("deduped:3:queued", ttl=30, blocking=False, using="locmem")  # a call of item 3 is queued
    other = distlock.acquire("deduped:4:queued", ttl=30, blocking=False, using="locmem")  # and one of item 4
    claim = {"name": queued.name, "owner": queued.owner}
    genuine = signing.dumps(claim, salt=QUEUED_HEADER_SALT)
    forged_headers = {
        "unsigned": claim,
        "garbage": "not-a-signature",
        "tampered": genuine[:-1] + ("A" if genuine[-1] != "A" else "B"),
        "other salt": signing.dumps(claim, salt="another.salt"),
        "another key's marker": signing.dumps({"name": other.name, "owner": other.owner}, salt=QUEUED_HEADER_SALT),
    }
    try:
        for what, header in forged_headers.items():
            caplog.clear()
            result = deduped.apply((3,), headers={QUEUED_HEADER: header})
            assert result.state == "SUCCESS", what
            held = {info.name: info.owner for info in locks["locmem"].held_locks(prefix="deduped:")}
            assert held == {queued.name: queued.owner, other.name: other.owner}, \
                f"a run with a {what} header released a marker"
            assert any(QUEUED_HEADER in record.getMessage() and record.levelno == logging.WARNING
                       for record in caplog.records), f"the {what} header was not logged"
            with pytest.raises(AlreadyQueued):
                deduped.apply_async((3,), headers={QUEUED_HEADER: header})
        # The genuine header is honoured: the run releases its own marker.
        assert deduped.apply((3,), headers={QUEUED_HEADER: genuine}).state == "SUCCESS"
        assert [info.name for info in locks["locmem"].held_locks(prefix="deduped:")] == [other.name]
    finally:
        queued.release()
        other.release()


def run_as_delivery(task, task_id, args, *, redelivered):
    """Call ``task`` as a worker runs a message with ``task_id``, flagged redelivered by the broker or not."""
    task.push_request(id=task_id, delivery_info={"redelivered": redelivered}, headers=None)
    try:
        return task(*args)
    finally:
        task.pop_request()


DEAD_DELIVERY = """
import os, sys
import django
django.setup()
import distlock
from distlock.holder import current_task_id
current_task_id.set(sys.argv[2])
lease = distlock.acquire(sys.argv[1], ttl=60, blocking=False, using="redis")
print(lease.token, flush=True)
os._exit(0)  # dies holding the lock: no release, no atexit
"""


def test_redelivery_takes_over_the_lock_of_its_own_dead_delivery(caplog):
    """A redelivered message whose own earlier delivery died on this host holding the key runs at once."""
    require_alias("redis")
    name = run_key()
    task_id = f"dead-delivery-{name}"
    caplog.set_level(logging.INFO, logger="distlock.celery")
    # A process that took the run lock as the delivery of ``task_id`` would, then died without releasing.
    dead = subprocess.run([sys.executable, "-c", DEAD_DELIVERY, f"redelivered:{name}", task_id], env=child_env(),
                          capture_output=True, text=True, timeout=60, check=True)
    dead_token = int(dead.stdout.split()[-1])
    (info,) = locks["redis"].held_locks(prefix=f"redelivered:{name}")
    assert info.task_id == task_id and info.pid != os.getpid()

    # Not a redelivery (another message that happens to reuse the id): skipped like any conflict.
    assert run_as_delivery(redelivered, task_id, (name,), redelivered=False) is None
    # A redelivery of another message: the holder is not its own earlier delivery.
    assert run_as_delivery(redelivered, f"other-{name}", (name,), redelivered=True) is None
    token = run_as_delivery(redelivered, task_id, (name,), redelivered=True)
    assert isinstance(token, int) and token > dead_token, "the redelivery must run, not be skipped"
    assert any("dead earlier delivery" in record.getMessage() for record in caplog.records)
    assert locks["redis"].held_locks(prefix=f"redelivered:{name}") == [], "the redelivery released after its run"


def test_redelivery_leaves_a_live_holder_of_its_task_id_alone(caplog):
    """A holder of the same task id whose process exists (a broker redelivering a running message) keeps the key."""
    require_alias("redis")
    name = run_key()
    task_id = f"live-delivery-{name}"
    caplog.set_level(logging.WARNING, logger="distlock.celery")
    token = current_task_id.set(task_id)
    try:
        live = distlock.acquire(f"redelivered:{name}", ttl=60, blocking=False, using="redis")
    finally:
        current_task_id.reset(token)
    try:
        assert run_as_delivery(redelivered, task_id, (name,), redelivered=True) is None
        (info,) = locks["redis"].held_locks(prefix=f"redelivered:{name}")
        assert info.owner == live.owner
        assert any("may still be running" in record.getMessage() for record in caplog.records)
        assert any("Skipped redelivered" in record.getMessage() and record.levelno == logging.WARNING
                   for record in caplog.records), "a dropped redelivery must be logged as a warning"
    finally:
        live.release()


def test_options_are_checked_at_decoration():
    with pytest.raises(ValueError, match="customer"):
        single_instance_task(key="report:{customer}")(lambda customer_id: None)
    with pytest.raises(ValueError, match="on_conflict"):
        single_instance_task(on_conflict="wait")(lambda: None)
    with pytest.raises(ValueError, match="ttl"):
        single_instance_task(ttl=0)(lambda: None)
    with pytest.raises(TypeError, match="key"):
        single_instance_task(key=5)(lambda: None)
    with pytest.raises(TypeError, match="dedupe"):
        single_instance_task(dedupe="yes")(lambda: None)
    with pytest.raises(ValueError, match="on_conflict"):
        type("BadTask", (SingleInstanceTask,), {"on_conflict": "never"})


def test_callable_key_must_return_a_str():
    task = single_instance_task(name="test_celery.bad_key", key=lambda args, kwargs: 5, using="locmem")(token_of_run)
    with pytest.raises(TypeError, match="must return a str"):
        task.apply(throw=True)


# -- real workers -----------------------------------------------------------------------------------

class CeleryWorker(ManagedProcess):
    """``celery -A project worker``: prefork, concurrency 2, with the test settings of the children.

    ``broker`` and ``queue`` override the settings' broker and default queue.
    """

    start_timeout = 60

    def __init__(self, name, *, broker=None, queue=None):
        super().__init__(name)
        self.broker, self.queue = broker, queue

    def command(self):
        command = [sys.executable, "-m", "celery", "-A", "project"]
        if self.broker:
            command += ["--broker", self.broker]
        command += ["worker", "--pool", "prefork", "--concurrency", "2", "--hostname", f"{self.name}@%h",
                    "--loglevel", "INFO", "--prefetch-multiplier", "1",
                    "--without-gossip", "--without-mingle", "--without-heartbeat"]
        return command + (["--queues", self.queue] if self.queue else [])

    def env(self):
        return child_env(DISTLOCK_LOG_LEVEL="INFO")

    def ready(self):
        return " ready." in self.new_logs()

    def stop(self, timeout=20):
        """Warm shutdown (SIGTERM); then kill the worker's whole process group (it started its own session)."""
        if self.running:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._close_log()


@pytest.fixture(scope="module")
def workers(django_db_setup):
    """Two prefork workers × concurrency 2 on the test Redis broker, stopped after the module."""
    for alias in ("redis", "postgres"):
        require_alias(alias)
    started = []
    try:
        for number in (1, 2):
            started.append(CeleryWorker(f"distlock-test-w{number}-{uuid.uuid4().hex[:6]}").start())
        yield started
    finally:
        # Both warm shutdowns at once (SIGTERM, as stop() sends): each takes seconds; stop() then finds the
        # worker gone, or kills what still runs.
        for worker in started:
            if worker.running:
                worker.process.terminate()
        for worker in started:
            with suppress(subprocess.TimeoutExpired):
                worker.process.wait(20)
            worker.cleanup()


def worker_logs(workers):
    return "".join(worker.get_logs() for worker in workers)


def run_key():
    return uuid.uuid4().hex


def wait_for_run(key, count=1, timeout=30):
    wait_until(lambda: TaskRun.objects.filter(key=key).count() >= count, timeout, f"{count} run(s) of {key}")
    return TaskRun.objects.filter(key=key).order_by("started_ns")


def key_freed_after(name, alias, since, timeout):
    """Poll until lock ``name`` can be taken; return the seconds since ``since`` (monotonic)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            distlock.acquire(name, ttl=5, blocking=False, using=alias).release()
            return time.monotonic() - since
        except LockNotAcquired:
            time.sleep(0.05)
    raise AssertionError(f"lock {name!r} still held {timeout}s later")


@pytest.mark.parametrize("alias", ["redis", "postgres"])
def test_one_key_runs_one_at_a_time_with_increasing_tokens(workers, alias):
    key = run_key()
    results = [tasks.HOLD[alias].delay(key, 0.05) for _ in range(20)]
    for result in results:
        result.get(timeout=120)
    runs = list(TaskRun.objects.filter(key=key).order_by("started_ns"))
    assert len(runs) == 20
    for before, after in zip(runs, runs[1:]):
        assert before.finished_ns < after.started_ns, f"runs {before.task_id} and {after.task_id} overlapped"
        assert before.token < after.token, "fencing tokens of consecutive runs must strictly increase"
    assert len({run.pid for run in runs}) >= 2, "the runs should be spread over several pool processes"
    assert sum(run.retries for run in runs) > 0, "calls must have met a held key and waited their turn"


def test_distinct_keys_run_in_parallel(workers):
    keys = [run_key() for _ in range(4)]
    for result in [tasks.HOLD["redis"].delay(key, 1.5) for key in keys]:
        result.get(timeout=60)
    runs = list(TaskRun.objects.filter(key__in=keys))
    assert len(runs) == 4
    overlapping = [(a.key, b.key) for a, b in combinations(runs, 2)
                   if a.started_ns < b.finished_ns and b.started_ns < a.finished_ns]
    assert overlapping, "runs with different keys should have run at the same time"


def test_skip_while_held_then_run(workers):
    key = run_key()
    with distlock.lock(f"celery-test:{key}", ttl=30, using="redis"):
        assert tasks.hold_or_skip.delay(key).get(timeout=30) is None
    assert not TaskRun.objects.filter(key=key).exists(), "a skipped call must not run"
    wait_until(lambda: f"lock 'celery-test:{key}' is held" in worker_logs(workers), 10, "the skip log line")
    assert isinstance(tasks.hold_or_skip.delay(key).get(timeout=30), int)
    assert TaskRun.objects.filter(key=key).count() == 1


def test_retry_waits_for_the_key(workers):
    key = run_key()
    holder = distlock.acquire(f"celery-test:{key}", ttl=30, using="redis")
    try:
        result = tasks.HOLD["redis"].delay(key)
        # Refused twice while the key is held, so the run that gets it has retried twice. Celery logs
        # each retry once (distlock's own line shows twice: through its handler and the root's).
        retried = f"Task {tasks.HOLD['redis'].name}[{result.id}] retry: "
        wait_until(lambda: worker_logs(workers).count(retried) >= 2, 30, "two retries of the call")
        assert not TaskRun.objects.filter(key=key).exists(), "must not run while the key is held"
    finally:
        holder.release()
    token = result.get(timeout=30)
    assert token > holder.token
    assert TaskRun.objects.get(key=key).retries >= 2


def test_raise_fails_the_task(workers):
    key = run_key()
    with distlock.lock(f"celery-test:{key}", ttl=30, using="redis"):
        result = tasks.hold_or_raise.delay(key)
        with pytest.raises(LockNotAcquired, match=key):
            result.get(timeout=30)
    assert not TaskRun.objects.filter(key=key).exists()


def test_renewal_keeps_a_run_longer_than_its_ttl(workers):
    key = run_key()
    token = tasks.hold_short_ttl.delay(key, 4.5).get(timeout=30)  # ttl 3 s: renewed every second
    run = TaskRun.objects.get(key=key)
    assert run.token == token and run.finished_ns - run.started_ns >= 4.5e9


def test_sigkilled_run_frees_its_key_at_once(workers):
    """A pool child killed outright (no revoke): the worker's main process releases its lock on ``WorkerLostError``."""
    key = run_key()
    result = tasks.hold_long_ttl.delay(key, 60)
    run = wait_for_run(key)[0]
    os.kill(run.pid, signal.SIGKILL)  # a pool child of a worker this module started
    killed = time.monotonic()
    # ttl is 30 s: a key free within seconds was released, not expired.
    assert key_freed_after(f"celery-test:{key}", "redis", killed, timeout=15) < 12
    with pytest.raises(WorkerLostError):
        result.get(timeout=30)
    wait_until(lambda: f"Released lock 'celery-test:{key}' of tests.celery_app.tasks.hold_long_ttl[{result.id}] "
                       f"(pool child pid {run.pid})" in worker_logs(workers), 10, "the main process's release log line")


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGKILL"])
def test_revoke_with_terminate_releases_the_key(workers, signum):
    """SIGTERM: the pool child raises SystemExit and the run releases; SIGKILL: the worker's main process does."""
    key = run_key()
    result = tasks.hold_long_ttl.delay(key, 60)
    wait_for_run(key)
    result.revoke(terminate=True, signal=signum)
    revoked = time.monotonic()
    # ttl is 30 s: a key free within seconds was released, not expired.
    assert key_freed_after(f"celery-test:{key}", "redis", revoked, timeout=10) < 5
    assert TaskRun.objects.get(key=key).finished_ns is None, "the run must have been cut short"


@pytest.mark.parametrize("alias", ["redis", "postgres"])
def test_acks_late_redelivery_of_a_killed_run_runs(workers, alias):
    """``acks_late`` + ``reject_on_worker_lost``: the run's pool child is SIGKILLed (as the OOM killer
    would); the worker's main process releases its lock before the message is requeued, so the
    redelivery (same task id) gets the key and runs instead of being skipped as ``SUCCESS(None)``."""
    key = run_key()
    result = tasks.HOLD_ACKS_LATE[alias].delay(key)
    first = wait_for_run(key)[0]
    os.kill(first.pid, signal.SIGKILL)  # a pool child of a worker this module started
    # ttl is 30 s: a redelivery comes within ``worker_lost_wait`` (10 s) of the kill, while the key would
    # still be held had nobody released it.
    wait_until(lambda: TaskRun.objects.filter(key=key, finished_ns__isnull=False).exists(), 40,
               "the redelivered run to finish")
    killed, again = wait_for_run(key, count=2)
    assert killed.pk == first.pk and killed.finished_ns is None, "the first run must have been cut short"
    assert again.task_id == killed.task_id == result.id, "the second run is the redelivery of the same message"
    assert again.pid != killed.pid and again.token > killed.token
    assert result.get(timeout=30) == again.token, "the redelivered run's result, not a skip's None"
    distlock.acquire(f"celery-test:{key}", blocking=False, using=alias).release()  # and it released after its run
    # Released by the main process on WorkerLostError, before the requeue; not taken over by the redelivery.
    released = f"Released lock 'celery-test:{key}' of {tasks.HOLD_ACKS_LATE[alias].name}[{result.id}] (pool child pid "
    wait_until(lambda: f"{released}{killed.pid})" in worker_logs(workers), 10, "the main process's release log line")
    assert "dead earlier delivery" not in worker_logs(workers)


def test_time_limits_release_the_key(workers):
    key = run_key()
    with pytest.raises(SoftTimeLimitExceeded):
        tasks.hold_soft_limit.delay(key, 10).get(timeout=30)
    # ttl is 30 s: free at once means the run released it on its way out.
    distlock.acquire(f"celery-test:{key}", blocking=False, using="redis").release()
    key = run_key()
    result = tasks.hold_hard_limit.delay(key, 10)
    wait_for_run(key)
    with pytest.raises(TimeLimitExceeded):
        result.get(timeout=30)
    assert key_freed_after(f"celery-test:{key}", "redis", time.monotonic(), timeout=10) <= 3 + 0.5


def test_dedupe_refuses_while_queued_or_running_and_accepts_afterwards(workers):
    key = run_key()
    first = tasks.hold_dedupe.delay(key, 2)
    with pytest.raises(AlreadyQueued):
        tasks.hold_dedupe.delay(key, 0)
    wait_for_run(key)  # now running
    with pytest.raises(AlreadyQueued):
        tasks.hold_dedupe.delay(key, 0)
    first.get(timeout=30)
    tasks.hold_dedupe.delay(key, 0).get(timeout=30)
    assert TaskRun.objects.filter(key=key).count() == 2


def test_dedupe_marker_expires_after_its_ttl(workers):
    key = run_key()
    # A queue no worker consumes: the call stays queued, its run never releases the marker.
    tasks.hold_dedupe_short.apply_async((key,), queue=f"nobody-{key}")
    with pytest.raises(AlreadyQueued):
        tasks.hold_dedupe_short.apply_async((key,), queue=f"nobody-{key}")
    time.sleep(1.6)
    tasks.hold_dedupe_short.apply_async((key,), queue=f"nobody-{key}")


def test_revoked_queued_call_releases_its_marker(workers):
    key = run_key()
    result = tasks.hold_dedupe.apply_async((key,), countdown=2)
    result.revoke()
    # dedupe_ttl is 30 s: accepted within seconds means the worker released the revoked call's marker.
    wait_until(lambda: accepted(tasks.hold_dedupe, key), 10, "the marker of the revoked call to be released")
    assert TaskRun.objects.filter(key=key).count() <= 1


def accepted(task, key):
    try:
        task.delay(key)
    except AlreadyQueued:
        return False
    return True



RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"


@pytest.fixture(scope="module")
def rabbitmq_worker(django_db_setup):
    """A worker on the machine's RabbitMQ, if one answers, consuming a queue of its own (deleted afterwards)."""
    if not port_open(5672):
        pytest.skip("no RabbitMQ on 127.0.0.1:5672")
    require_alias("redis")
    queue = f"distlock-test-amqp-{uuid.uuid4().hex[:8]}"
    worker = CeleryWorker(f"distlock-test-amqp-{uuid.uuid4().hex[:6]}", broker=RABBITMQ_URL, queue=queue)
    try:
        yield worker.start(), queue
    finally:
        worker.cleanup()
        with app.connection_for_write(RABBITMQ_URL) as connection:
            connection.default_channel.queue_delete(queue)
            connection.default_channel.exchange_delete(queue)


def test_rabbitmq_broker_one_key_one_run_at_a_time(rabbitmq_worker):
    """Bonus: the same guarantee with RabbitMQ as the broker (results still on the test Redis)."""
    _, queue = rabbitmq_worker
    key = run_key()
    with app.connection_for_write(RABBITMQ_URL) as connection, connection.Producer() as producer:
        results = [tasks.HOLD["redis"].apply_async((key, 0.05), queue=queue, producer=producer) for _ in range(8)]
    for result in results:
        result.get(timeout=60)
    runs = list(TaskRun.objects.filter(key=key).order_by("started_ns"))
    assert len(runs) == 8
    for before, after in zip(runs, runs[1:]):
        assert before.finished_ns < after.started_ns and before.token < after.token
