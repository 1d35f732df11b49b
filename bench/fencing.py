"""What fencing costs on PostgreSQL: a fenced ``save()`` against a plain ``save()`` of the same row, and
``claim()`` against ``select_for_update().get()`` inside a transaction (the usual way to lock a row).

    python -m tests.servers --servers postgres -- .venv/bin/python -m bench.fencing [--runs 3000]

Both sides of a pair run in this process on the same row, alternating in blocks of 100 calls so that
the load of the shared machine weighs on both alike; the figures are medians of per-call times.
The plain side is ``PlainAccount``, a plain Django model on ``Account``'s table.
Targets: fenced save <= 1.15x plain save; claim <= 1.15x select_for_update().get().
"""

import argparse
import itertools
import os
import statistics
import sys
import time

from bench import run_standalone

#: Calls per block; blocks of the two sides alternate.
BLOCK = 100
#: Target ratio of each pair (fenced / plain).
TARGET = 1.15


def measure_pair(first, second, runs, warmup=200):
    """Return the durations (ms) ``first`` and ``second`` report, calling them in alternating blocks of ``BLOCK``."""
    for _ in range(warmup):
        first()
        second()
    durations = ([], [])
    for _ in range(max(runs // BLOCK, 1)):
        for call, into in ((first, durations[0]), (second, durations[1])):
            into.extend(call() for _ in range(BLOCK))
    return durations


def timed(call):
    """Return a function that runs ``call`` and returns how long it took, in ms."""
    def run():
        started = time.perf_counter()
        call()
        return (time.perf_counter() - started) * 1000
    return run


def report(label, fenced, plain, plain_label):
    """Print one pair's medians, p99s and ratio; return whether the ratio meets ``TARGET``."""
    fenced_p50, plain_p50 = statistics.median(fenced), statistics.median(plain)
    ratio = fenced_p50 / plain_p50
    p99 = lambda durations: sorted(durations)[int(len(durations) * 0.99) - 1]  # noqa: E731
    print(f"{label:<34}{fenced_p50:>9.3f}{p99(fenced):>9.3f}   {plain_label:<34}{plain_p50:>9.3f}{p99(plain):>9.3f}"
          f"{ratio:>8.3f}x  {'ok' if ratio <= TARGET else 'OVER TARGET'}")
    return ratio <= TARGET


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.fencing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3000, help="calls per side of each pair (default 3000)")
    parser.add_argument("--database", default="postgres", help="database alias (default 'postgres')")
    args = parser.parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django  # noqa: PLC0415 - configure Django before importing models

    django.setup()
    from django.conf import settings  # noqa: PLC0415
    from django.db import connections, transaction  # noqa: PLC0415

    from tests.fencing_app.models import Account, PlainAccount  # noqa: PLC0415

    db = args.database
    if db not in settings.DATABASES:
        print(f"database {db!r} is not configured; run under `python -m tests.servers --servers postgres --`",
              file=sys.stderr)
        return 2
    fenced_row = Account.objects.using(db).create(balance=0)
    plain_row = PlainAccount.objects.using(db).get(pk=fenced_row.pk)
    tokens = itertools.count(1)

    def fenced_save():
        fenced_row.balance += 1
        fenced_row.save(fencing_token=next(tokens))

    def plain_save():
        plain_row.balance += 1
        plain_row.save()

    # The transaction's BEGIN and COMMIT cost both sides the same: time the statement inside it.
    def claim():
        with transaction.atomic(using=db):
            return timed(lambda: Account.objects.using(db).claim_in_transaction(next(tokens), pk=fenced_row.pk))()

    def select_for_update():
        with transaction.atomic(using=db):
            return timed(lambda: Account.objects.using(db).select_for_update().get(pk=fenced_row.pk))()

    connection = connections[db]
    print(f"Fencing overhead on database {db!r} ({connection.vendor} {connection.Database.__name__}), "
          f"{args.runs} calls per side, ms per call")
    print(f"{'fenced':<34}{'p50':>9}{'p99':>9}   {'baseline':<34}{'p50':>9}{'p99':>9}{'ratio':>9}")
    met = report("save(fencing_token=t)", *measure_pair(timed(fenced_save), timed(plain_save), args.runs),
                 "plain save() (same row)")
    met &= report("claim(t, pk=…) in atomic()", *measure_pair(claim, select_for_update, args.runs),
                  "select_for_update().get(pk=…)")
    print(f"target: each ratio <= {TARGET}x ({'met' if met else 'NOT met'})")
    Account.objects.using(db).filter(pk=fenced_row.pk).delete()
    return 0


if __name__ == "__main__":
    run_standalone(main)
