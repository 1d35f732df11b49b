"""A test app for tests/test_celery.py: tasks the real workers run and the records of their runs."""
