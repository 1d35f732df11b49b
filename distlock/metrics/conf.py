"""The ``DISTLOCK_METRICS`` setting, read lazily and reset on ``setting_changed`` so tests can override it."""

import math
from dataclasses import dataclass, fields

from django.apps import apps
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import router
from django.core.signals import setting_changed
from django.dispatch import receiver

__all__ = ["MetricsSettings", "get", "load"]


@dataclass(frozen=True)
class MetricsSettings:
    """``settings.DISTLOCK_METRICS`` with defaults; keys are the UPPER_SNAKE field names."""

    #: Record metrics at all; False makes every ``record_*`` call return at once.
    enabled: bool = True
    #: Seconds between two writes of this process's counts to the shared store (and one more at exit).
    flush_interval: float = 10
    #: Lock-name prefixes tracked per process and shown per alias; the rest count as ``other``.
    max_prefixes: int = 50
    #: Seconds of the "recent" figures on the admin page and in ``distlock stats``.
    recent_window: float = 900
    #: Seconds of per-minute history kept (the chart, the recent window); older minutes are folded
    #: into the since-start totals so the table stays small.
    history: float = 86400
    #: The database holding the shared store (PostgreSQL or SQLite); by default the one the database
    #: routers write ``MetricSample`` to (``default`` without routers).
    database: str | None = None


#: Option name -> (accepted types, extra check returning an error or None).
_SCHEMA = {
    "ENABLED": ((bool,), None),
    "FLUSH_INTERVAL": ((int, float), lambda v: None if math.isfinite(v) and v > 0 else "must be above zero"),
    "MAX_PREFIXES": ((int,), lambda v: None if v >= 1 else "must be at least 1"),
    "RECENT_WINDOW": ((int, float), lambda v: None if math.isfinite(v) and v >= 60 else "must be at least 60 seconds"),
    "HISTORY": ((int, float), lambda v: None if math.isfinite(v) and v >= 3600 else "must be at least 3600 seconds"),
    "DATABASE": ((str,), lambda v: None if v in settings.DATABASES else f"must name one of {sorted(settings.DATABASES)}"),
}

_current = None


def load():
    """Return the validated ``DISTLOCK_METRICS``; raise ``ImproperlyConfigured`` naming the bad key."""
    raw = getattr(settings, "DISTLOCK_METRICS", {})
    if not isinstance(raw, dict):
        raise ImproperlyConfigured(f"settings.DISTLOCK_METRICS must be a dict, got {raw!r}.")
    unknown = sorted(set(raw) - set(_SCHEMA))
    if unknown:
        raise ImproperlyConfigured(
            f"settings.DISTLOCK_METRICS has unknown key(s) {', '.join(unknown)}; accepted: {', '.join(_SCHEMA)}."
        )
    values = {}
    for field in fields(MetricsSettings):
        key = field.name.upper()
        if key not in raw:
            continue
        types, check = _SCHEMA[key]
        value = raw[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            expected = " or ".join(t.__name__ for t in types)
            raise ImproperlyConfigured(f"settings.DISTLOCK_METRICS['{key}'] must be {expected}, got {value!r}.")
        problem = check(value) if check else None
        if problem:
            raise ImproperlyConfigured(f"settings.DISTLOCK_METRICS['{key}'] {problem}, got {value!r}.")
        values[field.name] = value
    if "database" not in values:
        values["database"] = router.db_for_write(apps.get_model("distlock", "MetricSample"))
        if values["database"] not in settings.DATABASES:
            raise ImproperlyConfigured(
                f"settings.DISTLOCK_METRICS['DATABASE'] is not set, and the database routers give for writing "
                f"distlock's MetricSample is {values['database']!r}, which is not in settings.DATABASES "
                f"(configured: {sorted(settings.DATABASES)})."
            )
    loaded = MetricsSettings(**values)
    if loaded.recent_window > loaded.history:
        raise ImproperlyConfigured(
            f"settings.DISTLOCK_METRICS['RECENT_WINDOW'] ({loaded.recent_window:g}s) must not exceed "
            f"'HISTORY' ({loaded.history:g}s): older minutes are folded away."
        )
    return loaded


def get():
    """Return the current metrics settings, parsed once until a settings change."""
    global _current  # noqa: PLW0603 - a cache reset by the receiver below
    if _current is None:
        _current = load()
    return _current


@receiver(setting_changed, dispatch_uid="distlock.metrics.conf.reset")
def _reset(*, setting, **kwargs):
    global _current  # noqa: PLW0603
    if setting in ("DISTLOCK_METRICS", "DATABASES", "DATABASE_ROUTERS"):
        _current = None
