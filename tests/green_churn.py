"""Green threads taking database locks: ``python -m tests.green_churn gevent|eventlet ALIAS PREFIX``.

The process is monkey-patched first, as gunicorn's gevent workers and Celery's gevent and eventlet
pools do. Then:
- a "slow" green thread runs a statement that takes a while on the backend's own connection, while
  other green threads make their first lock calls (the moment a per-thread table of connections
  swept "dead" threads, and closed the slow one's connection under it: green threads are not in
  ``threading.enumerate()``);
- ``GREEN_THREADS`` green threads each acquire and release ``ROUNDS`` locks on a few hot names.
Prints one JSON line: operations, errors (the first tracebacks), overlaps, and the most
connections the backend had open to the server at once (PostgreSQL).
"""

import sys

GREEN_THREADS, ROUNDS, HOT_NAMES = 50, 20, 5


def main(library, alias, prefix):
    if library == "gevent":
        from gevent import monkey

        monkey.patch_all()
        import gevent

        spawn, join_all, sleep = gevent.spawn, gevent.joinall, gevent.sleep
    else:
        import eventlet

        eventlet.monkey_patch()
        spawn, sleep = eventlet.spawn, eventlet.sleep

        def join_all(threads):
            for thread in threads:
                thread.wait()

    import json
    import traceback

    import django

    django.setup()
    import distlock  # noqa: PLC0415 - after django.setup()

    backend = distlock.locks[alias]
    postgres = backend.vendor == "postgresql"
    errors, inside, counts = [], set(), {"operations": 0, "overlaps": 0, "most_connections": 0}

    def slow_statement():
        statement = "SELECT pg_sleep(0.5)" if postgres else "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL " \
            "SELECT i + 1 FROM n WHERE i < 300000) SELECT count(*) FROM n"
        try:
            backend._run(lambda cursor, params: cursor.execute(statement).fetchall(), {},
                         operation="run a slow statement")
            counts["operations"] += 1
        except Exception:  # noqa: BLE001 - every failure counts
            errors.append(traceback.format_exc(limit=8))

    def rounds(i):
        for n in range(ROUNDS):
            name = f"{prefix}:{(i + n) % HOT_NAMES}"
            try:
                with distlock.lock(name, ttl=10, timeout=30, using=alias):
                    if name in inside:
                        counts["overlaps"] += 1
                    inside.add(name)
                    sleep(0.001)  # yield inside the critical section: other green threads contend
                    inside.discard(name)
                    counts["operations"] += 1
            except Exception:  # noqa: BLE001
                errors.append(traceback.format_exc(limit=8))

    def count_connections():
        from django.db import connections  # noqa: PLC0415

        while not finished:
            with connections[backend.database].cursor() as cursor:
                cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                               "AND pid <> pg_backend_pid()")
                counts["most_connections"] = max(counts["most_connections"], cursor.fetchone()[0])
            sleep(0.02)

    finished = False
    watcher = spawn(count_connections) if postgres else None
    slow = spawn(slow_statement)
    sleep(0.05)  # let the slow statement start before the others make their first calls
    join_all([slow, *[spawn(rounds, i) for i in range(GREEN_THREADS)]])
    finished = True
    if watcher is not None:
        join_all([watcher])
    distlock.locks.close_all()
    print(json.dumps({"alias": alias, **counts, "errors": len(errors), "first_errors": errors[:3],
                      "max_connections": backend.settings["MAX_CONNECTIONS"]}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
