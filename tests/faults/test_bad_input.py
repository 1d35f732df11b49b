"""Bad input into every public entry point, on every backend: only documented exceptions, nothing left behind.

The fixed corpus of ``distlock.conformance.bad_input`` (what ``distlock verify`` runs) gives the rows of
the report; hypothesis then draws names, ttls, timeouts, flags and tokens at random for ``acquire``,
``lock``, ``read_lock``, ``write_lock``, ``Lease.extend``, ``claim``, ``save``, ``fenced_update`` and a
``single_instance_task`` key. Example counts are modest: this runs with every ``make test``.
"""

import math
import time
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import distlock
from distlock.celery import single_instance_task
from distlock.conformance.bad_input import ENTRY_POINTS, InputCheck, bad_input
from distlock.validation import MAX_NAME_LENGTH, MAX_SECONDS
from project.celery import app  # noqa: F401 - the app the task below registers with
from tests.conftest import require_alias
from tests.faults.conftest import DATABASES

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=DATABASES),
    # kazoo's connection thread draws from the global `random` on every wake-up (select jitter), so
    # hypothesis sees the state move while it generates an example and takes it for a strategy's doing.
    pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies"),
]

#: The contract suite's aliases (shared servers: these checks only take and release locks of their own).
ALIASES = {"postgres": "database (PostgreSQL)", "redis": "Redis", "redlock": "Redlock", "zookeeper": "ZooKeeper",
           "etcd": "etcd", "default": "database (SQLite)", "locmem": "locmem"}

FUZZ = settings(max_examples=30, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture
def prefix():
    return f"fuzz:{uuid.uuid4().hex[:8]}"


@pytest.mark.slow
@pytest.mark.parametrize("alias", list(ALIASES))
def test_bad_input_corpus(alias, prefix, fenced_store, safety):
    require_alias(alias)
    result = bad_input(alias, ALIASES[alias], prefix, store=fenced_store)
    if alias in ("default", "locmem"):
        assert result.ok, result.violations  # not in the report: it covers the five backends of issue 7
    else:
        assert safety.record(result).ok, result.violations


def names(prefix):
    """Lock names: mostly under ``prefix`` (valid or not), around the length limit, or not a str at all."""
    return st.one_of(
        st.text(max_size=40).map(lambda text: f"{prefix}:{text}"),
        st.integers(MAX_NAME_LENGTH - len(prefix) - 3, MAX_NAME_LENGTH - len(prefix) + 1).map(
            lambda size: f"{prefix}:" + "n" * size),
        st.sampled_from(["", "\x00", "\ud800", "/", ".."]),
        st.binary(max_size=8), st.integers(), st.none(), st.floats(), st.lists(st.text(max_size=2), max_size=2),
    )


SECONDS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 10**12), st.none(), st.booleans(),
    st.text(max_size=3), st.just(MAX_SECONDS), st.just(MAX_SECONDS + 1), st.just(math.ulp(0.0)),
)
JUNK = st.one_of(st.none(), st.integers(), st.text(max_size=3), st.floats())


@pytest.mark.parametrize("alias", list(ALIASES))
def test_fuzzed_lock_arguments(alias, prefix):
    require_alias(alias)
    check = InputCheck(alias, prefix)
    optional = {"ttl": SECONDS, "timeout": SECONDS, "max_hold": SECONDS, "auto_renew": st.one_of(st.booleans(), JUNK),
                # Non-blocking only: a drawn timeout of None would let a call wait as long as a lock is held.
                "blocking": st.one_of(st.just(False), JUNK), "using": st.one_of(st.just(alias), JUNK)}

    @FUZZ
    @given(entry=st.sampled_from(ENTRY_POINTS), name=names(prefix),
           arguments=st.fixed_dictionaries({}, optional=optional))
    def attempt(entry, name, arguments):
        check.lock_call(entry, name, **arguments)
        assert not check.violations, check.violations

    attempt()
    assert check.leftovers() == []


@pytest.mark.parametrize("alias", list(ALIASES))
def test_fuzzed_extensions(alias, prefix):
    require_alias(alias)
    lease = distlock.acquire(f"{prefix}:extended", ttl=30, using=alias, timeout=10)

    @FUZZ
    @given(ttl=SECONDS)
    def attempt(ttl):
        try:
            try:
                extended = lease.extend(ttl)
            except distlock.BackendUnavailable:  # a stalled server, unless it happens again
                time.sleep(0.5)
                extended = lease.extend(ttl)
        except (TypeError, ValueError):
            return
        if extended and ttl is not None:
            assert lease.remaining() <= ttl + 0.01, "the lease claims more validity than the server granted"

    try:
        attempt()
    finally:
        lease.release()
    assert InputCheck(alias, prefix).leftovers() == []


TOKENS = st.one_of(st.integers(-(2**64), 2**64), st.integers(1, 50), st.floats(), st.text(max_size=3), st.none(),
                   st.booleans())


def test_fuzzed_fencing_tokens(fenced_store):
    """claim/save/fenced_update with random tokens: the stored token never goes down, every refusal is logged."""
    rows = fenced_store.Row.objects.using(fenced_store.database)
    pk = fenced_store.add_row()
    refused = []

    @FUZZ
    @given(operation=st.sampled_from(["claim", "save", "fenced_update"]), token=TOKENS)
    def attempt(operation, token):
        before = rows.get(pk=pk).fencing_token
        stale = False
        try:
            if operation == "claim":
                rows.claim(token, pk=pk)
            elif operation == "save":
                fenced_store.Row(pk=pk, value=1).save(using=fenced_store.database, fencing_token=token)
            else:
                stale = rows.filter(pk=pk).fenced_update(token, value=2) == 0
        except (TypeError, ValueError):
            assert rows.get(pk=pk).fencing_token == before, "a refused argument changed the row"
            return
        except distlock.StaleFencingToken:
            stale = True
        after = rows.get(pk=pk).fencing_token
        if stale:
            refused.append(token)
            assert token < before and after == before, "a refused write changed the row, or a fresh one was refused"
        else:
            assert after == token >= before, "the stored token is not the accepted one, or went down"

    attempt()
    assert fenced_store.rejection_rows([pk]) == len(refused)


@single_instance_task(name="tests.faults.fuzzed_key_task", key="fuzzed-key:{customer}:{day}", using="locmem")
def fuzzed_key_task(customer, day="monday"):
    return "ran"


@FUZZ
@given(args=st.lists(st.one_of(st.text(max_size=300), st.integers(), st.none(), st.floats()), max_size=3),
       kwargs=st.dictionaries(st.sampled_from(["customer", "day", "other"]), st.one_of(st.text(max_size=5),
                                                                                      st.integers()), max_size=2))
def test_fuzzed_single_instance_task_keys(args, kwargs):
    """The key is formatted from the call's arguments: a call that cannot bind, or a name the API refuses,
    raises TypeError or ValueError; anything else runs and leaves no lock behind."""
    try:
        assert fuzzed_key_task(*args, **kwargs) == "ran"
    except (TypeError, ValueError):
        pass
    assert InputCheck("locmem", "fuzzed-key:").leftovers() == []
