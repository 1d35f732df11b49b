"""Auto-renewal of many leases: one scheduler per alias, not a thread per lease."""

import os
import threading
from collections import Counter

import pytest

import distlock
from distlock.handler import locks
from distlock.renewal import renewing
from tests.conftest import require_alias
from tests.servers import wait_until

ALIAS = "locmem"
LEASES = 1000
#: Seconds to wait for the scheduler's effects (bounded polls only).
WAIT = 30


@pytest.fixture
def extensions(monkeypatch):
    """Count the extensions of each lease (by owner) on the locmem alias."""
    backend = locks[ALIAS]
    extend = backend.extend
    counted = Counter()

    def counting_extend(lease, ttl):
        counted[lease.owner] += 1
        return extend(lease, ttl)

    monkeypatch.setattr(backend, "extend", counting_extend)
    return counted


def acquire_many(prefix, **kwargs):
    return [distlock.acquire(f"{prefix}:{index}", auto_renew=True, using=ALIAS, **kwargs) for index in range(LEASES)]


def test_a_thousand_renewed_leases_add_one_thread_and_stay_held(lock_name, extensions):
    distlock.acquire(f"{lock_name}:warm-up", using=ALIAS).release()  # the threads of any lock: metrics
    before = threading.active_count()
    leases = acquire_many(lock_name, ttl=1.5)
    try:
        assert threading.active_count() - before <= 1, "one scheduler thread for the alias, not one per lease"
        # Three extensions each: 1 s of a 1.5 s ttl, which the leases outlive only by being renewed.
        wait_until(lambda: all(extensions[lease.owner] >= 3 for lease in leases), WAIT,
                   "three extensions of every lease")
        for lease in leases:
            lease.check()
        assert len(renewing(ALIAS)) >= LEASES
    finally:
        for lease in leases:
            lease.release()
    wait_until(lambda: not renewing(ALIAS), WAIT, "the end of every renewal after the releases")
    wait_until(lambda: threading.active_count() <= before, WAIT, "the scheduler thread ending with its last lease")


def test_max_hold_releases_and_marks_lost_each_of_a_thousand_leases(lock_name):
    leases = acquire_many(lock_name, ttl=1, max_hold=1.5)
    wait_until(lambda: all(lease.lost_reason is not None for lease in leases), WAIT, "every lease stopped at max_hold")
    assert {lease.lost_reason for lease in leases} == {"max_hold reached: renewal stopped and the lock was released"}
    assert locks[ALIAS].held_locks(lock_name) == []


def test_a_lease_lost_among_many_is_reported_and_the_others_stay_renewed(lock_name, extensions):
    leases = acquire_many(lock_name, ttl=1.5)
    lost = []

    def receiver(lease, reason, **kwargs):
        lost.append(lease)

    distlock.signals.lock_lost.connect(receiver)
    try:
        victim = leases[LEASES // 2]
        locks[ALIAS].release_owned(victim.name, victim.owner)  # an operator took it away
        wait_until(lambda: victim in lost, WAIT, "lock_lost for the lease taken away")
        counts = {lease.owner: extensions[lease.owner] for lease in leases}
        wait_until(lambda: all(extensions[lease.owner] > counts[lease.owner] for lease in leases if lease is not victim),
                   WAIT, "another extension of every other lease")
        assert lost == [victim]
        for lease in leases:
            if lease is not victim:
                lease.check()
    finally:
        distlock.signals.lock_lost.disconnect(receiver)
        for lease in leases:
            lease.release()


def test_a_dropped_lease_stops_its_renewal(lock_name, extensions):
    lease = distlock.acquire(lock_name, ttl=1.5, auto_renew=True, using=ALIAS)
    owner = lease.owner
    wait_until(lambda: extensions[owner] >= 1, WAIT, "a first extension")
    del lease
    wait_until(lambda: not [held for held in renewing(ALIAS) if held.name == lock_name], WAIT,
               "the renewal of the dropped lease ending")
    wait_until(lambda: locks[ALIAS].held_locks(lock_name) == [], WAIT, "the dropped lease expiring on the server")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_starts_with_no_renewals_and_leaves_the_parent_s_alone(lock_name, extensions):
    lease = distlock.acquire(lock_name, ttl=1.5, auto_renew=True, using=ALIAS)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it renews, then end without running any test teardown
        os.close(read)
        os.write(write, str(len(renewing())).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as child_report:
        renewed_in_child = int(child_report.read())
    os.waitpid(pid, 0)
    try:
        assert renewed_in_child == 0
        count = extensions[lease.owner]
        wait_until(lambda: extensions[lease.owner] > count, WAIT, "the parent's next extension")
        lease.check()
    finally:
        lease.release()


@pytest.mark.django_db(transaction=True, databases="__all__")
@pytest.mark.parametrize("alias", ["redis", "default", "postgres"])
def test_once_on_their_renewal_clock_many_leases_take_one_call_per_round(alias, lock_name, monkeypatch):
    """Redis: one round trip (EXTEND_MANY in chunks, pipelined); the database: one UPDATE (SQLite: per 500).

    However spread the acquisitions, each lease's first extension puts it on its alias's renewal
    clock; from then on a round is one call for all of them.
    """
    require_alias(alias)
    backend = locks[alias]
    extend_many, rounds, single = backend.extend_many, [], []
    extended = Counter()

    def counting_extend_many(requests):
        rounds.append(len(requests))
        extended.update(lease.owner for lease, _ in requests)
        return extend_many(requests)

    monkeypatch.setattr(backend, "extend_many", counting_extend_many)
    monkeypatch.setattr(backend, "_do_extend", lambda lease, ttl: single.append(lease))
    leases = [distlock.acquire(f"{lock_name}:{index}", ttl=1.5, auto_renew=True, using=alias)
              for index in range(LEASES)]
    try:
        wait_until(lambda: all(extended[lease.owner] for lease in leases), WAIT, "a first extension of every lease")
        on_clock = len(rounds)
        wait_until(lambda: all(extended[lease.owner] >= 4 for lease in leases), WAIT,
                   "three more extensions of every lease")
        for lease in leases:
            lease.check()
        assert len(rounds) - on_clock <= 6, f"rounds of {rounds[on_clock:]} extensions once on the clock"
        assert single == []
    finally:
        for lease in leases:
            lease.release()
