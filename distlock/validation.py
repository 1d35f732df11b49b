"""Argument checks for the public API, done before any network call."""

import math
import re
import unicodedata

__all__ = ["MAX_NAME_LENGTH", "MAX_SECONDS", "validate_alias", "validate_flag", "validate_name", "validate_seconds"]

MAX_NAME_LENGTH = 255

#: Characters no lock name may hold: Unicode's control characters (category Cc), format characters
#: (Cf: invisible ones such as U+200B and U+202E, which let two names that look alike differ, or one
#: name show as another on the admin page) and lone surrogates (Cs).
_FORBIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs"})
#: The ASCII ones, checked without a per-character look-up (most names are ASCII).
_FORBIDDEN_IN_ASCII = re.compile(r"[\x00-\x1f\x7f]")

#: Largest ttl, timeout or max_hold accepted, in seconds (about 31 years). Beyond about 3e11 s the
#: expiry dates servers and ``Lease.expires_at`` compute pass the year 9999, and beyond about 9e9 s
#: waits overflow the platform's timers (``threading.TIMEOUT_MAX``); without this bound such values
#: failed only on some backends, as ``OverflowError``, ``RuntimeError`` or a misleading ``BackendUnavailable``.
MAX_SECONDS = 10**9


def validate_name(name):
    """Return ``name`` in Unicode normal form NFC if it is a usable lock name; raise ``TypeError``/``ValueError``.

    One name has one spelling: "é" typed as one code point or as "e" and a combining accent is the
    same lock, whichever way each process spells it.
    """
    if not isinstance(name, str):
        raise TypeError(f"Lock name must be a str, got {type(name).__name__}.")
    if not name:
        raise ValueError("Lock name must not be empty.")
    if name.isascii():
        forbidden = _FORBIDDEN_IN_ASCII.search(name)
        forbidden = forbidden[0] if forbidden else None
    else:
        forbidden = next((char for char in name if unicodedata.category(char) in _FORBIDDEN_CATEGORIES), None)
        if forbidden is None:
            name = unicodedata.normalize("NFC", name)
    if forbidden is not None:
        raise ValueError(
            "Lock name must not contain control or format characters or lone surrogates; found "
            f"{forbidden!r} (U+{ord(forbidden):04X}) in {name!r}."
        )
    if len(name) > MAX_NAME_LENGTH:
        raise ValueError(f"Lock name must be at most {MAX_NAME_LENGTH} characters, got {len(name)}.")
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
