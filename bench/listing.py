"""Listing held locks at scale: the admin page's first page and ``distlock list``'s stream, 1,000 to 100,000 held.

    python -m tests.servers --servers postgres,redis,zookeeper,etcd -- python -m bench.listing [--sizes 1000,10000]

Per alias, the locks are made by the backend's own acquire (``locks[alias].acquire(name, ttl=3600,
blocking=False, auto_renew=False)``), ``--threads`` at a time, under a name prefix private to the run;
the same process holds them all (ZooKeeper and etcd hold a lock through the process's session). The
alias is topped up from one size to the next, measured at each, and every lock is released at the end.
Printed per alias and size:

- *fill s*: seconds to acquire the locks added to reach the size (``+N``), and their rate;
- *page ms*: ``inventory.held_locks(alias, limit=500)``, the admin page's read: median of 5 and max;
- *stream s*: going through every held lock with ``inventory.each_held(alias)``, as ``distlock list``
  does (pages of ``PAGE_SIZE``), stopped after ``--stream-budget`` seconds (*seen* then ends in +);
  *stream peak*: the tracemalloc peak of that listing (a second, traced pass: tracemalloc slows
  Python down, so the seconds come from the untraced pass);
- *full s* and *full peak*: the same for the old read, ``held_locks()`` with no limit, for contrast;
  not run where the last size read in full predicts more than ``--stream-budget`` seconds, not traced after an
  untraced pass over ``--trace-max`` seconds.

The listings have no prefix, as the admin page and ``distlock list`` open: the aliases of the test
settings are private to the run, so every lock listed is one of ours (*seen* says how many were).
locmem and Redlock are shown for contrast up to ``--contrast-max`` locks (they read everything and cut).
``--stop-at HH:MM`` (UTC) skips the sizes not yet started at that time, and ``--fill-by HH:MM`` stops
filling (the size is then measured with the locks held so far); ZooKeeper, the slowest to fill, runs last.
``DISTLOCK_BENCH_LISTING_SIZES`` sets the sizes when ``python -m bench`` runs this module.
"""

import argparse
import concurrent.futures
import datetime
import os
import statistics
import time
import tracemalloc
import uuid

from django.conf import settings
from django.utils.module_loading import import_string

from bench import run_standalone

#: Aliases measured at every size, and aliases shown for contrast up to ``--contrast-max`` only.
MAIN_BACKENDS = ("DatabaseBackend", "RedisBackend", "ZooKeeperBackend", "EtcdBackend")
CONTRAST_BACKENDS = ("LocMemBackend", "RedlockBackend")
#: The admin page's page size (``ROWS_PER_ALIAS``) and how often its first page is read.
FIRST_PAGE_LIMIT = 500
FIRST_PAGE_READS = 5
#: Long enough that no lock expires during the run; no renewal traffic.
TTL = 3600
#: Locks acquired per batch while filling (``--fill-by`` is checked between batches).
FILL_CHUNK = 5000
#: The sizes when ``python -m bench`` runs this module (it passes no arguments).
SIZES_VARIABLE = "DISTLOCK_BENCH_LISTING_SIZES"
DEFAULT_SIZES = "1000,10000,100000"
#: What a row can say under the table: a listing that failed or was not run.
NOTES = ("page error", "stream error", "full error", "full skipped")


def chosen_aliases(names=None):
    """Return ``[(alias, contrast)]`` for the configured aliases worth measuring, in settings order."""
    chosen = []
    for alias in names or settings.DISTLOCK:
        try:
            backend = import_string(settings.DISTLOCK[alias]["BACKEND"]).__name__
        except ImportError as exc:
            print(f"[{alias}] skipped: its backend cannot be imported ({exc})")
            continue
        if alias == "redis_cache" and not names:
            continue  # the same backend as "redis", through a Django cache alias
        if backend in MAIN_BACKENDS or backend in CONTRAST_BACKENDS:
            chosen.append((alias, backend in CONTRAST_BACKENDS, backend))
    # The slowest to fill last, so that --stop-at and --fill-by cut it rather than the others.
    chosen.sort(key=lambda entry: (not entry[1], entry[2] == "ZooKeeperBackend"))
    return [(alias, contrast) for alias, contrast, _ in chosen]


