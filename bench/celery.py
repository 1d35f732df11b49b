"""Per-run overhead of ``@single_instance_task`` (Redis backend) against the same plain ``@shared_task``.

    python -m tests.servers --servers redis -- .venv/bin/python -m bench.celery [--runs 1000]

Both tasks run in this process, so broker latency does not drown the figure: ``task(...)`` goes
through ``Task.__call__`` only (the decorator's acquire + renewal thread + release), ``task.apply()``
through Celery's full eager tracer as well. The difference of the medians is the cost per run.
"""

import argparse
import os
import statistics
import sys
import time


def work(item):
    return item


def measure(call, runs):
    """Return the duration of each of ``runs`` calls, in milliseconds, after 50 warm-up calls."""
    for _ in range(50):
        call()
    durations = []
    for _ in range(runs):
        started = time.perf_counter()
        call()
        durations.append((time.perf_counter() - started) * 1000)
    return durations


def summary(durations):
    """Return the median, the mean and the 99th percentile."""
    ordered = sorted(durations)
    return statistics.median(ordered), statistics.fmean(ordered), ordered[int(len(ordered) * 0.99) - 1]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.celery", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1000, help="runs per variant (default 1000, at least 500)")
    parser.add_argument("--using", default="redis", help="DISTLOCK alias (default 'redis')")
    args = parser.parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django  # noqa: PLC0415 - configure Django before importing what needs it

    django.setup()
    from celery import shared_task  # noqa: PLC0415
    from django.conf import settings  # noqa: PLC0415

    from distlock.celery import single_instance_task  # noqa: PLC0415

    if args.using not in settings.DISTLOCK:
        print(f"alias {args.using!r} is not configured; run under `python -m tests.servers --servers redis --`",
              file=sys.stderr)
        return 2
    plain = shared_task(name="bench.plain")(work)
    single = single_instance_task(name="bench.single", key="bench:celery:{item}", using=args.using, ttl=30)(work)

    print(f"@single_instance_task overhead per run, alias {args.using!r}, {args.runs} runs each (ms)")
    print(f"{'path':<22}{'plain p50':>11}{'locked p50':>12}{'added p50':>11}{'added mean':>12}"
          f"{'plain p99':>11}{'locked p99':>12}")
    for path, call_plain, call_single in [
        ("task(...) __call__", lambda: plain(1), lambda: single(1)),
        ("task.apply() eager", lambda: plain.apply((1,)), lambda: single.apply((1,))),
    ]:
        plain_p50, plain_mean, plain_p99 = summary(measure(call_plain, args.runs))
        single_p50, single_mean, single_p99 = summary(measure(call_single, args.runs))
        print(f"{path:<22}{plain_p50:>11.3f}{single_p50:>12.3f}{single_p50 - plain_p50:>11.3f}"
              f"{single_mean - plain_mean:>12.3f}{plain_p99:>11.3f}{single_p99:>12.3f}")
    print("target: < 2 ms added per run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
