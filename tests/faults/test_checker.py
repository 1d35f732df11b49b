"""The checker itself, on hand-written histories (pure logic: no servers)."""

import json
import random
from pathlib import Path

from distlock.conformance.checker import (
    check, classify_overlaps, linearizability_violations, lost_writes, overlap_excerpts, stale_reads,
)

MS = 1_000_000


def acquire(t, owner, token, lock="L", phase="ok"):
    return {"t": t * MS, "op": "acquire", "phase": phase, "owner": owner, "token": token, "lock": lock,
            "proc": owner}


def invoke(t, proc, lock="L"):
    """An acquire call starting: the client does not know its owner id yet."""
    return {"t": t * MS, "op": "acquire", "phase": "invoke", "lock": lock, "proc": proc}


def release(t, owner, lock="L", released=True, phase="ok"):
    return {"t": t * MS, "op": "release", "phase": phase, "owner": owner, "lock": lock, "released": released,
            "proc": owner}


def release_call(t, owner, lock="L"):
    """A release call starting, recorded just before the client sends it: in flight until its reply is recorded."""
    return {"t": t * MS, "op": "release", "phase": "invoke", "owner": owner, "lock": lock, "proc": owner}


def lost(t, owner, lock="L"):
    return {"t": t * MS, "op": "lost", "owner": owner, "lock": lock, "proc": owner}


def fault(t, what, **fields):
    return {"t": t * MS, "op": "fault", "what": what, "proc": "nemesis", **fields}


def section(start, end, owner, lock="L"):
    return [{"t": start * MS, "op": "cs_enter", "owner": owner, "lock": lock},
            {"t": end * MS, "op": "cs_exit", "owner": owner, "lock": lock}]


def commit(t, seq, token, accepted, owner=None, row="r", delta=0, kind="write", value=None):
    return {"t": t * MS, "op": "store_commit", "seq": seq, "row": row, "token": token, "accepted": accepted,
            "owner": owner, "delta": delta, "kind": kind, "value": value}


def acknowledged(t, owner, token, value, row="r", lock="L"):
    """The client's record of a fenced write the store accepted."""
    return {"t": t * MS, "op": "write", "kind": "write", "outcome": "accepted", "owner": owner, "token": token,
            "row": row, "lock": lock, "value": value, "proc": owner}


def turn(start, owner, token, lock="L"):
    """A whole uneventful turn: invoke, grant, critical section, acknowledged release, over 10 ms."""
    return [invoke(start, owner, lock), acquire(start + 1, owner, token, lock),
            *section(start + 2, start + 8, owner, lock), release(start + 9, owner, lock)]


def test_kleppmann_timeline_one_overlap_and_one_correct_rejection():
    """The worked example of FAULTS.md: A paused past its ttl, B takes over, A's late write is refused."""
    history = [acquire(0, "A", 33), *section(10, 3040, "A"), fault(20, "pause", target="A", owner="A", lock="L"),
               acquire(2100, "B", 34), *section(2100, 2300, "B"), commit(2200, 1, 34, True, "B"),
               release(2301, "B"), fault(3020, "resume", target="A"), commit(3030, 2, 33, False, "A"),
               release(3041, "A", released=False)]
    verdict = check(history, only_faults_cause_overlaps=True)
    assert verdict.overlaps == 1 and verdict.max_overlap_ms == 200
    assert verdict.ok and verdict.rejections == 1
    assert verdict.linearizability_violations == verdict.unexplained_overlaps == []


def test_an_overlap_comes_with_the_events_around_it():
    """A failed run's report must tell what led to an overlap: its history folder may be gone (CI)."""
    history = [*turn(0, "C", 30), acquire(5000, "A", 33), *section(5010, 5300, "A"),
               fault(5050, "kill member", target="m1", ends_leases=True), acquire(5100, "B", 34),
               *section(5110, 5200, "B"), lost(5150, "A"), *turn(9000, "C", 35), *turn(100, "D", 31, lock="M")]
    (excerpt,) = overlap_excerpts(history)
    lines = excerpt.splitlines()
    assert lines[0] == "lock 'L': A in its section from 5010.0 ms, B entered at 5110.0 ms"
    times = [float(line.split()[0]) for line in lines[1:]]
    assert times == sorted(times) and times[0] == 5000.0 and times[-1] == 5300.0
    assert any("'kill member'" in line for line in lines) and any("'lost'" in line for line in lines)
    assert overlap_excerpts([*turn(0, "A", 1), *turn(20, "B", 2)]) == []


