"""Steps of the scenarios that break a server, shared by the fault tests of several backends."""

import time

from distlock.conformance import scenarios
from distlock.conformance.history import load
from tests.servers import wait_until as poll_until

#: Why a scenario that ends the holder's lease on the server side expects overlap.
LOST_LEASE_OVERLAP = "the old holder stays in its critical section until it checks its lease"


def restart_during_contention(run, backend, cluster, scale, *, member, scenario):
    """Contend while ``member(cluster)`` is killed (SIGKILL) and restarted 3 s later; return the ``Result``.

    Judged as the soak judges a server fault: a client whose session could not be kept alive through
    the election (3 s of session on a busy 2-core machine) is told its lease is lost, and may still be
    in its critical section when the next holder enters; every overlap must be explained so, and the
    store must refuse its writes.
    """
    def kill_and_restart():
        time.sleep(1.5)
        victim = member(cluster)
        victim.kill()
        run.nemesis.record("fault", what="kill member", target=victim.name, ends_leases=True)
        time.sleep(3)
        victim.start()
        run.nemesis.record("fault", what="restart member", target=victim.name)

    return scenarios.contention(run, backend, clients=scale.clients // 2, iterations=scale.iterations,
                                fault=kill_and_restart, scenario=scenario, expect_overlap=LOST_LEASE_OVERLAP)


def enter_new_lock(run, holder, *, ttl, timeout):
    """Have ``holder`` acquire a new lock, claim a new row and enter its critical section; return (name, row, grant)."""
    name, row = run.lock_name(), run.row()
    held = holder.call("acquire", name=name, ttl=ttl, timeout=timeout)
    holder.call("claim", name=name, row=row)
    holder.call("enter", name=name)
    return name, row, held


def write_stale_and_leave(holder, name, row):
    """Write with the token of a holder the lock was taken from (the store must refuse it), then leave and release."""
    outcome = holder.call("write", name=name, row=row, via="token")["outcome"]
    assert outcome == "stale", f"the old holder's write was {outcome}, not refused as stale"
    holder.call("exit", name=name)
    holder.call("release", name=name)


def wait_for_record(run, client, op, name):
    """Return once ``client``'s history holds an ``op`` event of lock ``name``: "lease_state" once its
    ``watch`` began (a fault after that is watched), "lost" once its ``lock_lost`` receiver ran."""
    def recorded():
        return any(event["proc"] == client.proc and event["op"] == op and event.get("lock") == name
                   for event in load(run.directory))

    poll_until(recorded, 30, f"{client.proc} recording {op} of {name}")