def describe(alias):
    """Return the alias's backend, with the database vendor for the database backend."""
    from django.db import connections  # noqa: PLC0415

    from distlock.handler import locks  # noqa: PLC0415

    backend = locks[alias]
    label = type(backend).__name__.removesuffix("Backend")
    if label == "Database":
        label += f" ({connections[backend.database].vendor})"
    return label


def fill(backend, names, threads):
    """Acquire every name through ``backend`` with ``threads`` at a time; return ``(leases, seconds, errors)``."""
    def take(name):
        try:
            return backend.acquire(name, ttl=TTL, timeout=None, blocking=False, auto_renew=False), None
        except Exception as exc:  # noqa: BLE001 - counted and shown
            return None, f"{type(exc).__name__}: {exc}"

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(take, names, chunksize=64))
    seconds = time.perf_counter() - started
    leases = [lease for lease, _ in results if lease is not None]
    errors = [error for _, error in results if error is not None]
    return leases, seconds, errors


def release(leases, threads):
    """Release every lease, ``threads`` at a time; return ``(seconds, errors)``."""
    def give_back(lease):
        try:
            lease.release()
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {exc}"
        return None

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        errors = [error for error in pool.map(give_back, leases, chunksize=64) if error]
    return time.perf_counter() - started, errors


def first_page(alias):
    """Return the seconds of each of ``FIRST_PAGE_READS`` reads of the admin page's first page, and its row count."""
    from distlock import inventory  # noqa: PLC0415

    times, rows = [], 0
    for _ in range(FIRST_PAGE_READS):
        started = time.perf_counter()
        [entry] = inventory.held_locks(alias, limit=FIRST_PAGE_LIMIT)
        times.append(time.perf_counter() - started)
        if entry.error:
            raise RuntimeError(entry.error)
        rows = len(entry.locks)
    return times, rows


def timed_and_traced(read, *, trace_max):
    """Run ``read()`` (returning ``(count, complete)``) untraced, then traced unless that took over ``trace_max`` s.

    Return ``(count, complete, seconds, tracemalloc peak bytes or None)``.
    """
    started = time.perf_counter()
    count, complete = read()
    seconds = time.perf_counter() - started
    if seconds > trace_max:
        return count, complete, seconds, None
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        read()
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    return count, complete, seconds, peak


def stream(alias, budget):
    """Go through ``each_held(alias)``; stop after ``budget`` seconds. Return ``(locks seen, went through all)``."""
    from distlock import inventory  # noqa: PLC0415

    count, deadline = 0, time.perf_counter() + budget
    for count, _ in enumerate(inventory.each_held(alias), 1):
        if count % inventory.PAGE_SIZE == 0 and time.perf_counter() > deadline:
            return count, False
    return count, True


def full_read(alias):
    """Read every held lock of ``alias`` at once, the old way. Return ``(locks read, True)``."""
    from distlock.handler import locks  # noqa: PLC0415

    return len(locks[alias].held_locks()), True


def measure_size(alias, *, stream_budget, trace_max, full_expected):
    """Return the listing figures of ``alias``; a failed listing is kept as its error.

    The stream is always traced (memory is its point); the full read is skipped when ``full_expected``
    (its seconds, linear from the last size read in full) is over ``stream_budget``, and traced only if its
    untraced pass took ``trace_max`` seconds at most.
    """
    row = {}
    try:
        times, row["page rows"] = first_page(alias)
        row["page ms"] = (1000 * statistics.median(times), 1000 * max(times))
    except Exception as exc:  # noqa: BLE001 - shown in the table: a size a backend cannot list is a result
        row["page error"] = f"{type(exc).__name__}: {exc}"
    try:
        row["stream"] = timed_and_traced(lambda: stream(alias, stream_budget), trace_max=float("inf"))
    except Exception as exc:  # noqa: BLE001
        row["stream error"] = f"{type(exc).__name__}: {exc}"
    if full_expected is not None and full_expected > stream_budget:
        row["full skipped"] = f"not run: about {full_expected:.0f} s expected (linear from the last full read)"
        return row
    try:
        row["full"] = timed_and_traced(lambda: full_read(alias), trace_max=trace_max)
    except Exception as exc:  # noqa: BLE001
        row["full error"] = f"{type(exc).__name__}: {exc}"
    return row


