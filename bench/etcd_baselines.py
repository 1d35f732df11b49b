"""The etcd backend against the protocol floor and python3-etcd3's ``lock()`` on the same cluster, in one run.

- the protocol floor: one lease per process, granted once; acquire = one ``txn`` (``create_revision(key)
  == 0 → put(key, lease)``), release = one ``txn`` (``create_revision(key) == rev → delete``), sent
  through the gRPC stubs python3-etcd3 ships. No queue, no holder metadata, no ttl bookkeeping.
- python3-etcd3's ``lock()``, used as its docs show: ``client.lock(name, ttl)`` then ``acquire()`` /
  ``release()``. It grants a new lease on every acquire attempt and never revokes it.
- distlock's backend, through the public API and alone.

Targets (issue 3): uncontended acquire+release ≥ 0.9× the floor and ≥ 1.5× python3-etcd3's ``lock()``.
Every write waits for a raft commit, so the floor (two writes per cycle) against ``lock()`` (three: a
lease grant, a txn, a txn) is printed as the ceiling of the second ratio in the same run.
Contended figures (4 processes, one key) are printed beside ``lock()``'s. Afterwards the script counts
the leases each left alive on the cluster.
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

#: Target ratios of issue 3.
FLOOR_RATIO_TARGET = 0.9
STOCK_RATIO_TARGET = 1.5

#: Lease TTL of the floor's and the stock recipe's leases: far longer than a run, so none expires mid-run.
BENCH_LEASE_TTL = 120


def floor(endpoint):
    """The protocol floor: one process-wide lease, one txn to acquire, one txn to release (uncontended only)."""
    import grpc  # noqa: PLC0415
    from etcd3 import etcdrpc  # noqa: PLC0415

    channel = grpc.insecure_channel(endpoint)
    kv = etcdrpc.KVStub(channel)
    lease_id = etcdrpc.LeaseStub(channel).LeaseGrant(etcdrpc.LeaseGrantRequest(TTL=BENCH_LEASE_TTL), timeout=5).ID

    def acquire(name):
        key = f"/bench-floor/{name}".encode()
        response = kv.Txn(etcdrpc.TxnRequest(
            compare=[etcdrpc.Compare(result=etcdrpc.Compare.EQUAL, target=etcdrpc.Compare.CREATE, key=key,
                                     create_revision=0)],
            success=[etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=key, value=b"owner", lease=lease_id))],
        ), timeout=5)
        if not response.succeeded:
            raise RuntimeError("the floor does not wait: use it uncontended only")
        return key, response.header.revision

    def release(handle):
        key, revision = handle
        kv.Txn(etcdrpc.TxnRequest(
            compare=[etcdrpc.Compare(result=etcdrpc.Compare.EQUAL, target=etcdrpc.Compare.CREATE, key=key,
                                     create_revision=revision)],
            success=[etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=key))],
        ), timeout=5)

    return Contender(acquire, release)


def stock_lock(endpoint):
    """python3-etcd3's ``lock()``: a lease grant and a txn per acquire, a txn per release; waits on a watch."""
    import etcd3  # noqa: PLC0415

    host, port = endpoint.rsplit(":", 1)
    client = etcd3.client(host=host, port=int(port), timeout=10)

    def acquire(name):
        lock = client.lock(f"bench-stock/{name}", ttl=BENCH_LEASE_TTL)
        if not lock.acquire(timeout=None):
            raise RuntimeError("python3-etcd3's lock() gave up")
        return lock

    return Contender(acquire, lambda lock: lock.release())


def etcd_aliases():
    return [alias for alias, entry in settings.DISTLOCK.items()
            if entry.get("BACKEND") == "distlock.backends.etcd.EtcdBackend"]


