"""The demo app's configuration."""

from django.apps import AppConfig


class DemoConfig(AppConfig):
    name = "project.demo"
    label = "demo"
    verbose_name = "distlock demo"
    default_auto_field = "django.db.models.BigAutoField"
