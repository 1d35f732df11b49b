"""Read the ``DISTLOCK`` setting lazily, so ``override_settings`` reaches it."""

from django.conf import settings

DEFAULT_ALIAS = "default"
DEFAULT_BACKEND = "distlock.backends.database.DatabaseBackend"

#: What a project without a ``DISTLOCK`` setting gets: the embedded database backend on Django's default database.
DEFAULT_CONFIG = {DEFAULT_ALIAS: {"BACKEND": DEFAULT_BACKEND, "OPTIONS": {}}}


def get_config():
    """Return the ``DISTLOCK`` setting, or the embedded default when the project sets none."""
    return getattr(settings, "DISTLOCK", DEFAULT_CONFIG)
