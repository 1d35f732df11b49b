"""Django application configuration."""

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _

__all__ = ["DistlockConfig"]


class DistlockConfig(AppConfig):
    name = "distlock"
    verbose_name = _("Distributed locks")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from django.core import checks  # noqa: PLC0415
        from django.core.signals import setting_changed  # noqa: PLC0415

        from distlock import checks as distlock_checks  # noqa: PLC0415
        from distlock.handler import locks  # noqa: PLC0415

        checks.register(distlock_checks.check_distlock_setting, "distlock")
        checks.register(distlock_checks.check_metrics_setting, "distlock")
        checks.register(distlock_checks.check_hierarchy_setting, "distlock")

        def reset_backends(*, setting, **kwargs):
            if setting in ("DISTLOCK", "DATABASES", "CACHES"):
                locks.close_all()

        setting_changed.connect(reset_backends, weak=False, dispatch_uid="distlock.reset_backends")
