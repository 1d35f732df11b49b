"""Running a backend's operations where an exception raised in the caller cannot cut them short.

Client libraries (kazoo, gRPC) are not safe against exceptions raised asynchronously on the thread
that calls them: a signal handler that raises (Celery's soft time limit, gunicorn's worker handlers,
any ``SIGALRM`` handler) between two of their lines can leave a request queue, a reply condition or
an internal lock half-updated, hanging every later call of the process, or leave a grant that nobody
will give back. Python runs signal handlers on the main thread only, so ``Offloader.call`` hands an
operation called on the main thread of a process with such a handler installed
(``signals_can_raise()``: any Python-level handler but the default ``SIGINT`` one) to a runner
thread (``ThreadRunner``) through a C ``SimpleQueue`` (a ``put`` that never blocks and takes no
Python-level lock), and the caller waits on a plain lock, whose acquisition an exception can
interrupt without leaving anything taken. An interrupted caller hands a clean-up to the runner: it
cancels the operation (``Job.cancelled``, ``Job.wake``: a backend's waits may watch them) and, once
the operation ends, gives back whatever it was granted (``give_back``). Calls from other threads run
inline (no signal reaches them). Under gevent or eventlet every operation runs in a green thread of
its own (``GreenRunner``): a ``Timeout`` raised in the caller's green thread (a task's hard time
limit) is handled the same way. (Deferring signals with ``pthread_sigmask`` was the alternative; it
only works on the main thread, cannot cover a library's blocking waits without delaying the time
limit itself, and does nothing for green ``Timeout``s.)

The asyncio API (``distlock.aacquire``, ``alock``, ``Lease.arelease``...) offloads the same way, for
the event loop's sake: each server call runs on a thread of one process-wide pool (``submit``), in a
copy of the caller's ``contextvars`` context, while the coroutine waits on the loop. The pool is not
Django's ``sync_to_async``: its thread-sensitive mode runs every call on one thread, so one slow
server call would hold up every coroutine's. A coroutine cancelled while its call runs leaves the
call running to its end; whoever cancels it decides what to do with the result (``finish`` lets it
complete, the acquire loop gives back what it was granted).
"""

import _signal
import asyncio
import contextvars
import logging
import os
import queue
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from distlock.backends.green import Daemon

__all__ = [
    "ASYNC_WORKERS",
    "Abandoned",
    "GreenRunner",
    "IDLE_RUNNERS",
    "Inline",
    "Job",
    "Offloader",
    "ThreadRunner",
    "finish",
    "signals_can_raise",
    "submit",
]

logger = logging.getLogger(__name__)

#: Idle runner threads kept per backend for main-thread callers.
IDLE_RUNNERS = 2

_SIGNALS = tuple(signal.valid_signals())


def signals_can_raise():
    """Return True if a Python-level signal handler is installed, other than the default ``SIGINT`` one.

    Only such a handler can raise between two lines of a client library (a Celery pool child's soft time limit,
    gunicorn's worker handlers, a ``SIGALRM`` timeout). Ctrl-C's ``KeyboardInterrupt`` ends the
    process in practice, and handing every call over costs a thread switch each way (a third of the
    throughput of uncontended acquire+release on a busy 2-core machine), so it is left out. One C call
    per signal, through ``_signal``: ``signal.getsignal`` turns every answer into an enum member in
    Python, which made this check a visible share of an uncontended etcd or ZooKeeper acquire.
    """
    for signum in _SIGNALS:
        handler = _signal.getsignal(signum)
        if callable(handler) and handler is not signal.default_int_handler:
            return True
    return False


class Abandoned(Exception):
    """The caller of this operation was interrupted and went away: stop, withdrawing what was queued."""


class Job:
    """One backend operation run for a caller; ``cancelled`` and ``wake`` let a clean-up stop its waits."""

    def __init__(self, fn, *, caller_lock=False):
        self.fn = fn
        self.value = self.error = None
        self.cancelled = False
        #: The Event a blocking acquire waits on, set by ``cancel()``.
        self.wake = None
        #: Set once the runner took the job (runner threads only): a job never taken has nothing to undo.
        self.dispatched = False
        #: Set when the job has ended (runner threads wait on it; green callers too).
        self.finished = threading.Event()
        #: Thread mode: released when the job has ended. The caller waits by acquiring it: an exception
        #: can interrupt that acquisition without leaving anything taken, unlike a Condition's wait.
        self.done = None
        if caller_lock:
            self.done = threading.Lock()
            self.done.acquire()

    def run(self):
        try:
            self.value = self.fn(self)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, who re-raises it
            self.error = exc
        finally:
            self.finished.set()
            if self.done is not None:
                self.done.release()

    def cancel(self):
        self.cancelled = True
        wake = self.wake
        if wake is not None:
            wake.set()


class Inline:
    """The job of an operation run on the caller's own thread: never cancelled."""

    cancelled = False
    wake = None


