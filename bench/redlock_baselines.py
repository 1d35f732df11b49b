"""The Redlock backend (5 masters) against pottery's ``Redlock`` (3 masters) on the same servers, with the target.

    python -m tests.servers --servers redlock -- .venv/bin/python -m bench.redlock_baselines

- distlock's backend: one script per master, written to all five sockets before any reply is read;
  release is one more such round.
- pottery's ``Redlock``, used as its docs show, a new ``Redlock(key=..., masters=...)`` per critical
  section: ``SET NX PX`` on every master through a thread pool created for each call, then a release
  script the same way. It waits by sleeping a random time up to 0.2 s between attempts.
- pottery with all five masters, for a like-for-like reference.

Target (issue 3): uncontended acquire+release with 5 masters ≥ 2× pottery's ``Redlock`` with 3 masters.
Contended figures (4 processes, one key) are printed beside pottery's.
"""


from django.conf import settings

from bench import run_standalone
from bench.harness import (
    Contender,
    ContenderSpec,
    contended,
    print_contended,
    print_uncontended,
    round_options,
    uncontended,
    verdict,
)

#: Target ratio of issue 3.
POTTERY_RATIO_TARGET = 2.0


def pottery_redlock(urls, ttl=30):
    """pottery's ``Redlock`` on ``urls``: a new lock object per acquire, blocking until it is held."""
    from pottery import Redlock  # noqa: PLC0415
    from redis import Redis  # noqa: PLC0415

    masters = frozenset(Redis.from_url(url) for url in urls)

    def acquire(name):
        lock = Redlock(key=name, masters=masters, auto_release_time=ttl)
        lock.acquire(blocking=True)
        return lock

    return Contender(acquire, lambda lock: lock.release())


def redlock_aliases():
    return [alias for alias, entry in settings.DISTLOCK.items()
            if entry.get("BACKEND") == "distlock.backends.redlock.RedlockBackend"
            and len(entry.get("OPTIONS", {}).get("URLS", ())) >= 5]


def run(*, seconds=0.25, rounds=20, contended_seconds=2.0, contended_rounds=3):
    """Print the baselines against the first Redlock alias with 5 masters or more, and the ratio to the target."""
    aliases = redlock_aliases()
    if not aliases:
        print("\nRedlock baselines: no DISTLOCK alias uses RedlockBackend with 5 masters; skipped.")
        return
    alias = aliases[0]
    urls = list(settings.DISTLOCK[alias]["OPTIONS"]["URLS"])
    here = "bench.redlock_baselines"
    api = ContenderSpec(f"distlock '{alias}' {len(urls)} masters (API)", "bench.harness.alias_contender",
                        {"alias": alias})
    backend = ContenderSpec(f"distlock '{alias}' {len(urls)} masters (backend)", "bench.harness.backend_contender",
                            {"alias": alias})
    pottery3 = ContenderSpec("pottery Redlock, 3 masters", f"{here}.pottery_redlock", {"urls": urls[:3]})
    pottery5 = ContenderSpec(f"pottery Redlock, {len(urls)} masters", f"{here}.pottery_redlock", {"urls": urls})

    print(f"\n== Redlock baselines: alias '{alias}' against pottery's Redlock on the same masters ==")
    alone = uncontended([api, backend, pottery3, pottery5], seconds=seconds, rounds=rounds)
    print_uncontended(alone, f"Uncontended acquire+release, 1 process ({rounds} interleaved rounds of {seconds:g} s, "
                             "median ops/s)")
    together = contended([api, pottery3], seconds=contended_seconds, rounds=contended_rounds)
    print_contended(together, f"Contended: 4 processes on one key ({contended_rounds} interleaved rounds of "
                              f"{contended_seconds:g} s, medians)")

    print("\nTargets")
    for spec in (api, backend):
        ratio = alone[spec.label].ops / alone[pottery3.label].ops
        print(f"  {spec.label + ' vs ' + pottery3.label + ':':<70}{ratio:5.2f}x  "
              f"(target >= {POTTERY_RATIO_TARGET}x: {verdict(ratio, POTTERY_RATIO_TARGET)})")
        ratio = alone[spec.label].ops / alone[pottery5.label].ops
        print(f"  {spec.label + ' vs ' + pottery5.label + ':':<70}{ratio:5.2f}x  (for reference)")
    handoff_ratio = together[api.label].median("handoffs") / max(together[pottery3.label].median("handoffs"), 1e-9)
    print(f"  {'contended hand-offs/s vs ' + pottery3.label + ':':<70}{handoff_ratio:5.2f}x  "
          f"(Jain {together[api.label].median('jain'):.3f} vs {together[pottery3.label].median('jain'):.3f})")


def main(argv):
    run(**round_options("python -m bench.redlock_baselines", __doc__, argv))


if __name__ == "__main__":
    run_standalone(main)