def test_stale_write_accepted_is_caught():
    history = [acquire(0, "A", 33), acquire(1, "B", 34), commit(2, 1, 34, True, "B"), commit(3, 2, 33, True, "A")]
    verdict = check(history)
    assert not verdict.ok and len(verdict.stale_accepted) == 1


def test_false_rejection_is_caught():
    verdict = check([acquire(0, "A", 5), commit(1, 1, 5, False, "A")])
    assert not verdict.ok and len(verdict.false_rejections) == 1


def test_forged_token_is_caught():
    verdict = check([acquire(0, "A", 5), commit(1, 1, 6, True, "A")])
    assert len(verdict.stray_tokens) == 1 and not verdict.ok


def test_token_regression_and_duplicates_are_caught():
    verdict = check([acquire(0, "A", 5), acquire(1, "B", 4), acquire(2, "C", 4)])
    assert len(verdict.regressions) == 2 and len(verdict.duplicate_tokens) == 1


def test_lost_update_is_counted():
    history = [acquire(0, "A", 1), commit(1, 1, 1, True, "A", delta=1), acquire(2, "B", 2),
               commit(3, 2, 2, True, "B", delta=1)]
    assert check(history, initial={"r": 0}, final={"r": 2}).lost_updates == 0
    assert check(history, initial={"r": 0}, final={"r": 1}).lost_updates == 1


def test_killed_holder_section_lasts_until_the_next_acquire():
    history = [acquire(0, "A", 1), {"t": 1 * MS, "op": "cs_enter", "owner": "A", "lock": "L"},
               {"t": 5 * MS, "op": "kill", "owner": "A", "lock": "L"}, acquire(2005, "B", 2), *section(2006, 2010, "B")]
    verdict = check(history)
    assert verdict.overlaps == 0
    assert verdict.recovery_ms == [2000]


def test_sections_of_one_owner_never_overlap_themselves():
    history = [acquire(0, "A", 1), *section(1, 5, "A"), *section(3, 4, "A")]
    assert check(history).overlaps == 0


def test_only_granted_acquisitions_count():
    attempt = {**acquire(0, "A", None), "phase": "invoke"}
    failure = {**acquire(1, "A", None), "phase": "fail"}
    verdict = check([attempt, failure, {**acquire(2, "B", 3), "phase": "ok"}])
    assert verdict.acquisitions == 1 and verdict.ok


# -- P4: the lock service against a fenced mutex ----------------------------------------------------


def test_a_valid_history_passes_every_check():
    """Waiters call acquire while the lock is held; each write reads the last one; the final state has the last."""
    history = [*turn(0, "A", 1), invoke(3, "B"), invoke(4, "C"), acquire(11, "B", 2), *section(12, 18, "B"),
               commit(13, 1, 2, True, "B", kind="claim", value=0), commit(14, 2, 2, True, "B", delta=1, value=1),
               acknowledged(15, "B", 2, 1), release(19, "B"), acquire(21, "C", 3), *section(22, 28, "C"),
               commit(23, 3, 3, True, "C", kind="claim", value=1), commit(24, 4, 3, True, "C", delta=1, value=2),
               acknowledged(25, "C", 3, 2), release(29, "C"), *turn(30, "D", 5, lock="other")]
    verdict = check(history, initial={"r": 0}, final={"r": 2}, only_faults_cause_overlaps=True)
    assert verdict.ok, verdict
    assert verdict.linearizability_violations == verdict.lost_writes == verdict.stale_reads == []
    assert verdict.overlaps == 0