def first_endpoint(options):
    """The endpoint distlock's backend talks to first: the floor and the stock recipe use the same one."""
    endpoints = options.get("ENDPOINTS")
    if endpoints is None:
        return f"{options.get('HOST') or '127.0.0.1'}:{options.get('PORT') or 2379}"
    return (endpoints.split(",") if isinstance(endpoints, str) else list(endpoints))[0].strip()


def live_leases(endpoint):
    """Return how many leases the cluster holds (the lease list API, through etcd's JSON gateway)."""
    from tests.servers.etcd import gateway_call  # noqa: PLC0415

    reply = gateway_call(int(endpoint.rsplit(":", 1)[1]), "/v3/lease/leases", {}, timeout=10)
    return None if reply is None else len(reply.get("leases", []))


def run(*, seconds=0.25, rounds=20, contended_seconds=2.0, contended_rounds=3):
    """Print the baselines against the first etcd alias, and the ratios against the targets."""
    aliases = etcd_aliases()
    if not aliases:
        print("\netcd baselines: no DISTLOCK alias uses EtcdBackend; skipped.")
        return
    alias = aliases[0]
    endpoint = first_endpoint(settings.DISTLOCK[alias]["OPTIONS"])
    here = "bench.etcd_baselines"
    api = ContenderSpec(f"distlock '{alias}' (public API)", "bench.harness.alias_contender", {"alias": alias})
    backend = ContenderSpec(f"distlock '{alias}' (backend only)", "bench.harness.backend_contender", {"alias": alias})
    bare = ContenderSpec("floor: bare txn + txn, 1 lease", f"{here}.floor", {"endpoint": endpoint})
    stock = ContenderSpec("python3-etcd3 lock()", f"{here}.stock_lock", {"endpoint": endpoint})

    print(f"\n== etcd baselines: alias '{alias}' against the protocol floor and python3-etcd3's lock() "
          f"on the same cluster ({endpoint} first) ==")
    leases_before = live_leases(endpoint)
    alone = uncontended([api, backend, bare, stock], seconds=seconds, rounds=rounds)
    print_uncontended(alone, f"Uncontended acquire+release, 1 process ({rounds} interleaved rounds of {seconds:g} s, "
                             "median ops/s)")
    together = contended([api, stock], seconds=contended_seconds, rounds=contended_rounds)
    print_contended(together, f"Contended: 4 processes on one key ({contended_rounds} interleaved rounds of "
                              f"{contended_seconds:g} s, medians)")

    print("\nTargets")
    for spec in (api, backend):
        for baseline, target in ((bare, FLOOR_RATIO_TARGET), (stock, STOCK_RATIO_TARGET)):
            ratio = alone[spec.label].ops / alone[baseline.label].ops
            print(f"  {spec.label + ' vs ' + baseline.label + ':':<72}{ratio:5.2f}x  "
                  f"(target >= {target}x: {verdict(ratio, target)})")
    ceiling = alone[bare.label].ops / alone[stock.label].ops
    print(f"  {'(ceiling) floor vs python3-etcd3 lock():':<72}{ceiling:5.2f}x  (the most any lock making two writes "
          "could reach in this run: lock() makes three)")
    handoff_ratio = together[api.label].median("handoffs") / max(together[stock.label].median("handoffs"), 1e-9)
    print(f"  {'contended hand-offs/s vs python3-etcd3 lock():':<72}{handoff_ratio:5.2f}x  "
          f"(Jain {together[api.label].median('jain'):.3f} vs {together[stock.label].median('jain'):.3f})")
    leases_after = live_leases(endpoint)
    if leases_before is not None and leases_after is not None:
        print(f"\nLeases alive after this run: {leases_after - leases_before:+d} "
              f"(python3-etcd3's lock() leaves one per acquire attempt until its {BENCH_LEASE_TTL} s TTL runs out; "
              "distlock one per process, revoked on close)")


def main(argv):
    run(**round_options("python -m bench.etcd_baselines", __doc__, argv))


if __name__ == "__main__":
    run_standalone(main)
