"""Deployment harness: the demo site behind gunicorn, Celery's pools, forks and time limits (issue 25)."""