def now_utc():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M")


def run_alias(alias, sizes, *, threads, stop_at, fill_by, stream_budget, trace_max):
    """Fill ``alias`` size by size, measure each, release everything; return the rows.

    No size starts after ``stop_at`` (HH:MM UTC) and filling stops at ``fill_by``: the size is then
    measured with the locks held so far.
    """
    from distlock.handler import locks  # noqa: PLC0415

    backend = locks[alias]
    prefix = f"bench-listing-{uuid.uuid4().hex[:8]}-"
    leases, rows, full_rate = [], [], None
    try:
        for size in sizes:
            if stop_at is not None and now_utc() >= stop_at:
                rows.append({"size": size, "skipped": f"not started: past {stop_at} UTC"})
                print(f"  [{alias}] {size}: skipped, past {stop_at} UTC", flush=True)
                continue
            row = {"size": size, "added": 0, "fill": 0.0, "fill errors": []}
            while len(leases) < size and not (fill_by is not None and now_utc() >= fill_by):
                names = [f"{prefix}{index:06d}" for index in range(len(leases), min(size, len(leases) + FILL_CHUNK))]
                made, seconds, errors = fill(backend, names, threads)
                leases += made
                row["added"] += len(names)
                row["fill"] += seconds
                row["fill errors"] += errors
                if not made:
                    break
            print(f"  [{alias}] {len(leases)} held (+{row['added']} in {row['fill']:.1f} s, "
                  f"{len(row['fill errors'])} errors)", flush=True)
            row["held"] = len(leases)
            row.update(measure_size(alias, stream_budget=stream_budget, trace_max=trace_max,
                                    full_expected=None if full_rate is None else full_rate * len(leases)))
            if "full" in row and row["full"][0]:
                full_rate = row["full"][2] / row["full"][0]
            rows.append(row)
            print(f"  [{alias}] {len(leases)}: {summary(row)}", flush=True)
    finally:
        seconds, errors = release(leases, threads)
        left = _left(alias, prefix)
        print(f"  [{alias}] released {len(leases)} in {seconds:.1f} s ({len(errors)} errors"
              f"{', first: ' + errors[0] if errors else ''}); still listed under the run's prefix: {left}", flush=True)
    return rows


def _left(alias, prefix):
    from distlock.handler import locks  # noqa: PLC0415

    try:
        return len(locks[alias].held_locks(prefix))
    except Exception as exc:  # noqa: BLE001
        return f"? ({type(exc).__name__}: {exc})"


def summary(row):
    parts = []
    if "page ms" in row:
        parts.append(f"page {row['page ms'][0]:.1f}/{row['page ms'][1]:.1f} ms ({row['page rows']} rows)")
    for key in ("stream", "full"):
        if key in row:
            count, complete, seconds, peak = row[key]
            parts.append(f"{key} {count}{'' if complete else ' (stopped)'} in {seconds:.2f} s, peak "
                         + ("not traced" if peak is None else f"{peak / 2**20:.2f} MiB"))
    parts += [f"{key}: {row[key]}" for key in NOTES if key in row]
    return "; ".join(parts)


