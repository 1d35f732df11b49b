"""Threads that start and end all the time, on every backend: no crash, no error, no overlap.

Each alias runs ``tests.thread_churn`` in a process of its own (a crash there must not take the test
run with it), all at once, for ``CHURN_SECONDS``.
"""

import json
import subprocess
import sys
import uuid

import pytest

from tests.conftest import BACKEND_ALIASES, require_alias
from tests.workers import ROOT, child_env

#: The issue's bar: 20 s of each pattern on every backend.
CHURN_SECONDS = 20
#: Eight processes of busy threads on a small machine: Redlock's masters get longer than the default
#: 0.25 s to answer, so that a starved CPU does not count as a failed acquire.
REDLOCK_REQUEST_TIMEOUT = "2"


@pytest.mark.slow
@pytest.mark.django_db(transaction=True, databases="__all__")
def test_threads_that_come_and_go_never_crash_fail_or_overlap_on_any_backend():
    aliases = [require_alias(alias) for alias in BACKEND_ALIASES]
    prefix = f"churn:{uuid.uuid4().hex}"
    processes = {
        alias: subprocess.Popen(
            [sys.executable, "-m", "tests.thread_churn", alias, str(CHURN_SECONDS), prefix],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(DISTLOCK_TEST_REDLOCK_REQUEST_TIMEOUT=REDLOCK_REQUEST_TIMEOUT), cwd=ROOT,
        )
        for alias in aliases
    }
    failures = []
    for alias, process in processes.items():
        out, err = process.communicate(timeout=CHURN_SECONDS + 120)
        if process.returncode != 0:
            failures.append(f"{alias}: exited with {process.returncode}\n{err[-3000:]}")
            continue
        report = json.loads(out.splitlines()[-1])
        if report["errors"] or report["overlaps"] or not report["operations"]:
            failures.append(f"{alias}: {report['operations']} operations, {report['errors']} errors, "
                            f"{report['overlaps']} overlaps\n" + "\n".join(report["first_errors"]))
    assert not failures, "\n\n".join(failures)
