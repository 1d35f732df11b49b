"""The distlock test suite: run with ``make test``, which starts the servers it needs."""
