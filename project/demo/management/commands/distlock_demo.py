"""Show distlock at work: several processes take turns on one lock, then a paused holder is fenced off."""

import multiprocessing
import os
import random
import time

from django.core.management.base import BaseCommand
from django.db import connections

import distlock

RESOURCE = "demo:printer"


def worker(number, jobs, ttl, alias, results):
    """Run in a child process: take the lock ``jobs`` times, 'print' while holding it, report each turn."""
    # The child inherits the parent's database connection objects; give it its own.
    for connection in connections.all(initialized_only=True):
        connection.inc_thread_sharing()
        connection.connection = None
    for _ in range(jobs):
        asked = time.monotonic()
        with distlock.lock(RESOURCE, ttl=ttl, timeout=30, using=alias) as lease:
            got = time.monotonic()
            time.sleep(random.uniform(0.05, 0.15))  # the protected work
            results.put((f"worker-{number}", os.getpid(), lease.token, got - asked, got, time.monotonic()))


class Command(BaseCommand):
    help = "Run a short demo: processes contend for one lock; prints holders, tokens and waits."

    def add_arguments(self, parser):
        parser.add_argument("--workers", type=int, default=4, help="contending processes (default 4)")
        parser.add_argument("--jobs", type=int, default=3, help="turns per process (default 3)")
        parser.add_argument("--using", default="default", help="DISTLOCK alias (default: 'default')")

    def handle(self, *args, workers, jobs, using, **options):
        backend = distlock.locks[using]
        self.stdout.write(self.style.MIGRATE_HEADING(
            f"distlock demo: {workers} processes x {jobs} turns on lock {RESOURCE!r}, "
            f"alias '{using}' ({type(backend).__name__})"))
        results = multiprocessing.get_context("fork").Queue()
        processes = [multiprocessing.get_context("fork").Process(target=worker, args=(n, jobs, 5, using, results))
                     for n in range(1, workers + 1)]
        started = time.monotonic()
        for process in processes:
            process.start()
        turns = [results.get(timeout=120) for _ in range(workers * jobs)]
        for process in processes:
            process.join()
        turns.sort(key=lambda turn: turn[4])
        for who, pid, token, waited, got, left in turns:
            self.stdout.write(f"  {got - started:6.2f}s  {who} (pid {pid}) holds the lock, "
                              f"fencing token {token}, waited {waited * 1000:5.0f} ms")
        overlaps = sum(1 for a, b in zip(turns, turns[1:]) if b[4] < a[5])
        tokens = [turn[2] for turn in turns]
        increasing = all(a < b for a, b in zip(tokens, tokens[1:]))
        self.stdout.write(f"  {len(turns)} turns, {overlaps} overlapping, tokens strictly increasing: {increasing}")
        self._show_expiry(using)

    def _show_expiry(self, using):
        self.stdout.write(self.style.MIGRATE_HEADING("A holder that pauses past its ttl loses the lock:"))
        slow = distlock.acquire("demo:report", ttl=0.5, using=using)
        self.stdout.write(f"  A holds 'demo:report' with token {slow.token} and a ttl of 0.5 s, then stalls ...")
        time.sleep(0.7)
        fast = distlock.acquire("demo:report", ttl=5, timeout=5, using=using)
        self.stdout.write(f"  B takes it over with token {fast.token} (> {slow.token}).")
        try:
            slow.check()
        except distlock.LockLost as exc:
            self.stdout.write(f"  A wakes up and checks its lease: LockLost: {exc}")
        self.stdout.write(f"  A's release deletes nothing: release() -> {slow.release()}")
        fast.release()
        self.stdout.write(self.style.SUCCESS(
            "  A store that keeps the highest token it has seen refuses A's late writes (see FencedModel)."))
