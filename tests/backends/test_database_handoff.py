"""How the database backend hands a contended lock over: waiters in arrival order, woken by NOTIFY on PostgreSQL."""

import logging
import signal
import threading
import time
import types

import pytest
from django.db import connections

import distlock
from distlock.backends._sql import WAITER_TTL
from distlock.handler import locks
from distlock.models import Lock, LockWaiter
from tests.conftest import record_tries, require_alias
from tests.servers import wait_until
from tests.workers import spawn

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

#: The seconds every wait of these tests may take at most: far beyond a hand-off, never reached when they pass.
PATIENCE = 20


@pytest.fixture(params=["default", "postgres"])
def db_alias(request):
    """The database backend on SQLite (``default``) and on PostgreSQL (``postgres``)."""
    return require_alias(request.param)


def queued(alias, name):
    """Return the owners queued for lock ``name``, first come first."""
    return list(LockWaiter.objects.using(locks[alias].database).filter(name=name).order_by("id")
                .values_list("owner", flat=True))


class Waiter:
    """A thread blocking in ``distlock.acquire(name)``; it records its lease (or error) and releases at once."""

    def __init__(self, alias, name, order, label, timeout=PATIENCE):
        self.lease = self.error = None
        self._thread = threading.Thread(target=self._run, args=(alias, name, order, label, timeout), daemon=True)
        self._thread.start()

    def _run(self, alias, name, order, label, timeout):
        try:
            self.lease = distlock.acquire(name, ttl=30, timeout=timeout, using=alias)
            order.append(label)
            self.lease.release()
        except Exception as exc:  # noqa: BLE001 - asserted by the test
            self.error = exc
        finally:
            connections.close_all()

    def join(self):
        self._thread.join(PATIENCE + 5)
        assert not self._thread.is_alive(), "the waiter is still waiting"
        assert self.error is None, repr(self.error)


def test_waiters_get_the_lock_in_arrival_order_and_a_releaser_that_comes_back_queues_last(db_alias, lock_name):
    """FIFO: three waiters queued one after the other, then the holder asking again right after its release."""
    holder = distlock.acquire(lock_name, ttl=30, using=db_alias)
    order, waiters = [], []
    for label in ("first", "second", "third"):
        waiters.append(Waiter(db_alias, lock_name, order, label))
        wait_until(lambda: len(queued(db_alias, lock_name)) == len(waiters), PATIENCE, f"the {label} waiter queued")

    assert holder.release() is True
    again = distlock.acquire(lock_name, ttl=30, timeout=PATIENCE, using=db_alias)
    order.append("holder again")
    again.release()
    for waiter in waiters:
        waiter.join()

    assert order == ["first", "second", "third", "holder again"]
    assert queued(db_alias, lock_name) == []


def test_a_waiter_killed_while_queued_holds_the_lock_up_for_its_place_ttl_at_most(db_alias, lock_name):
    """A SIGKILLed waiter first in line: its place expires within WAITER_TTL, and the next waiter gets the lock."""
    holder = distlock.acquire(lock_name, ttl=30, using=db_alias)
    doomed = spawn("hammer", alias=db_alias, name=lock_name, count=1, ttl=10)
    try:
        wait_until(lambda: len(queued(db_alias, lock_name)) == 1, PATIENCE, "the other process queued")
        order = []
        # Its timeout is what the test allows: the dead place's WAITER_TTL and a few polls, never the holder's ttl.
        waiter = Waiter(db_alias, lock_name, order, "next", timeout=WAITER_TTL + 5)
        wait_until(lambda: len(queued(db_alias, lock_name)) == 2, PATIENCE, "the waiter queued behind it")
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(PATIENCE)
        assert holder.release() is True
        waiter.join()
        assert order == ["next"]
    finally:
        if doomed.poll() is None:
            doomed.kill()
        doomed.communicate()


# -- PostgreSQL: NOTIFY -------------------------------------------------------------------------------------

def listener_of(alias):
    return locks[alias]._listener


