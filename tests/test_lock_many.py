"""``lock_many()``: canonical order, all or nothing within one timeout, the ``LeaseSet``, fenced rows, the hierarchy."""

import threading
import time

import pytest

import distlock
from distlock import Lease, LeaseSet, LockError, LockNotAcquired, LockOrderError
from distlock.checks import check_hierarchy_setting
from distlock.handler import locks
from distlock.signals import lock_acquired, lock_released
from tests.conftest import free
from tests.fencing_app.models import Account, LooseAccount
from tests.fencing_workers import Worker


@pytest.fixture
def names(lock_name):
    """Three names of this test, in their canonical (sorted) order."""
    return [f"{lock_name}:a", f"{lock_name}:b", f"{lock_name}:c"]


@pytest.fixture
def backend_calls(backend_alias, monkeypatch):
    """The names the alias's backend is asked to acquire, in order; ``fail[name]`` makes its acquire raise that."""
    backend = locks[backend_alias]
    calls, fail = [], {}
    real = backend.acquire

    def acquire(name, **kwargs):
        calls.append(name)
        if name in fail:
            raise fail[name]
        return real(name, **kwargs)

    monkeypatch.setattr(backend, "acquire", acquire)
    return calls, fail


# -- order, duplicates, the set ---------------------------------------------------------------------------

def test_names_are_taken_in_canonical_order_whatever_the_order_given(backend_alias, names, backend_calls):
    calls, _ = backend_calls
    a, b, c = names
    with distlock.lock_many([c, a, b], ttl=10, timeout=5, using=backend_alias) as leases:
        assert calls == [a, b, c]
        assert isinstance(leases, LeaseSet)
        assert [lease.name for lease in leases.leases] == [a, b, c]
        assert leases.names == (a, b, c)
        assert not any(free(backend_alias, name) for name in names)
    assert all(free(backend_alias, name) for name in names)


def test_a_name_given_twice_is_one_lock(backend_alias, names, backend_calls):
    calls, _ = backend_calls
    a, b, _ = names
    decomposed = "cafe\u0301"  # "café" as "e" and a combining accent: the same lock as "caf\u00e9"
    with distlock.lock_many([b, a, b, f"{a}:{decomposed}", f"{a}:caf\u00e9"], ttl=10, timeout=5,
                            using=backend_alias) as leases:
        assert leases.names == (a, f"{a}:caf\u00e9", b)
    assert calls == [a, f"{a}:caf\u00e9", b]


@pytest.mark.parametrize(("given", "error", "words"), [
    ("account:7", TypeError, "iterable of lock names"),
    ([], ValueError, "at least one lock name"),
    (["account:7", ""], ValueError, "must not be empty"),
    (["account:7", 7], TypeError, "must be a str"),
])
def test_names_are_checked_before_any_io(given, error, words):
    with pytest.raises(error, match=words):
        distlock.lock_many(given, ttl=10)


def test_options_are_checked_before_any_io():
    with pytest.raises(ValueError, match="ttl must be above zero"):
        distlock.lock_many(["a", "b"], ttl=-1)
    with pytest.raises(TypeError, match="blocking must be True or False"):
        distlock.lock_many(["a", "b"], blocking="yes")


def test_token_for_lease_for_and_a_readable_repr(backend_alias, names):
    a, b, c = names
    with distlock.lock_many([a, b], ttl=10, timeout=5, using=backend_alias) as leases:
        first, second = leases.leases
        assert (leases.token_for(a), leases.token_for(b)) == (first.token, second.token)
        assert leases.lease_for(b) is second
        with pytest.raises(KeyError, match=f"{c!r} is not one of the locks of <LeaseSet"):
            leases.token_for(c)
        shown = repr(leases)
        assert shown == (f"<LeaseSet alias={backend_alias!r} [{a!r} token={first.token}, {b!r} "
                         f"token={second.token}] held>")
        assert first.owner not in shown and second.owner not in shown
    assert repr(leases).endswith(" released>")


def test_lost_once_any_member_is_lost(backend_alias, names):
    with distlock.lock_many(names, ttl=10, timeout=5, using=backend_alias) as leases:
        assert not leases.lost
        leases.leases[1].mark_lost("lost on purpose by the test")
        assert leases.lost
        assert repr(leases).endswith(" lost>")
        with pytest.raises(distlock.LockLost):
            leases.check()