def test_two_grants_at_once_without_evidence_of_expiry_are_not_linearizable():
    history = [*turn(0, "A", 1), acquire(15, "B", 2), *section(15.5, 19, "B"), acquire(16, "C", 3), release(20, "B"),
               release(21, "C")]
    violations = linearizability_violations(history)
    assert len(violations) == 1 and "C got token 3" in violations[0] and "while B held it" in violations[0]
    assert not check(history).ok


def test_grants_without_invoke_are_still_ordered_by_their_releases():
    """Threads record no invoke: their acquire may start any time before, but a release starts after the holder's
    own last step, so an overlap between two such grants is still caught."""
    holder = [acquire(1, "A", 1), *section(2, 10, "A"), release(11, "A")]
    assert linearizability_violations([*holder, acquire(5, "B", 2), *section(6, 8, "B"), release(9, "B")])
    assert not linearizability_violations([*holder, acquire(12, "B", 2), *section(13, 14, "B"), release(15, "B")])


def test_the_holders_own_lost_event_or_a_fault_naming_it_ends_its_lease():
    """Explicit evidence of the lease's end allows the second grant; the second grant itself is no evidence."""
    held = [acquire(0, "A", 1), *section(1, 50, "A")]
    taken = [acquire(20, "B", 2), *section(21, 25, "B"), release(26, "B"), release(51, "A", released=False)]
    assert linearizability_violations([*held, *taken])
    assert not linearizability_violations([*held, lost(10, "A"), *taken])
    assert not linearizability_violations([*held, fault(5, "pause", target="A", owner="A"), *taken])
    assert not linearizability_violations([*held, {"t": 5 * MS, "op": "kill", "owner": "A", "lock": "L"}, *taken])
    expired = {"t": 30 * MS, "op": "expired", "owner": "A", "lock": "L", "since": 15 * MS}
    assert not linearizability_violations([*held, expired, *taken])
    # Known only after the second grant: the server still had A's lease when it granted B.
    assert linearizability_violations([*held, lost(22, "A"), *taken])
    assert linearizability_violations([*held, {**expired, "since": 30 * MS}, *taken])
    # A fault naming another owner, or none, says nothing of A's lease.
    assert linearizability_violations([*held, fault(5, "pause", target="X", owner="X"), *taken])
    assert linearizability_violations([*held, fault(5, "kill redis"), *taken])


def test_a_fault_of_the_servers_may_end_the_leases_held_when_it_starts():
    """A partition or a member killed can expire any session: a grant after such a fault began needs no other evidence;
    one before it, or after a fault of the servers that started once the first lease had ended, does."""
    held = [acquire(0, "A", 1), *section(1, 50, "A")]
    taken = [acquire(20, "B", 2), *section(21, 25, "B"), release(26, "B"), release(51, "A", released=False)]
    partition = fault(5, "leader cut from the followers", phase="start", ends_leases=True)
    assert not linearizability_violations([*held, partition, *taken])
    assert linearizability_violations([*held, {**partition, "t": 21 * MS}, *taken])
    assert linearizability_violations([*held, {**partition, "ends_leases": False}, *taken])
    # A lease granted during the fault may end as it ends (found by the soak: an etcd leader paused 4 s).
    pause = [fault(2, "leader paused", phase="start", ends_leases=True), acquire(10, "A", 1), *section(11, 50, "A"),
             fault(12, "leader paused", phase="end", ends_leases=True)]
    granted_during = [*pause, acquire(20, "B", 2), *section(21, 25, "B"), release(26, "B"),
                      lost(40, "A"), release(51, "A", released=False)]
    assert not linearizability_violations(granted_during)
    # ... also when the second grant comes before the fault's end is recorded (CI at f4b9c05).
    ended_later = [{**event, "t": 30 * MS} if event.get("phase") == "end" else event for event in granted_during]
    assert not linearizability_violations(ended_later)
    # A lease granted after the fault ended has no such excuse.
    after = [fault(2, "leader paused", phase="start", ends_leases=True),
             fault(5, "leader paused", phase="end", ends_leases=True), acquire(10, "A", 1), *section(11, 50, "A"),
             acquire(20, "B", 2), *section(21, 25, "B"), release(26, "B"), lost(40, "A"),
             release(51, "A", released=False)]
    assert linearizability_violations(after)
    # Tokens must still increase: a fault may end a lease, never excuse a token going back.
    assert linearizability_violations([*held, partition, acquire(20, "B", 1), release(26, "B")])


