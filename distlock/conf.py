"""Read the ``DISTLOCK`` setting lazily, so ``override_settings`` reaches it."""

from django.conf import settings

DEFAULT_ALIAS = "default"
DEFAULT_BACKEND = "distlock.backends.database.DatabaseBackend"

#: What a project without a ``DISTLOCK`` setting gets: the embedded database backend on Django's default database.
DEFAULT_CONFIG = {DEFAULT_ALIAS: {"BACKEND": DEFAULT_BACKEND, "OPTIONS": {}}}


def get_config():
    """Return the ``DISTLOCK`` setting, or the embedded default when the project sets none."""
    return getattr(settings, "DISTLOCK", DEFAULT_CONFIG)


def is_shared_memory_database(alias):
    """True if ``DATABASES[alias]`` is an in-memory SQLite database with a shared cache (Django's SQLite test
    database without a ``TEST`` name): its connections share table locks that never wait."""
    entry = settings.DATABASES[alias]
    name = str(entry.get("NAME", ""))
    return entry.get("ENGINE", "").endswith("sqlite3") and "mode=memory" in name and "cache=shared" in name