class ThreadRunner:
    """Run main-thread callers' operations on threads that no signal handler can interrupt.

    Callers only ``put`` into a C ``SimpleQueue``; the dispatcher hands each job to an idle worker or
    starts one. Jobs are dispatched in order, so a clean-up submitted after its job knows for sure
    whether the job was ever taken (``dispatched``).
    """

    def __init__(self, name):
        self.pid = os.getpid()
        self._name = name
        self._jobs = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = []  # inboxes of idle workers
        self._stopped = False
        self._count = 0
        # Started by an interruptible caller: a ``Daemon`` does not wait for the thread to run.
        Daemon(self._dispatch, name=f"{name}:dispatch").start()

    def submit(self, job):
        self._jobs.put(job)

    def stop(self):
        self._jobs.put(None)

    def _dispatch(self):
        while True:
            job = self._jobs.get()
            with self._lock:
                if job is None:
                    self._stopped = True
                    idle, self._idle = self._idle, []
                else:
                    inbox = self._idle.pop() if self._idle else None
            if job is None:
                for inbox in idle:
                    inbox.put(None)
                return
            job.dispatched = True
            if inbox is None:
                inbox = queue.SimpleQueue()
                self._count += 1
                threading.Thread(target=self._work, args=(inbox,), name=f"{self._name}:{self._count}",
                                 daemon=True).start()
            inbox.put(job)

    def _work(self, inbox):
        while True:
            job = inbox.get()
            if job is None:
                return
            job.run()
            job = None
            with self._lock:
                if self._stopped or len(self._idle) >= IDLE_RUNNERS:
                    return
                self._idle.append(inbox)


class GreenRunner:
    """Run every operation in a green thread of its own: a ``Timeout`` in the caller's cannot cut it short."""

    def __init__(self, library):
        self.pid = os.getpid()
        if library == "gevent":
            import gevent  # noqa: PLC0415

            self._spawn = gevent.spawn
        else:
            import eventlet  # noqa: PLC0415

            self._spawn = eventlet.spawn

    def submit(self, job):
        job.dispatched = True  # spawning does not yield: no green Timeout can land in between
        self._spawn(job.run)

    def stop(self):
        pass


class Offloader:
    """One backend's runner: operations of main-thread callers (or of every green thread) run on it."""

    def __init__(self, alias, thread_name, green):
        self.alias = alias
        self._thread_name = thread_name
        #: "gevent" or "eventlet" if the process is monkey-patched by it (``green_library()``), else None.
        self._green = green
        self._runner = None

    def call(self, fn, *, give_back=None):
        """Return ``fn(job)``, run where no exception raised asynchronously in the caller can cut it short.

        ``give_back(value)`` gives back what ``fn`` returned if the caller is interrupted and cannot take it.
        """
        if self._green is None and (threading.current_thread() is not threading.main_thread()
                                    or not signals_can_raise()):
            return fn(Inline())
        runner = self._runner
        if runner is None or runner.pid != os.getpid():
            runner = self._runner = GreenRunner(self._green) if self._green else ThreadRunner(self._thread_name)
        job = Job(fn, caller_lock=self._green is None)
        try:
            runner.submit(job)
            if job.done is not None:
                job.done.acquire()
            else:
                job.finished.wait()
            if job.error is None:
                return job.value
        except BaseException:
            runner.submit(Job(partial(self._after_abandoned, job, give_back)))
            raise
        error, job.error = job.error, None
        raise error

    def _after_abandoned(self, job, give_back, _cleanup_job):
        """Runner: stop an operation whose caller was interrupted, then give back what it was granted."""
        job.cancel()
        if not job.dispatched:
            return  # never started
        job.finished.wait()
        if job.error is None and job.value is not None and give_back is not None:
            try:
                give_back(job.value)
            except BaseException:  # noqa: BLE001 - on a runner thread, nobody else would see it
                logger.exception("Giving back what an interrupted call on alias %r was granted failed.", self.alias)

    def stop(self):
        """Stop the runner's threads; a later call starts new ones."""
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.stop()


#: Threads of the asyncio API's pool, per process: the bound asyncio's own default executor uses. A
#: call waits for a free thread only while this many server calls are in flight at once.
ASYNC_WORKERS = min(32, (os.cpu_count() or 1) + 4)

_pool = None
_pool_lock = threading.Lock()


def _forget_pool():
    """In a forked child: the parent's pool threads do not exist here; the next call starts a pool."""
    global _pool, _pool_lock  # noqa: PLW0603
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def submit(fn, *args):
    """Start ``fn(*args)`` on a thread of the asyncio API's pool, in a copy of the caller's context; return its
    ``concurrent.futures.Future``.

    Await it with ``asyncio.wrap_future`` (a caller cancelled before the call started cancels it) or
    ``finish`` (the call always runs to its end).
    """
    global _pool  # noqa: PLW0603 - built at first use, dropped in a forked child
    pool = _pool
    if pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(ASYNC_WORKERS, thread_name_prefix="distlock-async")
            pool = _pool
    return pool.submit(contextvars.copy_context().run, fn, *args)


async def finish(future):
    """Return the result of the ``submit`` call ``future``; if the caller is cancelled, the call still ends."""
    return await asyncio.shield(asyncio.wrap_future(future))
