"""Threads that start and end all the time, on every backend: no crash, no error, no overlap.

Each alias runs ``tests.thread_churn`` in a process of its own (a crash there must not take the test
run with it), all at once, for ``CHURN_SECONDS`` and until its executors and request threads came and
went ``MIN_GENERATIONS`` and ``MIN_REQUEST_THREADS`` times.
"""

import json
import subprocess
import sys
import uuid

import pytest

from tests.conftest import BACKEND_ALIASES, LONG, require_alias
from tests.workers import ROOT, child_env

#: The issue's bar, 20 s of each pattern on every backend, with DISTLOCK_FAULTS_LONG=1; ``make test``
#: runs 6 s (make test's time budget), each alias on until the counts below are reached.
CHURN_SECONDS = 20 if LONG else 6
#: Executor generations (10 threads each, shut down and recreated) and request threads each alias goes
#: through at least, however slow the machine: the threads that come and go, whose reused idents the
#: test is about. The child runs on until it reached them; the test checks that it reports them.
MIN_GENERATIONS, MIN_REQUEST_THREADS = 3, 200
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
            [sys.executable, "-m", "tests.thread_churn", alias, str(CHURN_SECONDS), prefix, str(MIN_GENERATIONS),
             str(MIN_REQUEST_THREADS)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(DISTLOCK_TEST_REDLOCK_REQUEST_TIMEOUT=REDLOCK_REQUEST_TIMEOUT), cwd=ROOT,
        )
        for alias in aliases
    }
    failures = []
    for alias, process in processes.items():
        out, err = process.communicate(timeout=CHURN_SECONDS + 180)
        if process.returncode != 0:
            failures.append(f"{alias}: exited with {process.returncode}\n{err[-3000:]}")
            continue
        report = json.loads(out.splitlines()[-1])
        if (report["errors"] or report["overlaps"] or not report["operations"]
                or report["generations"] < MIN_GENERATIONS or report["request_threads"] < MIN_REQUEST_THREADS):
            failures.append(f"{alias}: {report['operations']} operations, {report['errors']} errors, "
                            f"{report['overlaps']} overlaps, {report['generations']} executor generations "
                            f"(at least {MIN_GENERATIONS}), {report['request_threads']} request threads "
                            f"(at least {MIN_REQUEST_THREADS})\n" + "\n".join(report["first_errors"]))
    assert not failures, "\n\n".join(failures)
