"""The distlock demo project."""

# Load the Celery app whenever Django starts, so @shared_task (and @single_instance_task) bind to it.
from project.celery import app as celery_app

__all__ = ("celery_app",)