def listening_pid(alias):
    """The server pid of the listening connection, or None while it is not listening."""
    listener = listener_of(alias)
    wrapper = listener.wrapper
    if not listener.listening or wrapper is None or wrapper.connection is None:
        return None
    return wrapper.connection.info.backend_pid


def test_a_release_notification_wakes_a_waiter_long_before_its_next_poll(lock_name, caplog, monkeypatch):
    """The waiter's back-off is stretched to its whole timeout, longer than the test waits: only the notification
    can hand it the lock in time."""
    alias = require_alias("postgres")
    backend = locks[alias]
    monkeypatch.setattr(backend, "_back_off", types.MethodType(lambda self, attempt, remaining: remaining, backend))
    holder = distlock.acquire(lock_name, ttl=30, using=alias)
    order = []
    with caplog.at_level(logging.DEBUG, logger="distlock.backends.database"):
        waiter = Waiter(alias, lock_name, order, "woken", timeout=3 * PATIENCE)
        wait_until(lambda: len(queued(alias, lock_name)) == 1 and listening_pid(alias) is not None, PATIENCE,
                   "the waiter queued, and its process listening")
        assert holder.release() is True
        waiter.join()
    assert order == ["woken"]
    woken = [record for record in caplog.records if record.getMessage() == (
        f"Lock {lock_name!r} (alias {alias!r}): a release notification woke the waiter.")]
    assert woken, [record.getMessage() for record in caplog.records]


def test_a_lock_freed_without_notification_is_handed_over_by_polling(lock_name):
    """The waiter listens, but the lock is freed behind the protocol's back (a plain DELETE sends no NOTIFY).

    Its timeout is longer than the test waits for it: a last try at the deadline would hand it the lock
    without any polling.
    """
    alias = require_alias("postgres")
    holder = distlock.acquire(lock_name, ttl=30, using=alias)
    order = []
    waiter = Waiter(alias, lock_name, order, "polled", timeout=3 * PATIENCE)
    wait_until(lambda: len(queued(alias, lock_name)) == 1 and listening_pid(alias) is not None, PATIENCE,
               "the waiter queued, and its process listening")
    assert Lock.objects.using(locks[alias].database).filter(name=lock_name, owner=holder.owner).delete()[0] == 1
    waiter.join()
    assert order == ["polled"]


def test_a_cut_listening_connection_is_replaced_and_a_waiter_meanwhile_still_gets_the_lock(lock_name):
    """pg_terminate_backend on the listening connection while a waiter waits: the lock still changes hands."""
    alias = require_alias("postgres")
    holder = distlock.acquire(lock_name, ttl=30, using=alias)
    order = []
    waiter = Waiter(alias, lock_name, order, "waiter")
    wait_until(lambda: len(queued(alias, lock_name)) == 1 and listening_pid(alias) is not None, PATIENCE,
               "the waiter queued, and its process listening")
    cut = listening_pid(alias)
    with connections[locks[alias].database].cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [cut])
        assert cursor.fetchone() == (True,)
    assert holder.release() is True
    waiter.join()
    assert order == ["waiter"]
    wait_until(lambda: listening_pid(alias) not in (None, cut), PATIENCE, "the listener on a new connection")


def test_the_sqlite_waiter_first_in_line_polls_less_as_the_hold_goes_on(lock_name, monkeypatch):
    """Each poll takes SQLite's one write slot: a 3 s hold is polled about 100 times, not 400 (10 ms pauses)."""
    alias = require_alias("default")
    tries = record_tries(locks[alias], monkeypatch)
    holder = distlock.acquire(lock_name, ttl=30, using=alias)
    order = []
    waiter = Waiter(alias, lock_name, order, "waiter")
    wait_until(lambda: queued(alias, lock_name), PATIENCE, "the waiter queued")
    time.sleep(3)  # the hold itself
    assert holder.release() is True
    waiter.join()
    assert order == ["waiter"]
    assert len(tries) < 200, f"{len(tries)} tries during a 3 s hold"
