"""Test-only app: fenced models for ``tests/test_fencing.py`` and ``bench/fencing.py``."""
