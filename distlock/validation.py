"""Argument checks for the public API, done before any network call."""

import math
import re

MAX_NAME_LENGTH = 255

#: Characters no lock name may hold: Unicode's control characters (category Cc) and lone surrogates (Cs).
_FORBIDDEN_IN_NAMES = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")

#: Largest ttl, timeout or max_hold accepted, in seconds (about 31 years). Beyond about 3e11 s the
#: expiry dates servers and ``Lease.expires_at`` compute pass the year 9999, and beyond about 9e9 s
#: waits overflow the platform's timers (``threading.TIMEOUT_MAX``); without this bound such values
#: failed only on some backends, as ``OverflowError``, ``RuntimeError`` or a misleading ``BackendUnavailable``.
MAX_SECONDS = 10**9


def validate_name(name):
    """Return ``name`` if it is a usable lock name; raise ``TypeError``/``ValueError`` naming the problem."""
    if not isinstance(name, str):
        raise TypeError(f"Lock name must be a str, got {type(name).__name__}.")
    if not name:
        raise ValueError("Lock name must not be empty.")
    if len(name) > MAX_NAME_LENGTH:
        raise ValueError(f"Lock name must be at most {MAX_NAME_LENGTH} characters, got {len(name)}.")
    forbidden = _FORBIDDEN_IN_NAMES.search(name)
    if forbidden:
        raise ValueError(
            f"Lock name must not contain control characters or lone surrogates; found {forbidden[0]!r} in {name!r}."
        )
    return name


def validate_seconds(argument, value, *, allow_none=False, allow_zero=False):
    """Return ``value`` as a number of seconds; raise ``TypeError``/``ValueError`` naming ``argument``."""
    if value is None:
        if allow_none:
            return None
        raise TypeError(f"{argument} must be a number of seconds, got None.")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{argument} must be a number of seconds (int or float), got {type(value).__name__}.")
    if not math.isfinite(value):
        raise ValueError(f"{argument} must be a finite number of seconds, got {value!r}.")
    if value < 0 or (value == 0 and not allow_zero):
        bound = "zero or more" if allow_zero else "above zero"
        raise ValueError(f"{argument} must be {bound}, got {value!r}.")
    if value > MAX_SECONDS:
        hint = "; timeout=None waits without limit" if argument == "timeout" else ""
        raise ValueError(f"{argument} must be at most {MAX_SECONDS:g} seconds (about 31 years){hint}, got {value!r}.")
    return value


def validate_flag(argument, value, *, allow_none=False):
    if value is None and allow_none:
        return None
    if not isinstance(value, bool):
        raise TypeError(f"{argument} must be True or False, got {value!r}.")
    return value


def validate_alias(using):
    if not isinstance(using, str) or not using:
        raise TypeError(f"using must be the name of a DISTLOCK alias (a non-empty str), got {using!r}.")
    return using
