"""The soak catches a broken backend in its first runs, and leaves what replays the failing run.

``make soak`` itself runs for hours and is not part of ``make test``; this runs its machinery for two
runs on a backend broken on purpose (every token 1: fencing cannot tell holders apart), in a process
of its own with databases of its own.
"""

import os
import subprocess
import sys

import pytest

from tests.faults.report import soak_section
from tests.faults.soak import BACKENDS, lanes, upper_bound

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