def test_release_is_last_taken_first(backend_alias, names):
    released = []

    def record(lease, **kwargs):
        released.append(lease.name)

    lock_released.connect(record, weak=False)
    try:
        with distlock.lock_many(names, ttl=10, timeout=5, using=backend_alias):
            pass
        assert released == names[::-1]
        released.clear()
        leases = distlock.lock_many(names, ttl=10, timeout=5, using=backend_alias).__enter__()
        assert leases.release() is True
        assert released == names[::-1]
        assert leases.release() is False, "a second release deletes nothing"
    finally:
        lock_released.disconnect(record)
    assert all(free(backend_alias, name) for name in names)


def test_as_a_decorator_each_call_holds_the_set(backend_alias, names):
    @distlock.lock_many(names[::-1], ttl=10, timeout=5, using=backend_alias)
    def transfer():
        return [free(backend_alias, name) for name in names]

    assert transfer() == [False, False, False]
    assert transfer() == [False, False, False]
    assert all(free(backend_alias, name) for name in names)


# -- all or nothing --------------------------------------------------------------------------------------

def test_a_timeout_holds_nothing_afterwards(backend_alias, names):
    a, b, c = names
    blocker = distlock.acquire(b, ttl=30, using=backend_alias)
    try:
        started = time.monotonic()
        with pytest.raises(LockNotAcquired):
            distlock.lock_many([c, b, a], ttl=10, timeout=0.5, using=backend_alias).__enter__()
        assert time.monotonic() - started < 5
        assert free(backend_alias, a), "the lock taken before the timeout was released"
        assert free(backend_alias, c), "the lock after the busy one was never taken"
        assert not free(backend_alias, b), "the other holder still holds its lock"
        with pytest.raises(LockNotAcquired):
            distlock.lock_many([a, b], blocking=False, using=backend_alias).__enter__()
        assert free(backend_alias, a)
    finally:
        blocker.release()


def test_one_timeout_covers_the_whole_set(backend_alias, names):
    """``a`` is freed 0.6 s in, ``b`` never: the set fails about 1 s in, not 1 s after ``a`` was taken."""
    a, b, _ = names
    holder_a = distlock.acquire(a, ttl=30, using=backend_alias)
    holder_b = distlock.acquire(b, ttl=30, using=backend_alias)
    timer = threading.Timer(0.6, holder_a.release)
    timer.start()
    try:
        started = time.monotonic()
        with pytest.raises(LockNotAcquired):
            distlock.lock_many([a, b], ttl=10, timeout=1.0, using=backend_alias).__enter__()
        elapsed = time.monotonic() - started
        assert 0.9 <= elapsed < 1.5, f"gave up after {elapsed:.2f}s; one timeout of 1s for the set"
        assert free(backend_alias, a)
    finally:
        timer.join()
        holder_b.release()


@pytest.mark.parametrize("auto_renew", [False, True])
@pytest.mark.parametrize("exception", [KeyboardInterrupt, distlock.BackendUnavailable])
def test_an_exception_before_the_second_grant_releases_the_first(backend_alias, names, backend_calls, exception,
                                                                 auto_renew):
    calls, fail = backend_calls
    a, b, c = names
    fail[b] = exception("injected between two acquisitions")
    with pytest.raises(exception, match="injected"):
        distlock.lock_many([c, b, a], ttl=10, timeout=5, auto_renew=auto_renew, using=backend_alias).__enter__()
    assert calls == [a, b], "stopped at the failure"
    del fail[b]
    assert all(free(backend_alias, name) for name in names)


def test_an_interrupt_after_the_second_grant_releases_both(backend_alias, names):
    """The interrupt lands in acquire() itself, once the second lock is ours (a lock_acquired receiver)."""
    a, b, _ = names

    def interrupt(lease, **kwargs):
        if lease.name == b:
            raise KeyboardInterrupt

    lock_acquired.connect(interrupt, weak=False)
    try:
        with pytest.raises(KeyboardInterrupt):
            distlock.lock_many([b, a], ttl=10, timeout=5, auto_renew=True, using=backend_alias).__enter__()
    finally:
        lock_acquired.disconnect(interrupt)
    assert free(backend_alias, a) and free(backend_alias, b)