def test_a_release_that_found_the_lease_gone_ends_it_no_earlier_than_its_reply():
    """``released`` False says the server had ended the lease by then, not when: a grant before it is too soon."""
    history = [acquire(0, "A", 1), *section(1, 10, "A"), *turn(20, "B", 2), release(35, "A", released=False)]
    assert linearizability_violations(history)
    assert not linearizability_violations([*history[:3], release(15, "A", released=False), *turn(20, "B", 2)])


def granted_with_ttl(t, owner, token, ttl, lock="L"):
    """A grant with the ttl (seconds) the client records."""
    return {**acquire(t, owner, token, lock), "ttl": ttl}


def test_holders_blocked_past_their_ttl_by_a_paused_one_are_linearizable_and_explained():
    """Soak run 35 (seed 2611, database): a paused holder kept the fenced row locked, so A, C and B, each
    granted once the one before it had run past its 2 s ttl, waited in claim() until it resumed, then entered
    their sections together. A's and C's releases found their leases gone. The lock service did nothing wrong
    (fencing refused A's and C's writes); the checker took a release that found a lease gone for the moment
    the lease ended, and reported A and C as holding when B and C were granted."""
    history = [invoke(0, "A"), granted_with_ttl(10, "A", 1, 2), invoke(5, "C"), granted_with_ttl(2100, "C", 2, 2),
               invoke(2050, "B"), granted_with_ttl(4200, "B", 3, 2),
               *section(5000, 5010, "A"), *section(5002, 5008, "B"), *section(5005, 5009, "C"),
               release(5011, "A", released=False), release(5011, "C", released=False), release(5012, "B")]
    assert linearizability_violations(history) == []
    explained, unexplained = classify_overlaps(history)
    assert unexplained == [] and len(explained) == 3
    # Without the ttl in the grants, nothing says when A's lease ended: B's and C's grants are too soon.
    bare = [{key: value for key, value in event.items() if key != "ttl"} for event in history]
    assert linearizability_violations(bare)
    assert len(classify_overlaps(bare)[1]) == 3


def test_a_lease_found_gone_still_held_until_its_ttl_can_have_run_out():
    """B granted 600 ms into A's 2 s ttl: A's release finding the lease gone does not excuse it, nor the overlap."""
    history = [invoke(0, "A"), granted_with_ttl(1, "A", 1, 2), *section(2, 900, "A"), invoke(500, "B"),
               granted_with_ttl(600, "B", 2, 2), *section(601, 700, "B"), release(701, "B"),
               release(901, "A", released=False)]
    assert linearizability_violations(history)
    assert classify_overlaps(history)[1]


def test_an_unsure_grant_released_before_a_later_grant_is_ordered_before_it():
    """C's grant is unknown (info) but its release was acknowledged, and called before D's grant (token 3) returned:
    C (token 2) must have held the lock between A and D."""
    history = [*turn(0, "A", 1), invoke(10, "C"), acquire(11, "C", 2, phase="info"), invoke(12, "D"),
               acquire(22, "D", 3), release(25, "C"), release(29, "D")]
    assert linearizability_violations(history) == []


def test_an_acknowledged_release_starts_after_the_holders_last_step():
    """A lease released only after B's grant (its call began after A's cs_exit) did not end before it."""
    history = [acquire(0, "A", 1), *section(1, 30, "A"), acquire(20, "B", 2), release(31, "A"), release(40, "B")]
    assert linearizability_violations(history)


def test_a_reused_token_is_not_linearizable():
    history = [*turn(0, "A", 7), *turn(10, "B", 7)]
    violations = linearizability_violations(history)
    assert len(violations) == 1 and "not above token 7" in violations[0]
    assert check(history).duplicate_tokens