def print_table(results):
    print(f"\nListing held locks: filled by each backend's own acquire (ttl {TTL} s, no renewal), by 'thr' threads "
          f"of one process; first page = inventory.held_locks(alias, limit={FIRST_PAGE_LIMIT}), median/max of "
          f"{FIRST_PAGE_READS}; stream = inventory.each_held(alias), pages of 500; full = held_locks() with no limit; "
          "peak = tracemalloc peak of a second, traced pass (— : not traced, the untraced pass was too long); "
          "seen + : the stream stopped at its time budget")
    print(f"  {'alias':<18}{'backend':<21}{'thr':>4}{'held':>7}{'fill s':>8}{'locks/s':>8}{'page ms p50':>12}{'max':>7}"
          f"{'stream s':>9}{'seen':>8}{'peak MiB':>9}{'full s':>8}{'peak MiB':>9}")
    errors = []
    for alias, label, threads, rows in results:
        for row in rows:
            if "skipped" in row:
                print(f"  {alias:<18}{label:<21}{threads:>4}{row['size']:>7}  {row['skipped']}")
                continue
            fill = f"{row['fill']:>8.1f}{row['added'] / row['fill'] if row['fill'] else 0:>8.0f}"
            page = (f"{row['page ms'][0]:>12.1f}{row['page ms'][1]:>7.1f}" if "page ms" in row
                    else f"{'failed':>12}{'':>7}")
            cells = []
            for key in ("stream", "full"):
                if key in row:
                    count, complete, seconds, peak = row[key]
                    cells.append((f"{seconds:>9.2f}" if key == "stream" else f"{seconds:>8.2f}")
                                 + (f"{count:>7}{'' if complete else '+'}" if key == "stream" else "")
                                 + (f"{'—':>9}" if peak is None else f"{peak / 2**20:>9.2f}"))
                else:
                    word = "not run" if f"{key} skipped" in row else "failed"
                    cells.append(f"{word:>9}{'':>8}{'':>9}" if key == "stream" else f"{word:>8}{'':>9}")
            print(f"  {alias:<18}{label:<21}{threads:>4}{row['held']:>7}{fill}{page}{''.join(cells)}")
            errors += [(alias, row["held"], key, row[key]) for key in NOTES if key in row]
            if row["held"] < row["size"]:
                errors.append((alias, row["held"], "fill", f"stopped at {row['held']} of {row['size']} (--fill-by)"))
            if row["fill errors"]:
                errors.append((alias, row["held"], f"fill ({len(row['fill errors'])} errors)", row["fill errors"][0]))
    for alias, held, key, error in errors:
        print(f"  {alias} at {held}: {key}: {error[:300]}")


def threads_for(alias, args):
    overrides = dict(pair.split("=") for pair in args.alias_threads.split(",") if pair)
    return int(overrides.get(alias, args.threads))


def main(argv):
    parser = argparse.ArgumentParser(prog="python -m bench.listing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=os.environ.get(SIZES_VARIABLE, DEFAULT_SIZES),
                        help=f"held locks per step (default ${SIZES_VARIABLE} or {DEFAULT_SIZES})")
    parser.add_argument("--aliases", help="comma-separated DISTLOCK aliases (default: every one measured)")
    parser.add_argument("--threads", type=int, default=16, help="threads acquiring and releasing (default 16)")
    parser.add_argument("--contrast-max", type=int, default=10000,
                        help="largest size for locmem and Redlock, which read everything (default 10000)")
    parser.add_argument("--stop-at", help="HH:MM UTC: sizes not started by then are skipped")
    parser.add_argument("--fill-by", help="HH:MM UTC: filling stops then, and the size is measured with what is held")
    parser.add_argument("--stream-budget", type=float, default=45.0,
                        help="a stream stops after this many seconds (shown with +), and a full read expected to "
                             "take longer is not run (default 45)")
    parser.add_argument("--trace-max", type=float, default=30.0,
                        help="no traced pass after an untraced pass longer than this (peak shown as —; default 30)")
    parser.add_argument("--alias-threads", default="",
                        help="per-alias threads, e.g. zookeeper=64,etcd=64 (default: --threads)")
    args = parser.parse_args(argv)
    sizes = sorted(int(size) for size in args.sizes.split(","))
    results = []
    for alias, contrast in chosen_aliases(args.aliases.split(",") if args.aliases else None):
        alias_sizes = [size for size in sizes if not contrast or size <= args.contrast_max]
        label = describe(alias)
        print(f"[{alias}] {label}: {', '.join(map(str, alias_sizes))}", flush=True)
        threads = threads_for(alias, args)
        results.append((alias, label, threads, run_alias(alias, alias_sizes, threads=threads, stop_at=args.stop_at,
                                                         fill_by=args.fill_by, stream_budget=args.stream_budget,
                                                         trace_max=args.trace_max)))
    print_table(results)
    return 0


if __name__ == "__main__":
    run_standalone(main)
