"""Auto-renewed leases on Django's in-memory SQLite test database:
``python -m tests.shared_cache_sqlite SECONDS [FLUSH_INTERVAL]``.

Without a test ``NAME``, Django's SQLite test database is ``file:memorydb_default?mode=memory&cache=shared``:
every connection of the process shares one cache, whose table locks do not wait in ``busy_timeout``.
Three leases with ttl 1 s and ``auto_renew`` are held for SECONDS while 4 threads take and give back
other locks and one thread writes rows through the ORM, as a test would, while the metrics are flushed
every FLUSH_INTERVAL seconds (default: the setting's default); then a lock is taken inside
``transaction.atomic()``, as in a ``TestCase``. Prints one JSON line: leases lost (``lock_lost``),
errors of the lock calls and of the ORM writes, turns and rows written.
"""

import json
import sys
import threading
import time

import django
from django.conf import settings

settings.configure(
    SECRET_KEY="shared-cache",
    INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "distlock"],
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3",
                           "NAME": "file:memorydb_default?mode=memory&cache=shared"}},
    USE_TZ=True,
    **({"DISTLOCK_METRICS": {"FLUSH_INTERVAL": float(sys.argv[2])}} if len(sys.argv) > 2 else {}),
)


def main(seconds):
    django.setup()
    from django.core.management import call_command  # noqa: PLC0415 - after setup
    from django.contrib.auth.models import Group  # noqa: PLC0415
    from django.db import connection, connections, transaction  # noqa: PLC0415

    import distlock  # noqa: PLC0415
    from distlock.signals import lock_lost  # noqa: PLC0415

    connection.ensure_connection()  # the in-memory database lives while one connection is open
    call_command("migrate", verbosity=0)
    lost, errors, turns, orm_errors, rows = [], [], [0], [], [0]
    lock_lost.connect(lambda sender, lease, reason, **kwargs: lost.append(f"{lease.name}: {reason}"), weak=False)
    stop = time.monotonic() + seconds

    def churn(number):
        while time.monotonic() < stop:
            try:
                with distlock.lock(f"churn:{number}", ttl=5, timeout=5):
                    turns[0] += 1
            except Exception as exc:  # noqa: BLE001 - reported, and the test fails on it
                errors.append(f"{type(exc).__name__}: {exc}")

    def write_rows():
        while time.monotonic() < stop:
            try:
                Group.objects.create(name=f"group {rows[0]}")
                rows[0] += 1
            except Exception as exc:  # noqa: BLE001
                orm_errors.append(f"{type(exc).__name__}: {exc}")
        connections.close_all()

    held = [distlock.acquire(f"held:{n}", ttl=1, auto_renew=True) for n in range(3)]
    threads = [threading.Thread(target=churn, args=(number,)) for number in range(4)]
    threads.append(threading.Thread(target=write_rows))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for lease in held:
        try:
            lease.check()
            if not lease.release():
                errors.append(f"{lease.name}: gone at its release")
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{lease.name}: {type(exc).__name__}: {exc}")
    try:
        with transaction.atomic():
            Group.objects.create(name="inside a test's transaction")
            with distlock.lock("inside-atomic", ttl=5):
                turns[0] += 1
    except Exception as exc:  # noqa: BLE001
        errors.append(f"inside atomic(): {type(exc).__name__}: {exc}")
    print(json.dumps({"lost": lost, "errors": errors[:5], "error_count": len(errors), "turns": turns[0],
                      "orm_errors": orm_errors[:5], "orm_error_count": len(orm_errors), "rows": rows[0]}))


if __name__ == "__main__":
    main(float(sys.argv[1]))