def test_a_token_going_backwards_is_not_linearizable_unless_tokens_are_not_ordered():
    history = [*turn(0, "A", 7), *turn(10, "B", 5)]
    assert "not above token 7" in linearizability_violations(history)[0]
    assert linearizability_violations(history, tokens_must_increase=False) == []
    assert check(history, tokens_must_increase=False).regressions  # P3 still says so


def test_concurrent_acquires_may_be_ordered_either_way():
    """B's call began before A's grant: B may have been granted first, then A with the larger token."""
    history = [invoke(0, "A"), invoke(1, "B"), acquire(2, "B", 1), release(3, "B"), acquire(4, "A", 2),
               release(5, "A")]
    assert linearizability_violations(history) == []


def test_a_release_by_a_non_owner_that_frees_the_lock_is_caught():
    """C never held the lock, yet its release was acknowledged and B got the lock while A held it."""
    history = [acquire(0, "A", 1), *section(1, 30, "A"), release(10, "C"), acquire(11, "B", 2), release(12, "B"),
               release(31, "A", released=False)]
    violations = linearizability_violations(history)
    assert len(violations) == 1 and "C released it" in violations[0]


def test_a_second_acknowledged_release_of_one_lease_is_caught():
    history = [*turn(0, "A", 1), acquire(11, "B", 2), release(12, "A"), release(13, "B")]
    assert "A's lease ended by 12.0 ms although it did not hold the lock" in linearizability_violations(history)[0]


def test_info_acquires_may_or_may_not_have_happened():
    # Not happened: C's call was cut short; had it been granted, D's grant would have come too soon.
    not_happened = [*turn(0, "A", 1), invoke(10, "C"), acquire(12, "C", 2, phase="info"), *turn(20, "D", 3)]
    assert linearizability_violations(not_happened) == []
    # Happened: C, unsure of its grant, still released it (acknowledged), and D came after.
    happened = [*turn(0, "A", 1), invoke(10, "C"), acquire(12, "C", 2, phase="info"), release(15, "C"),
                *turn(20, "D", 3)]
    assert linearizability_violations(happened) == []
    # Its release proves it happened, so its token must fit: D's token is below it.
    assert linearizability_violations([*happened[:-4], *turn(20, "D", 2)])
    # Nor can it have happened before its call, before A's grant with the higher token.
    assert linearizability_violations([*turn(0, "A", 5), invoke(10, "C"), acquire(12, "C", 1, phase="info"),
                                       release(15, "C")])
    # An info of an unknown owner (an interrupted call) and a failed acquire count for nothing.
    unknown = [*turn(0, "A", 1), invoke(10, "C"), {**acquire(12, None, None, phase="info"), "proc": "C"},
               invoke(13, "E"), {**acquire(14, None, None, phase="fail"), "proc": "E"}, *turn(20, "D", 2)]
    assert linearizability_violations(unknown) == []


def test_a_killed_holder_lease_may_end_any_time_after_the_kill():
    history = [acquire(0, "A", 1), *section(1, 2, "A")[:1], {"t": 5 * MS, "op": "kill", "owner": "A", "lock": "L"},
               *turn(2005, "B", 2)]
    assert check(history).ok


def killed(t, proc, owner=None, lock="L"):
    """A client process killed, as the soak records it: the nemesis's ``kill`` (naming the lease ``owner`` it held,
    if any), then the start of its fault."""
    return [{"t": t * MS, "op": "kill", "target": proc, "owner": owner, "lock": lock if owner else None,
             "proc": "nemesis"},
            fault(t + 0.1, "a client killed (SIGKILL)", phase="start", target=proc, targets=[proc], ends_leases=False)]


