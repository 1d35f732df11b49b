"""``make matrix``: the full worker/server matrix of tests/test_deployment.py, then its table.

    python -m tests.servers -- python -m tests.deployment.matrix [--write-docs] [pytest args]
    python -m tests.deployment.matrix --table RESULTS.jsonl [--write-docs]

Runs ``pytest tests/test_deployment.py`` with ``DISTLOCK_MATRIX=1`` (5 Celery pools × 5 backend
configurations, 4 gunicorn worker kinds × 4 backends, the storms), reads the figures each test
recorded and prints them as tables. ``--write-docs`` replaces the results section of
docs/DEPLOYMENT.md (between its ``matrix:begin``/``matrix:end`` markers) with those tables.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import datetime, timezone

from tests.workers import ROOT

DOC = ROOT / "docs" / "DEPLOYMENT.md"
BEGIN, END = "<!-- matrix:begin -->", "<!-- matrix:end -->"
#: Alias -> the backend configuration's name in the tables.
LABELS = {"default": "database (SQLite)", "postgres": "database (PostgreSQL)", "redis": "Redis",
          "zookeeper": "ZooKeeper", "etcd": "etcd"}


def verdict(failures):
    return "ok" if not failures else "FAIL: " + "; ".join(str(failure) for failure in failures)[:160]


def celery_table(rows):
    lines = ["| Celery pool | backend | runs | errors | overlaps | left held | 8 s run, ttl 2 | PostgreSQL conns "
             "| warm shutdown | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        long = row.get("long_run") or {}
        kept = "refused" if row.get("refused") else "kept" if long.get("lost") is False else ("lost" if long else "–")
        lines.append(f"| {row['pool']} (-c {row['concurrency']}) | {LABELS[row['alias']]} | {row['runs']} "
                     f"| {len(row['errors'])} | {row['overlaps']} | {len(row['held_after'])} | {kept} "
                     f"| {row['most_connections'] if row['most_connections'] is not None else '–'} "
                     f"| {row['shutdown_seconds'] if row['shutdown_seconds'] is not None else 'hung'} s "
                     f"| {refused_verdict(row['failures']) if row.get('refused') else verdict(row['failures'])} |")
    return lines


def refused_verdict(failures):
    return "ok: refused, naming the fix (documented)" if not failures else verdict(failures)


def gunicorn_table(rows):
    lines = ["| gunicorn worker | backend | seconds | ok | 409 | 5xx | hung | ok/s | worker deaths | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['kind']} | {LABELS[row['alias']]} | {row['seconds']} | {row['ok']} | {row['conflicts']} "
                     f"| {row['server_errors']} | {row['hung']} | {row['rate']} | {len(row['worker_trouble'])} "
                     f"| {verdict(row['failures'])} |")
    return lines


def storm_table(rows):
    lines = ["| pool | limit | backend | runs | how runs ended | held past ttl + 1 s | next runs got the lock "
             "| verdict |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ended = ", ".join(f"{kind} {count}" for kind, count in sorted(row["outcomes"].items())) or "–"
        lines.append(f"| {row['pool']} | {row['limit']} | {LABELS[row['alias']]} | {row['runs']} | {ended} "
                     f"| {len(row['held_past_ttl'])} | {row['next_runs_ran']}/{row['next_runs']} "
                     f"| {verdict(row['failures'])} |")
    return lines


def tables(path, outcome=""):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    section = {name: [row for row in rows if row["section"] == name] for name in ("gunicorn", "celery", "storm")}
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [f"Last run: {stamp}, on loopback servers started by `python -m tests.servers`{outcome}.", "",
           "**gunicorn** (2 workers, 32 clients on 4 hot names, the fenced view of `tests/deployment/views.py`; "
           "rows on PostgreSQL):", "", *gunicorn_table(section["gunicorn"]), "",
           *([] if _has_eventlet_worker() else
             ["", "gunicorn's eventlet worker is not measured: the installed gunicorn no longer ships it."]), "",
           "**Celery pools** (each run holds its own key and one of 5 hot locks; `runs` at the concurrency shown):",
           "", *celery_table(section["celery"]), "",
           "**Time-limit storms** (each run does nothing but lock calls until a limit drawn from 0.02–0.6 s ends "
           "it; ttl 4 s):", "", *storm_table(section["storm"])]
    return "\n".join(out)


def _has_eventlet_worker():
    from tests.deployment.harness import gunicorn_has_worker  # noqa: PLC0415

    return gunicorn_has_worker("eventlet")


def write_docs(text):
    doc = DOC.read_text()
    start, end = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    DOC.write_text(doc[:start] + "\n" + text + "\n" + doc[end:])


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tests.deployment.matrix", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", help="print the tables of an existing results file instead of running")
    parser.add_argument("--note", default="", help="a remark for the tables' first line (with --table)")
    parser.add_argument("--write-docs", action="store_true", help="write the tables into docs/DEPLOYMENT.md")
    args, pytest_args = parser.parse_known_args(argv)
    outcome = f"; {args.note}" if args.note else ""
    if args.table:
        path = args.table
    else:
        path = os.path.join(tempfile.mkdtemp(prefix="distlock-matrix-"), "results.jsonl")
        env = dict(os.environ, DISTLOCK_MATRIX="1", DISTLOCK_MATRIX_OUT=path)
        code = subprocess.call([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs",
                                "tests/test_deployment.py", *pytest_args], env=env, cwd=ROOT)
        outcome = f"; pytest exit status {code}"
        print(f"[matrix] results: {path}")
    text = tables(path, outcome)
    print(text)
    if args.write_docs:
        write_docs(text)
        print(f"[matrix] wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
