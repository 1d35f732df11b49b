"""System checks for ``settings.DISTLOCK``; they do no network I/O, so they pass while servers are down."""

from django.conf import settings
from django.core.checks import Error, Warning  # noqa: A004 - Django's name
from django.core.exceptions import ImproperlyConfigured
from django.db.utils import load_backend
from django.utils.module_loading import import_string

from distlock.backends.base import BaseLockBackend
from distlock.backends.redis_servers import describe
from distlock import hierarchy
from distlock.conf import DEFAULT_ALIAS, get_config

__all__ = [
    "E001",
    "E002",
    "E003",
    "E004",
    "E005",
    "E006",
    "E007",
    "E008",
    "METRICS_VENDORS",
    "W001",
    "W002",
    "check_distlock_setting",
    "check_hierarchy_setting",
    "check_metrics_setting",
]

E001 = "distlock.E001"  # DISTLOCK is not a dict, or has no 'default' alias
E002 = "distlock.E002"  # an alias entry is not a dict with BACKEND
E003 = "distlock.E003"  # BACKEND cannot be imported or is not a lock backend
E004 = "distlock.E004"  # an option is missing, unknown, or invalid
E005 = "distlock.E005"  # two aliases keep keys under one prefix of one server
E006 = "distlock.E006"  # DISTLOCK_METRICS is invalid
E007 = "distlock.E007"  # the metrics store's database is not PostgreSQL or SQLite
E008 = "distlock.E008"  # DISTLOCK_HIERARCHY is not a list of distinct non-empty prefixes
W001 = "distlock.W001"  # a backend that can be secured is not (shown with DEBUG off)
W002 = "distlock.W002"  # an option is set under the old name it had before distlock 1.0


def check_distlock_setting(app_configs=None, **kwargs):
    """Report every alias at fault, each with the option and the fix."""
    config = get_config()
    if not isinstance(config, dict):
        return [Error("settings.DISTLOCK must be a dict of alias -> {'BACKEND': ..., 'OPTIONS': {...}}.",
                      hint="Shape it like CACHES.", id=E001)]
    errors = []
    owners = {}  # (server, key prefix) -> the first alias that keeps keys there
    reported = set()  # (alias, other alias) pairs already reported
    if DEFAULT_ALIAS not in config:
        errors.append(Error(f"settings.DISTLOCK must define a '{DEFAULT_ALIAS}' alias.",
                            hint="lock() and acquire() use it when no 'using' is given.", id=E001))
    for alias, entry in config.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("BACKEND"), str):
            errors.append(Error(f"DISTLOCK['{alias}'] must be a dict with a 'BACKEND' dotted path (a str).",
                                hint="For example {'BACKEND': 'distlock.backends.redis.RedisBackend', "
                                     "'OPTIONS': {'URL': 'redis://127.0.0.1:6379/0'}}.", id=E002))
            continue
        unknown_keys = sorted(set(entry) - {"BACKEND", "OPTIONS"})
        if unknown_keys:
            errors.append(Error(f"DISTLOCK['{alias}'] has unknown key(s) {', '.join(unknown_keys)}.",
                                hint="Only 'BACKEND' and 'OPTIONS' are read; backend settings go in OPTIONS.",
                                id=E002))
        try:
            backend_cls = import_string(entry["BACKEND"])
        except ImportError as exc:
            errors.append(Error(f"DISTLOCK['{alias}']['BACKEND'] could not be imported: {exc}.",
                                hint="Check the dotted path and that the backend's client package is installed.",
                                id=E003))
            continue
        if not (isinstance(backend_cls, type) and issubclass(backend_cls, BaseLockBackend)):
            errors.append(Error(f"DISTLOCK['{alias}']['BACKEND'] {entry['BACKEND']!r} is not a lock backend.",
                                hint="It must subclass distlock.backends.base.BaseLockBackend.", id=E003))
            continue
        try:
            options = backend_cls.clean_options(alias, entry.get("OPTIONS", {}))
        except ImproperlyConfigured as exc:
            errors.append(Error(str(exc), id=E004))
            continue
        errors.extend(
            Warning(f"DISTLOCK['{alias}']['OPTIONS']['{old}'] is the old name of '{new}'; it still works, but "
                    "is removed in distlock 2.0.", hint=f"Rename it to '{new}'.", id=W002)
            for old, new in backend_cls.old_option_names(entry.get("OPTIONS")))
        if not settings.DEBUG:
            errors.extend(Warning(f"DISTLOCK['{alias}']: {message}", id=W001)
                          for message in backend_cls.security_warnings(alias, options))
        for space in backend_cls.key_spaces(alias, options):
            other = owners.setdefault(space, alias)
            if other != alias and (alias, other) not in reported:
                reported.add((alias, other))
                server, prefix = space
                errors.append(Error(
                    f"DISTLOCK['{alias}'] and DISTLOCK['{other}'] both keep their keys under KEY_PREFIX "
                    f"'{prefix}' on the Redis server {describe(server)}: each would read the other's keys as "
                    "its own.",
                    hint=f"Give DISTLOCK['{alias}']['OPTIONS'] a KEY_PREFIX of its own.", id=E005))
    return errors


#: Database vendors the metrics store's statements are written for.
METRICS_VENDORS = ("postgresql", "sqlite")


def check_metrics_setting(app_configs=None, **kwargs):
    """Report an invalid ``DISTLOCK_METRICS``, or a metrics database the store cannot write to."""
    from distlock.metrics import conf  # noqa: PLC0415 - reads the app registry (routers, models)

    try:
        loaded = conf.load()
    except ImproperlyConfigured as exc:
        return [Error(str(exc), hint="Fix the key named, or leave it out for its default.", id=E006)]
    vendor = load_backend(settings.DATABASES[loaded.database]["ENGINE"]).DatabaseWrapper.vendor
    if loaded.enabled and vendor not in METRICS_VENDORS:
        return [Error(
            f"The lock metrics store is on DATABASES['{loaded.database}'], a {vendor} database; it needs "
            "PostgreSQL or SQLite.",
            hint="Set DISTLOCK_METRICS['DATABASE'] to a PostgreSQL or SQLite database (a router that sends the "
                 "distlock app there works too), or DISTLOCK_METRICS['ENABLED'] = False.",
            id=E007)]
    return []


def check_hierarchy_setting(app_configs=None, **kwargs):
    """Report every fault of ``DISTLOCK_HIERARCHY``; while one remains, lock calls ignore the setting."""
    return [Error(message, hint="List lock-name prefixes from coarse to fine, each once, e.g. "
                                "['bank:', 'account:']; leave the setting out to check no order.", id=E008)
            for message in hierarchy.problems(getattr(settings, "DISTLOCK_HIERARCHY", None))]