def killed_while_b_is_granted(*, release_called, victim="A", owner="A"):
    """Soak run 1043's shape: A leaves its section, B is granted 1.2 ms later, and ``victim`` is killed just after;
    A's history ends there, with its release called (``release_called``) or not, and never acknowledged."""
    a = [invoke(0, "A"), granted_with_ttl(1, "A", 1, 2), *section(2, 377.6, "A")]
    b = [invoke(10, "B"), granted_with_ttl(378.8, "B", 2, 2), *section(378.9, 400, "B"), release(401, "B")]
    return [*a, *([release_call(377.7, "A")] if release_called else []), *b, *killed(378.85, victim, owner)]


def test_a_holder_killed_with_its_release_in_flight_may_have_released_it_since_the_call():
    """Soak seed 2612, run 1043 (Redis, "a client killed (SIGKILL)"): A's release reached Redis, B was granted,
    and A was killed before it recorded the reply. The checker ended A's lease only from the kill on, after B's
    grant (P4), although nothing of A happened after its section: the release may have taken effect any time
    since its call."""
    verdict = check(killed_while_b_is_granted(release_called=True), only_faults_cause_overlaps=True)
    assert verdict.ok and verdict.linearizability_violations == [], verdict
    # The kill need not name the lease: the release in flight says whose it is, the kill's target whose process.
    assert linearizability_violations(killed_while_b_is_granted(release_called=True, owner=None)) == []


def test_only_a_release_in_flight_ends_a_killed_holders_lease_before_the_kill():
    """Without a release called, A still held the lock when B was granted, and the kill comes after: a double
    grant, as it is when the kill hits another process than the one whose release is in flight."""
    for history in (killed_while_b_is_granted(release_called=False),
                    killed_while_b_is_granted(release_called=True, victim="C", owner=None)):
        (violation,) = linearizability_violations(history)
        assert "B got token 2" in violation and "while A held it" in violation
        assert not check(history).ok


def test_a_server_that_forgets_grants_fails_p4_unless_the_scenario_expects_it():
    """The Redis restart canary: no fault names A, whose lease the restarted server simply forgot."""
    history = [acquire(0, "A", 1), *section(1, 50, "A"), fault(10, "kill redis"), fault(11, "restarted redis"),
               *turn(20, "B", 2), release(51, "A", released=False)]
    verdict = check(history)
    assert verdict.linearizability_violations and not verdict.ok
    assert check(history, forgets_grants="the restarted server forgot the lock").ok


def test_the_search_gives_up_after_its_step_limit():
    history = [*turn(0, "A", 1), *turn(10, "B", 2), *turn(20, "C", 3)]
    assert linearizability_violations(history) == []
    assert "undecided" in linearizability_violations(history, step_limit=2)[0]


def test_a_long_history_is_checked():
    """2000 operations on one lock: 8 clients take turns, each calling acquire as soon as its last turn ended."""
    rng, history, free_since, t = random.Random(0), [], {}, 0
    for number in range(1000):
        proc = f"p{number % 8}"
        history.append(invoke(rng.uniform(free_since.get(proc, 0), t), proc))
        history += [acquire(t + 0.1, f"{proc}-{number}", number + 1), *section(t + 0.2, t + 0.8, f"{proc}-{number}"),
                    release(t + 0.9, f"{proc}-{number}")]
        free_since[proc], t = t + 0.9, t + 1
    for event in history:
        event["proc"] = event.get("proc", "").split("-")[0]
    assert linearizability_violations(history) == []
    history.append(acquire(500.5, "intruder", 10_000))
    assert len(linearizability_violations(history)) == 1


# -- P5: the fenced register ------------------------------------------------------------------------


def test_an_acknowledged_write_missing_from_the_final_state_is_lost():
    writes = [commit(1, 1, 1, True, "A", value=1), commit(2, 2, 2, True, "B", value=2)]
    assert lost_writes(writes, final={"r": 2}) == []
    assert lost_writes(writes, final={"r": 1}) == [writes[1]]
    # Overwritten by a lower token, it is lost whatever the final state (P2 flags the stale write too).
    overwritten = [*writes, commit(3, 3, 1, True, "A", value=5)]
    assert lost_writes(overwritten, final={"r": 5}) == [writes[1]]
    # Superseded by a write with an equal or higher token: nothing lost.
    assert lost_writes([*writes, commit(3, 3, 2, True, "B", value=7)], final={"r": 7}) == []


