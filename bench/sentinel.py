"""Redis behind Sentinel, with and without ``REPLICAS_ACK``: what waiting for a replica's acknowledgement costs.

    .venv/bin/python -m bench.sentinel [--seconds 0.25] [--rounds 20]

Starts a deployment of its own (a master, its replica and three Sentinels on loopback ports, as the
tests run it) and measures uncontended acquire+release of the Redis backend, in interleaved rounds:

- the master's own URL (no Sentinel): the reference;
- through Sentinel: the same master, found by asking the Sentinels;
- through Sentinel with ``REPLICAS_ACK=1``: each grant is reported only once the replica has it
  (``WAIT 1`` on the grant's connection), one round trip more plus the replica's acknowledgement.

Prints the ratios of figures measured side by side (median over rounds). No target: the figure is
the one the README's Redis Sentinel section quotes.
"""

import statistics
import tempfile

from bench import run_standalone
from bench.harness import Contender, ContenderSpec, print_uncontended, round_options, uncontended


def backend_on(options, ttl=30):
    """The Redis backend with ``options``, without the API layer: acquire and release."""
    from distlock.backends.redis import RedisBackend  # noqa: PLC0415 - after django.setup()

    backend = RedisBackend("bench-sentinel", options)
    return Contender(lambda name: backend.acquire(name, ttl=ttl, timeout=None, blocking=True), backend.release)


def run(*, seconds=0.25, rounds=20):
    """Print acquire+release through Sentinel with and without ``REPLICAS_ACK``, and their ratio."""
    from tests.servers.redis import SentinelDeployment  # noqa: PLC0415 - the tests' server fixtures

    with tempfile.TemporaryDirectory(prefix="distlock-bench-sentinel-") as workdir, \
            SentinelDeployment(workdir) as deployment:
        here = "bench.sentinel.backend_on"
        master = ContenderSpec("master's URL, no Sentinel", here,
                               {"options": {"URL": f"redis://127.0.0.1:{deployment.master().port}/0"}})
        sentinel = ContenderSpec("through Sentinel", here, {"options": deployment.options()})
        acknowledged = ContenderSpec("through Sentinel, REPLICAS_ACK=1", here,
                                     {"options": deployment.options(REPLICAS_ACK=1)})
        print("\n== Redis Sentinel: one master, one replica, three Sentinels on loopback ==")
        results = uncontended([master, sentinel, acknowledged], seconds=seconds, rounds=rounds)
        print_uncontended(results, f"Uncontended acquire+release, 1 process ({rounds} interleaved rounds of "
                                   f"{seconds:g} s, median ops/s)")
    ratio = statistics.median(a / b for a, b in zip(results[acknowledged.label].rounds,
                                                     results[sentinel.label].rounds))
    overhead = statistics.median(a / b for a, b in zip(results[sentinel.label].rounds, results[master.label].rounds))
    extra_us = (results[acknowledged.label].percentile_us(0.5) - results[sentinel.label].percentile_us(0.5))
    print("\nRatios (median over rounds of the two figures measured side by side)")
    print(f"  through Sentinel vs the master's URL:           {overhead:5.2f}x ops/s")
    print(f"  REPLICAS_ACK=1 vs without, through Sentinel:    {ratio:5.2f}x ops/s, p50 +{extra_us:.0f} µs per "
          "acquire+release")


def main(argv):
    options = round_options("python -m bench.sentinel", __doc__, argv)
    run(seconds=options["seconds"], rounds=options["rounds"])


if __name__ == "__main__":
    run_standalone(main)
