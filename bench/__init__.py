"""Benchmarks that print figures (not timed tests): ``python -m bench`` runs them all."""

import os
import sys


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