def test_a_write_its_client_saw_accepted_must_be_in_the_store_log():
    seen = acknowledged(3, "B", 2, 2)
    assert lost_writes([commit(1, 1, 2, True, "B", value=2), seen], final={"r": 2}) == []
    assert lost_writes([commit(1, 1, 2, False, "B"), seen]) == [seen]


def test_a_claim_that_read_a_stale_value_is_caught():
    history = [commit(1, 1, 1, True, "A", value=1), commit(2, 2, 2, True, "B", kind="claim", value=1),
               commit(3, 3, 2, True, "B", value=2), commit(4, 4, 3, True, "C", kind="claim", value=1)]
    assert stale_reads(history) == [history[3]]
    assert stale_reads(history[:3], initial={"r": 0}) == []
    assert stale_reads([commit(0, 0, 1, True, "A", kind="claim", value=3)], initial={"r": 0})
    verdict = check(history, initial={"r": 0}, final={"r": 2})
    assert not verdict.ok and verdict.stale_reads == [history[3]]


# -- P1: which overlaps an injected fault explains --------------------------------------------------


def test_overlaps_are_explained_by_a_fault_window_or_a_lost_lease():
    overlap = [acquire(0, "A", 1), *section(1, 50, "A"), acquire(20, "B", 2), *section(21, 30, "B")]

    def unexplained(*events):
        explained, unexplained = classify_overlaps(sorted([*overlap, *events], key=lambda e: e["t"]))
        assert len(explained) + len(unexplained) == 1
        return len(unexplained)

    assert unexplained() == 1
    assert unexplained(fault(10, "pause", target="A", owner="A")) == 0
    assert unexplained(fault(10, "partition", phase="start"), fault(40, "partition", phase="end")) == 0
    assert unexplained(fault(0, "partition", phase="start")) == 0  # never healed
    assert unexplained(lost(45, "A")) == 0
    # A window over before A's section, a fault that cut off someone else, a fault of another lock.
    assert unexplained(fault(0.1, "partition", phase="start"), fault(0.5, "partition", phase="end")) == 1
    assert unexplained(fault(10, "pause", target="B")) == 1
    assert unexplained(fault(10, "pause", target="X", owner="X")) == 1
    assert unexplained(fault(10, "kill redis", lock="other")) == 1
    # Without a phase, a fault lasts until the next grant: one before A's grant explains nothing.
    assert unexplained(fault(-1, "kill redis")) == 1
    assert unexplained(fault(10, "kill redis")) == 0


def test_unexplained_overlaps_fail_only_where_faults_are_the_only_allowed_cause():
    """A client that goes on in its critical section after releasing: the lock service is fine, the overlap is not."""
    history = [acquire(0, "A", 1), *section(1, 50, "A"), release(10, "A"), *turn(20, "B", 2)]
    verdict = check(history)
    assert verdict.linearizability_violations == [] and len(verdict.unexplained_overlaps) == 1 and verdict.ok
    assert not check(history, only_faults_cause_overlaps=True).ok
    assert check([*history, lost(40, "A")], only_faults_cause_overlaps=True).ok


# -- deliberately broken backends -------------------------------------------------------------------


