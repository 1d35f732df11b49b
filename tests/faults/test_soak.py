"""The soak catches a broken backend in its first runs, and leaves what replays the failing run.

``make soak`` itself runs for hours and is not part of ``make test``; this runs its machinery for two
runs on a backend broken on purpose (every token 1: fencing cannot tell holders apart), in a process
of its own with databases of its own.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.faults.report import soak_section
from tests.faults.soak import BACKENDS, flagged_in_output, lanes, rejudge, upper_bound

pytestmark = pytest.mark.slow


def test_the_soak_catches_a_backend_that_reuses_tokens_and_keeps_the_run(tmp_path):
    if not os.environ.get("DISTLOCK_TEST_PG"):
        pytest.skip("the soak's fenced store needs PostgreSQL; run the suite with `make test`")
    keep, report = tmp_path / "failed", tmp_path / "soak.md"
    env = {**os.environ, "DISTLOCK_TEST_RUN_ID": f"{os.environ.get('DISTLOCK_TEST_RUN_ID', os.getpid())}soak"}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    done = subprocess.run([sys.executable, "-m", "tests.faults.soak", "--backends", "broken", "--runs", "2",
                           "--seed", "11", "--keep", str(keep), "--report", str(report)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "VIOLATION" in done.stdout and "token(s) issued twice" in done.stdout, done.stdout
    assert "| broken | 2 |" in report.read_text()
    kept = sorted(keep.iterdir())
    assert kept, "a failing run keeps its folder"
    replay = (kept[0] / "replay.txt").read_text()
    assert "--seed 11 --replay" in replay and "--backends broken" in replay
    assert any(path.suffix == ".jsonl" for path in kept[0].iterdir())
    assert any("issued twice" in text for text in json.loads((kept[0] / "violations.json").read_text()))


def test_the_upper_bound_is_three_over_n_for_no_violation_and_clopper_pearson_otherwise():
    assert upper_bound(0, 300) == pytest.approx(0.01)
    assert upper_bound(0, 0) == 1.0
    # Clopper-Pearson, one-sided 95 %: 1 in 10 -> 0.394, 5 in 100 -> 0.1024 (tables of the exact interval).
    assert upper_bound(1, 10) == pytest.approx(0.394, abs=0.001)
    assert upper_bound(5, 100) == pytest.approx(0.1024, abs=0.001)


def test_lanes_split_the_backends_round_robin_and_keep_zookeeper_and_etcd_apart():
    assert lanes(BACKENDS, 1) == [BACKENDS]
    assert lanes(BACKENDS, 2) == [["database", "redlock", "etcd"], ["redis", "zookeeper"]]
    assert lanes(["redis", "etcd"], 3) == [["redis"], ["etcd"]]


def test_the_safety_report_includes_the_soak_report_without_its_title(tmp_path):
    soak = tmp_path / "SOAK.md"
    assert "make soak" in soak_section(soak)
    soak.write_text("# Soak\n\nran 3 runs\n\n| backend | runs |\n")
    assert soak_section(soak) == "ran 3 runs\n\n| backend | runs |"


def kept_run(folder, grants_of_b_and_c):
    """A kept folder of soak run 3 (seed 5, database): the holder paused; A, C and B granted one after the other,
    entering their sections together once it resumed, as in run 35 of seed 2611; grants without their ttl."""
    ms, lock = 1_000_000, "distlock-verify:abc:3"
    c_at, b_at = grants_of_b_and_c
    folder.mkdir()
    clients = {"A": [(0, "invoke"), (10, "ok", 1), (5000, "enter"), (5010, "exit"), (5011, "release", False)],
               "C": [(5, "invoke"), (c_at, "ok", 2), (5005, "enter"), (5009, "exit"), (5011, "release", False)],
               "B": [(2050, "invoke"), (b_at, "ok", 3), (5002, "enter"), (5008, "exit"), (5012, "release", True)]}
    for owner, steps in clients.items():
        events = []
        for t, what, *more in steps:
            event = {"t": t * ms, "proc": owner, "lock": lock}
            if what in ("invoke", "ok"):
                event.update(op="acquire", phase=what, **({"owner": owner, "token": more[0]} if more else {}))
            elif what == "release":
                event.update(op="release", phase="ok", owner=owner, released=more[0])
            else:
                event.update(op=f"cs_{what}", owner=owner)
            events.append(event)
        (folder / f"{owner}.jsonl").write_text("".join(json.dumps(event) + "\n" for event in events))
    (folder / "nemesis.jsonl").write_text(json.dumps(
        {"t": 1 * ms, "proc": "nemesis", "op": "fault", "what": "the holder paused past its lease (SIGSTOP)",
         "phase": "start", "target": "client-2", "ends_leases": False}) + "\n")
    (folder / "store-commits.json").write_text("[]")
    return folder


def test_rejudge_checks_a_kept_run_again_with_the_soaks_ttl(tmp_path):
    ok = kept_run(tmp_path / "seed-5-run-3-database", (2100, 4200))
    assert rejudge(ok) == (3, "database", "the holder paused past its lease (SIGSTOP)", [])
    # C granted 600 ms into A's 2 s ttl: a double grant, whatever A's release later found.
    bad = kept_run(tmp_path / "seed-5-run-13-database", (600, 4200))
    assert "not linearizable (P4)" in rejudge(bad)[3]


def test_the_violations_a_soak_printed_are_read_back_for_its_older_folders():
    output = ("[soak] 10 runs, 1.0 min\n[soak] run 35 (database, the holder paused past its lease (SIGSTOP)): "
              "VIOLATION [\"not linearizable (P4): lock 'x': A got token 2\", 'overlap no fault explains: B']\n")
    assert flagged_in_output(output) == {(35, "database"): ["not linearizable (P4): lock 'x': A got token 2",
                                                            "overlap no fault explains: B"]}
