"""The checker itself, on hand-written histories (pure logic: no servers)."""

from distlock.conformance.checker import check

MS = 1_000_000


def acquire(t, owner, token, lock="L"):
    return {"t": t * MS, "op": "acquire", "owner": owner, "token": token, "lock": lock, "proc": owner}


def section(start, end, owner, lock="L"):
    return [{"t": start * MS, "op": "cs_enter", "owner": owner, "lock": lock},
            {"t": end * MS, "op": "cs_exit", "owner": owner, "lock": lock}]


def commit(t, seq, token, accepted, owner=None, row="r", delta=0):
    return {"t": t * MS, "op": "store_commit", "seq": seq, "row": row, "token": token, "accepted": accepted,
            "owner": owner, "delta": delta}


def test_kleppmann_timeline_one_overlap_and_one_correct_rejection():
    history = [acquire(0, "A", 33), *section(10, 3040, "A"), acquire(2100, "B", 34), *section(2100, 2300, "B"),
               commit(2200, 1, 34, True, "B"), commit(3030, 2, 33, False, "A")]
    verdict = check(history)
    assert verdict.overlaps == 1 and verdict.max_overlap_ms == 200
    assert verdict.ok and verdict.rejections == 1


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
