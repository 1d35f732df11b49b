"""Threads that come and go, taking locks: ``python -m tests.thread_churn ALIAS SECONDS PREFIX [GENERATIONS REQUESTS]``.

The thread patterns of real deployments, run together for SECONDS on one alias (and each on until it
went through at least GENERATIONS executor generations, or REQUESTS request threads, however long a
loaded machine makes that take):
- executor generations: a ``ThreadPoolExecutor`` of 10 threads, each doing 40 acquire/release,
  shut down and recreated, again and again (what ``asyncio.to_thread`` and
  ``sync_to_async(thread_sensitive=False)`` do to the threads under them);
- a thread per request: a new thread for every request, 8 at once, each holding one of 5 names
  (what ``runserver`` does).
Thread idents are reused as soon as a thread ends, so per-thread state keyed by them is put to the
test. Prints one JSON line: operations, errors (with the first tracebacks), overlaps (two threads
inside the same name's critical section at once), and how many executor generations and request
threads came and went. A crash (SIGSEGV) shows as the exit status.
"""

import json
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

EXECUTOR_THREADS, ROUNDS_PER_THREAD = 10, 40
REQUESTS_AT_ONCE, REQUEST_NAMES = 8, 5
#: Generous, so that only a fault makes a call fail: contention alone waits for a few milliseconds.
TTL, TIMEOUT = 10, 30


class Tally:
    """What the threads did, and the names each is inside right now (to catch overlaps)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.operations = 0
        self.errors = []
        self.overlaps = 0
        self.inside = set()
        #: Executors shut down and request threads that ended: the threads that came and went.
        self.generations = 0
        self.request_threads = 0

    def critical_section(self, name):
        with self.lock:
            if name in self.inside:
                self.overlaps += 1
            self.inside.add(name)
        with self.lock:
            self.inside.discard(name)
            self.operations += 1

    def error(self):
        with self.lock:
            self.errors.append(traceback.format_exc(limit=8))


def take(distlock, alias, name, tally):
    try:
        with distlock.lock(name, ttl=TTL, timeout=TIMEOUT, using=alias):
            tally.critical_section(name)
    except Exception:  # noqa: BLE001 - every failure counts, whatever its type
        tally.error()


def executor_generations(distlock, alias, prefix, tally, ends, at_least):
    def rounds(i):
        for _ in range(ROUNDS_PER_THREAD):
            take(distlock, alias, f"{prefix}:executor:{i}", tally)

    while time.monotonic() < ends or tally.generations < at_least:
        with ThreadPoolExecutor(EXECUTOR_THREADS) as pool:
            list(pool.map(rounds, range(EXECUTOR_THREADS)))
        with tally.lock:
            tally.generations += 1


def thread_per_request(distlock, alias, prefix, tally, ends, at_least):
    slots = threading.BoundedSemaphore(REQUESTS_AT_ONCE)
    threads = []
    request = 0
    while time.monotonic() < ends or request < at_least:
        slots.acquire()

        def serve(n=request):
            try:
                take(distlock, alias, f"{prefix}:order:{n % REQUEST_NAMES}", tally)
            finally:
                with tally.lock:
                    tally.request_threads += 1
                slots.release()

        thread = threading.Thread(target=serve)
        thread.start()
        threads.append(thread)
        threads = [t for t in threads if t.is_alive()]
        request += 1
    for thread in threads:
        thread.join()


def main(alias, seconds, prefix, generations=0, requests=0):
    import django

    django.setup()
    import distlock  # noqa: PLC0415 - after django.setup()

    tally = Tally()
    ends = time.monotonic() + seconds
    loads = [threading.Thread(target=load, args=(distlock, alias, prefix, tally, ends, at_least))
             for load, at_least in ((executor_generations, generations), (thread_per_request, requests))]
    for load in loads:
        load.start()
    for load in loads:
        load.join()
    distlock.locks.close_all()
    print(json.dumps({"alias": alias, "operations": tally.operations, "errors": len(tally.errors),
                      "first_errors": tally.errors[:3], "overlaps": tally.overlaps,
                      "generations": tally.generations, "request_threads": tally.request_threads}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3], *(int(count) for count in sys.argv[4:6]))
