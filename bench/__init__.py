"""Benchmarks that print figures (not timed tests): ``python -m bench`` runs them all."""

import os
import sys


#: The server ``python -m tests.servers --servers`` starts for an alias of ``tests.settings``.
SERVER_OF_ALIAS = {"postgres": "postgres", "redis": "redis", "redis_cache": "redis", "redlock": "redlock",
                   "zookeeper": "zookeeper", "etcd": "etcd"}


def configured_aliases(aliases):
    """Return the aliases of ``aliases`` that are configured, printing a line for each one skipped."""
    from django.conf import settings  # noqa: PLC0415 - settings are set up by the caller

    chosen = []
    for alias in aliases:
        if alias in settings.DISTLOCK:
            chosen.append(alias)
            continue
        server = SERVER_OF_ALIAS.get(alias)
        reason = f"start it with --servers {server}" if server else "no such DISTLOCK alias"
        print(f"[{alias}] skipped: not configured ({reason})")
    return chosen


def run_standalone(main):
    """Run one bench module as ``python -m bench.<name>`` under ``python -m tests.servers``.

    Sets Django up on the test settings and makes the test databases, as ``python -m bench`` does,
    and drops them afterwards (closing the backends' own connections first, or the drop would wait
    for them).
    """
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django  # noqa: PLC0415

    django.setup()
    from django.db import connections  # noqa: PLC0415
    from django.test.utils import setup_databases, teardown_databases  # noqa: PLC0415

    from distlock.handler import locks  # noqa: PLC0415

    databases = setup_databases(verbosity=0, interactive=False)
    try:
        code = main(sys.argv[1:])
    finally:
        locks.close_all()
        connections.close_all()
        teardown_databases(databases, verbosity=0)
    sys.exit(code or 0)
