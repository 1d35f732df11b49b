"""Read the ``DISTLOCK`` setting lazily, so ``override_settings`` reaches it."""

from django.conf import settings
from django.db.utils import load_backend

__all__ = [
    "DEFAULT_ALIAS",
    "DEFAULT_BACKEND",
    "DEFAULT_CONFIG",
    "PRIVATE_MEMORY",
    "SHARED_MEMORY",
    "get_config",
    "sqlite_memory",
]

DEFAULT_ALIAS = "default"
DEFAULT_BACKEND = "distlock.backends.database.DatabaseBackend"

#: What a project without a ``DISTLOCK`` setting gets: the embedded database backend on Django's default database.
DEFAULT_CONFIG = {DEFAULT_ALIAS: {"BACKEND": DEFAULT_BACKEND, "OPTIONS": {}}}

#: What ``sqlite_memory`` returns for an in-memory SQLite database that every connection of the process
#: shares (Django's SQLite test database without a ``TEST`` name): its table locks never wait.
SHARED_MEMORY = "shared"
#: ... and for one that only its own connection sees (":memory:", or no shared cache).
PRIVATE_MEMORY = "private"


def get_config():
    """Return the ``DISTLOCK`` setting, or the embedded default when the project sets none."""
    return getattr(settings, "DISTLOCK", DEFAULT_CONFIG)


def sqlite_memory(alias):
    """Return ``SHARED_MEMORY`` or ``PRIVATE_MEMORY`` if ``DATABASES[alias]`` is an in-memory SQLite database.

    None for a database file, and for every other vendor. Imports the ENGINE, does no I/O.
    """
    entry = settings.DATABASES[alias]
    name = str(entry.get("NAME", ""))
    if name not in ("", ":memory:") and "mode=memory" not in name:
        return None  # a file (the usual case, on every lock call: decided before the ENGINE is imported)
    if load_backend(entry.get("ENGINE") or "django.db.backends.dummy").DatabaseWrapper.vendor != "sqlite":
        return None
    if name in ("", ":memory:") or "cache=shared" not in name:
        return PRIVATE_MEMORY
    return SHARED_MEMORY