class SimulatedBackend:
    """A lock service and fenced store that record the Kleppmann scenario, optionally with a classic bug.

    ``reuse_token_after_expiry``: an expired lease's token is handed out again (a counter kept in the
    lease). ``check_tokens`` False: the store forgets the fencing check and accepts any write.
    """

    def __init__(self, *, reuse_token_after_expiry=False, check_tokens=True):
        self.reuse_token_after_expiry = reuse_token_after_expiry
        self.check_tokens = check_tokens
        self.history, self.now, self.counter, self.holder, self.expired = [], 0, 0, None, None
        self.value, self.fence, self.seq = 0, 0, 0

    def record(self, op, **fields):
        self.now += 1
        self.history.append({"t": self.now * MS, "op": op, **fields})

    def acquire(self, owner):
        self.record("acquire", phase="invoke", lock="L", proc=owner)
        assert self.holder is None
        if self.reuse_token_after_expiry and self.expired is not None:
            token = self.expired
        else:
            self.counter += 1
            token = self.counter
        self.holder = owner
        self.record("acquire", phase="ok", lock="L", owner=owner, token=token, proc=owner)
        return token

    def expire(self):
        """The server ends the holder's lease at its ttl (no event: the server does not tell)."""
        self.expired, self.holder = self.counter, None

    def release(self, owner):
        released, self.holder = self.holder == owner, None if self.holder == owner else self.holder
        self.record("release", phase="ok", lock="L", owner=owner, released=released, proc=owner)

    def commit(self, kind, owner, token, value=None):
        accepted = token >= self.fence or not self.check_tokens
        if accepted:
            self.fence = max(self.fence, token)
            value = self.value if kind == "claim" else value
            self.value = value
        self.seq += 1
        self.record("store_commit", seq=self.seq, row="r", kind=kind, token=token, accepted=accepted, owner=owner,
                    value=value, delta=1 if kind == "write" and accepted else 0, proc=owner)
        self.record("write", kind=kind, lock="L", row="r", owner=owner, token=token, value=value, proc=owner,
                    outcome="accepted" if accepted else "stale")
        return value

    def kleppmann(self):
        """A holds and is paused past its ttl; B takes over and increments; A wakes and writes what it read."""
        a = self.acquire("A")
        read = self.commit("claim", "A", a)
        self.record("cs_enter", lock="L", owner="A", proc="A")
        self.record("fault", what="pause", target="A", owner="A", lock="L", proc="nemesis")
        self.expire()
        b = self.acquire("B")
        self.record("cs_enter", lock="L", owner="B", proc="B")
        self.commit("write", "B", b, self.commit("claim", "B", b) + 1)
        self.record("cs_exit", lock="L", owner="B", proc="B")
        self.release("B")
        self.record("fault", what="resume", target="A", proc="nemesis")
        self.commit("write", "A", a, read + 1)
        self.record("cs_exit", lock="L", owner="A", proc="A")
        self.release("A")
        return check(self.history, initial={"r": 0}, final={"r": self.value}, only_faults_cause_overlaps=True)


def test_a_correct_simulated_backend_passes():
    verdict = SimulatedBackend().kleppmann()
    assert verdict.ok, verdict
    assert verdict.overlaps == 1 and verdict.rejections == 1


def test_a_backend_reusing_the_token_of_an_expired_lease_is_caught():
    verdict = SimulatedBackend(reuse_token_after_expiry=True).kleppmann()
    assert not verdict.ok
    assert "not above token 1" in verdict.linearizability_violations[0]


def test_a_store_that_forgets_the_token_check_is_caught():
    verdict = SimulatedBackend(check_tokens=False).kleppmann()
    assert not verdict.ok
    assert len(verdict.lost_writes) == 1 and verdict.lost_writes[0]["owner"] == "B"
    assert verdict.stale_accepted and verdict.lost_updates == 1


def test_an_etcd_token_below_one_granted_before_is_caught_in_the_soaks_history():
    """Soak seed 2611, run 927 (etcd, "a client's host cut from the majority"), cut to the 100 ms around it:
    client-1 asked for the lock after client-2's grant of token 114796 came back and its release too, and was
    granted 114794. Fencing refused its claim; the token order of the etcd backend is under investigation."""
    path = Path(__file__).parent / "histories" / "etcd-client-host-cut-token-back.jsonl"
    history = [json.loads(line) for line in path.read_text().splitlines()]
    verdict = check(history, only_faults_cause_overlaps=True)
    assert [event["token"] for event in verdict.regressions] == [114794]
    (violation,) = verdict.linearizability_violations
    assert "got token 114794" in violation and "not above token 114796" in violation
    assert not (verdict.stale_accepted or verdict.false_rejections or verdict.lost_writes or verdict.unexplained_overlaps)
