"""The demo project's Celery app, wired the standard Django way: ``celery -A project worker``."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

app = Celery("project")
# Every CELERY_* Django setting configures the app (CELERY_BROKER_URL -> broker_url); read lazily,
# so importing this module connects to nothing.
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