def test_a_member_expired_while_the_others_were_awaited_fails_the_set(backend_alias, names, monkeypatch):
    a, b, _ = names
    # The first lease reads as lost (its ttl ran out) once the last one is taken.
    monkeypatch.setattr(Lease, "lost", property(lambda lease: lease.name == a and not lease.released))
    with pytest.raises(LockNotAcquired, match=f"lock {a!r} ran out of its ttl"):
        distlock.lock_many([a, b], ttl=10, timeout=5, using=backend_alias).__enter__()
    monkeypatch.undo()
    assert free(backend_alias, a) and free(backend_alias, b)


# -- the hierarchy -----------------------------------------------------------------------------------------

@pytest.fixture
def hierarchy(settings, lock_name):
    """A hierarchy of this test's names: ``bank`` (coarse) before ``account`` (fine)."""
    bank, account = f"{lock_name}:bank:", f"{lock_name}:account:"
    settings.DISTLOCK_HIERARCHY = [bank, account]
    return bank, account


def test_a_coarser_lock_after_a_finer_one_raises_lock_order_error(backend_alias, hierarchy):
    bank, account = hierarchy
    with distlock.lock(f"{account}7", ttl=10, using=backend_alias):
        for take in (lambda: distlock.acquire(f"{bank}1", ttl=10, using=backend_alias),
                     lambda: distlock.lock(f"{bank}1", ttl=10, using=backend_alias).__enter__(),
                     lambda: distlock.lock_many([f"{account}8", f"{bank}1"], ttl=10, using=backend_alias).__enter__()):
            with pytest.raises(LockOrderError) as raised:
                take()
            assert isinstance(raised.value, LockError)
            assert f"'{bank}1'" in str(raised.value) and f"'{account}7'" in str(raised.value)
            assert (raised.value.name, raised.value.held) == (f"{bank}1", f"{account}7")
            assert free(backend_alias, f"{bank}1") and free(backend_alias, f"{account}8"), "raised before any I/O"


def test_the_right_order_passes(backend_alias, hierarchy, lock_name):
    bank, account = hierarchy
    with distlock.lock(f"{bank}1", ttl=10, using=backend_alias):
        with distlock.lock(f"{account}7", ttl=10, using=backend_alias):
            with distlock.lock(f"{account}8", ttl=10, using=backend_alias):  # the same level
                with distlock.lock(f"{lock_name}:unranked", ttl=10, using=backend_alias):
                    pass
    with distlock.lock(f"{account}7", ttl=10, using=backend_alias):
        pass
    with distlock.lock(f"{bank}1", ttl=10, using=backend_alias):  # the finer lock was released
        pass


def test_lock_many_takes_coarse_levels_first(backend_alias, hierarchy, lock_name):
    bank, account = hierarchy
    given = [f"{lock_name}:unranked", f"{account}7", f"{bank}2", f"{account}3", f"{bank}1"]
    with distlock.lock_many(given, ttl=10, timeout=5, using=backend_alias) as leases:
        assert leases.names == (f"{bank}1", f"{bank}2", f"{account}3", f"{account}7", f"{lock_name}:unranked")
        with distlock.lock(f"{account}9", ttl=10, using=backend_alias):
            pass


def test_what_another_thread_holds_does_not_count(backend_alias, hierarchy):
    bank, account = hierarchy
    held, done = threading.Event(), threading.Event()

    def hold_finer():
        with distlock.lock(f"{account}7", ttl=10, using=backend_alias):
            held.set()
            done.wait(10)

    thread = threading.Thread(target=hold_finer)
    thread.start()
    try:
        assert held.wait(10)
        with distlock.lock(f"{bank}1", ttl=10, using=backend_alias):
            pass
    finally:
        done.set()
        thread.join()


@pytest.mark.parametrize("value", [
    "bank:",
    ["bank:", ""],
    ["bank:", 3],
    ("bank:", "account:", "bank:"),
])
def test_a_bad_hierarchy_is_a_system_check_error_and_raises_nothing_at_run_time(settings, value):
    settings.DISTLOCK_HIERARCHY = value
    errors = check_hierarchy_setting()
    assert [error.id for error in errors] == ["distlock.E008"]
    assert "DISTLOCK_HIERARCHY" in errors[0].msg
    with distlock.lock("bank:1", ttl=10, using="locmem"), distlock.lock_many(["account:1", "bank:2"], using="locmem"):
        pass


