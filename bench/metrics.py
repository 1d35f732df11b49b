"""Cost of recording metrics: uncontended acquire+release with metrics on against off, per alias.

    python -m tests.servers --servers redis,postgres -- .venv/bin/python -m bench.metrics [--rounds 40]

Both modes run in this process, back to back in each round (on, off, then off, on, ...); the figure
is the median of the rounds' on/off throughput ratios, so load on the shared machine hits both
alike. "On" includes everything recording costs this process: buffering each event on the acquire
and release paths, the daemon thread folding the buffers every second (Prometheus instruments
included) and its flush to the store every ``FLUSH_INTERVAL``. The target is under 5% slower.
"""

import argparse
import os
import statistics
import time
import uuid

from bench import run_standalone

#: Acceptable slowdown with metrics on.
TARGET = 0.05


def rate(alias, seconds):
    """Return acquire+release pairs per second, and CPU µs per pair, on a fresh name for ``seconds``.

    The clocks stop only after this process has folded every event the round queued: that work is
    done by the metrics thread later, and must count against the round that caused it. CPU time is
    the whole process's (every thread), so it counts the thread's work too, and it is far less
    disturbed than wall time by other programs on a shared machine.
    """
    import distlock  # noqa: PLC0415 - after django.setup()
    from distlock.metrics import this_process  # noqa: PLC0415

    name = f"bench:metrics:{uuid.uuid4().hex}"
    count = 0
    cpu_started = time.process_time()
    started = now = time.perf_counter()
    end = started + seconds
    while now < end:
        distlock.acquire(name, ttl=30, using=alias).release()
        count += 1
        now = time.perf_counter()
    this_process.drain()
    return count / (time.perf_counter() - started), (time.process_time() - cpu_started) / count * 1e6


def recording_cost(pairs=20000, runs=5):
    """Return the CPU µs that recording one acquire+release costs (buffering both events, folding them).

    Measured in a tight loop on this process's recorder, median of ``runs``: a figure that load on a
    shared machine barely moves, to set beside the noisier throughput comparison.
    """
    import distlock  # noqa: PLC0415
    from distlock.metrics import this_process  # noqa: PLC0415

    lease = distlock.acquire(f"bench:metrics:{uuid.uuid4().hex}", ttl=30, using="locmem")
    lease.release()
    this_process.drain()
    costs = []
    for _ in range(runs):
        started = time.process_time()
        for _ in range(pairs):
            this_process.record_acquire(lease.alias, lease.name, lease.ttl, 0.0002, "acquired", lease)
            this_process.record_release(lease)
        this_process.drain()
        costs.append((time.process_time() - started) / pairs * 1e6)
    this_process.flush()
    return statistics.median(costs)


def compare(alias, *, seconds, rounds):
    """Return the median on/off throughput ratio, the slowdown's interquartile range over the rounds
    (how noisy the machine was), pairs/s off, and CPU µs per pair on and off.

    Each round runs both modes back to back (order alternating), and their ratio is taken within the
    round: load that drifts over the run hits both halves of a pair alike.
    """
    from django.test.utils import override_settings  # noqa: PLC0415

    for enabled in (True, False):  # warm up both: connections, scripts, the metrics thread
        with override_settings(DISTLOCK_METRICS={"ENABLED": enabled}):
            rate(alias, seconds / 4)
    ratios, rates_off, cpu = [], [], {True: [], False: []}
    for round_number in range(rounds):
        measured = {}
        for enabled in (True, False) if round_number % 2 == 0 else (False, True):
            with override_settings(DISTLOCK_METRICS={"ENABLED": enabled}):
                measured[enabled] = rate(alias, seconds)
            cpu[enabled].append(measured[enabled][1])
        ratios.append(measured[True][0] / measured[False][0])
        rates_off.append(measured[False][0])
    quartiles = statistics.quantiles(ratios, n=4)
    return (statistics.median(ratios), (1 - quartiles[2], 1 - quartiles[0]), statistics.median(rates_off),
            statistics.median(cpu[True]), statistics.median(cpu[False]))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.metrics", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--aliases", help="comma-separated DISTLOCK aliases (default: every configured one)")
    parser.add_argument("--seconds", type=float, default=0.3, help="seconds per mode in a round (default 0.3)")
    parser.add_argument("--rounds", type=int, default=20, help="rounds per alias (default 20)")
    args = parser.parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django  # noqa: PLC0415

    django.setup()
    from django.conf import settings  # noqa: PLC0415

    aliases = args.aliases.split(",") if args.aliases else list(settings.DISTLOCK)
    print(f"acquire+release throughput with metrics on vs off: median over {args.rounds} rounds of the on/off "
          f"ratio within a round ({args.seconds:g}s per mode); CPU time per pair, this process, every thread. "
          f"Target: under {TARGET:.0%} slower.")
    cost = recording_cost()
    print(f"Recording one acquire+release (buffer both events, fold them, Prometheus included): {cost:.1f} µs CPU.")
    print(f"  {'alias':<14}{'off /s':>8}{'slower':>9}{'(rounds IQR)':>18}   {'CPU µs/pair on':>15}{'off':>8}"
          f"{'added':>8}   {'recording / pair time':>22}")
    for alias in aliases:
        try:
            ratio, (low, high), rate_off, cpu_on, cpu_off = compare(alias, seconds=args.seconds, rounds=args.rounds)
        except Exception as exc:  # noqa: BLE001 - one broken alias must not hide the others' figures
            print(f"  {alias:<14}failed: {type(exc).__name__}: {exc}")
            continue
        slower = 1 - ratio
        # A median above the target while a quarter of the rounds measured below it is the machine's
        # noise (see the recording cost beside it), not a verdict either way.
        verdict = "ok" if slower < TARGET else "within noise" if low < TARGET else "ABOVE TARGET"
        spread = f"({low:+.1%} to {high:+.1%})"
        print(f"  {alias:<14}{rate_off:>8.0f}{slower:>9.1%}{spread:>18}   {cpu_on:>15.1f}{cpu_off:>8.1f}"
              f"{cpu_on - cpu_off:>8.1f}"
              f"   {cost * rate_off / 1e6:>22.1%}  {verdict}", flush=True)
    return 0


if __name__ == "__main__":
    run_standalone(main)