def test_a_good_hierarchy_passes_the_check(settings):
    assert check_hierarchy_setting() == []
    settings.DISTLOCK_HIERARCHY = ["bank:", "bank:account:"]
    assert check_hierarchy_setting() == []


# -- fenced rows -------------------------------------------------------------------------------------------

def safe_tokens(alias):
    if not locks[alias].token_is_safe:
        pytest.skip(f"alias {alias!r} issues no safe fencing tokens")


def test_claim_and_save_fence_each_row_with_its_own_lock(backend_alias):
    safe_tokens(backend_alias)
    source, target = Account.objects.create(balance=100), Account.objects.create(balance=0)
    with distlock.lock_many([f"account:{target.pk}", f"account:{source.pk}"], ttl=10, timeout=5,
                            using=backend_alias) as leases:
        paying = Account.objects.claim(leases, pk=source.pk)
        paid = Account.objects.claim(leases, id=target.pk)
        paying.balance, paid.balance = 70, 30
        paying.save(lease=leases)
        paid.save(lease=leases)
    rows = {row.pk: row for row in Account.objects.all()}
    assert (rows[source.pk].balance, rows[source.pk].fencing_token) == (70, leases.token_for(f"account:{source.pk}"))
    assert (rows[target.pk].balance, rows[target.pk].fencing_token) == (30, leases.token_for(f"account:{target.pk}"))


def test_a_row_whose_lock_is_not_in_the_set_is_refused(backend_alias):
    safe_tokens(backend_alias)
    mine, other = Account.objects.create(balance=1), Account.objects.create(balance=2)
    with distlock.lock_many([f"account:{mine.pk}"], ttl=10, timeout=5, using=backend_alias) as leases:
        with pytest.raises(ValueError, match=f"Account pk={other.pk}.*lock 'account:{other.pk}'.*<LeaseSet"):
            Account.objects.claim(leases, pk=other.pk)
        other.balance = 5
        with pytest.raises(ValueError, match=f"Account pk={other.pk}.*<LeaseSet"):
            other.save(lease=leases)
        with pytest.raises(TypeError, match="needs 'pk'"):
            Account.objects.claim(leases, balance=1)
        with pytest.raises(TypeError, match="set lock_name_template"):
            LooseAccount.objects.claim(leases, pk=mine.pk)
        with pytest.raises(TypeError, match="lease_for"):
            Account.objects.filter(pk=mine.pk).fenced_update(leases, balance=3)
    assert Account.objects.get(pk=other.pk).balance == 2


# -- no deadlock between opposite-order transfers ---------------------------------------------------------

#: Transfers per process; each process must be done within ``TRANSFER_BOUND`` seconds.
TRANSFERS = 200
TRANSFER_BOUND = 120


@pytest.mark.slow
def test_opposite_order_transfers_never_deadlock_and_keep_the_sum(shared_alias):
    """Two processes, 200 transfers each between the same two accounts, naming them in opposite orders."""
    safe_tokens(shared_alias)
    x, y = Account.objects.create(balance=1000), Account.objects.create(balance=1000)
    common = dict(lock_alias=shared_alias, db="default", count=TRANSFERS, ttl=30, timeout=TRANSFER_BOUND / 2)
    forward = Worker("transfers", **common, source=x.pk, target=y.pk, amount=3)
    backward = Worker("transfers", **common, source=y.pk, target=x.pk, amount=5)
    try:
        for worker in (forward, backward):
            assert worker.next_event()["event"] == "ready"
        forward.go()
        backward.go()
        done = [forward.finish(timeout=TRANSFER_BOUND)[-1], backward.finish(timeout=TRANSFER_BOUND)[-1]]
    finally:
        forward.kill()
        backward.kill()
    assert [event["count"] for event in done] == [TRANSFERS, TRANSFERS]
    first, second = sorted(done, key=lambda event: event["started"])
    assert second["started"] < first["finished"], "the two processes ran their transfers at the same time"
    balances = dict(Account.objects.filter(pk__in=[x.pk, y.pk]).values_list("pk", "balance"))
    assert balances[x.pk] + balances[y.pk] == 2000
    assert balances == {x.pk: 1000 + 2 * TRANSFERS, y.pk: 1000 - 2 * TRANSFERS}, "no transfer lost"
