"""The schema of a backend's ``OPTIONS``: each option's types, default and check, and the token epoch.

The system checks validate every alias with these before any I/O (``BaseLockBackend.clean_options``).
"""

import math

from django.core.exceptions import ImproperlyConfigured

from distlock.redaction import redact
from distlock.validation import MAX_SECONDS

__all__ = [
    "EPOCH_SHIFT",
    "MAX_TOKEN_EPOCH",
    "Option",
    "optional_positive_number",
    "positive_count",
    "positive_number",
    "token_epoch",
    "token_in_epoch",
]


class Option:
    """One entry of a backend's ``OPTIONS``: its accepted types, default and an optional extra check.

    ``check`` receives the value and returns an error message, or None when the value is fine.
    ``shown`` is how the messages show a value, before ``redact``: ``repr``, or a function that leaves
    out what redaction cannot recognise (the values of a dict of keyword arguments, one misspelt
    ``password`` among them).
    """

    def __init__(self, types, default=None, *, required=False, check=None, expected=None, shown=repr):
        self.types = types if isinstance(types, tuple) else (types,)
        self.default = default
        self.required = required
        self.check = check
        self.expected = expected or " or ".join(t.__name__ for t in self.types)
        self.shown = shown

    def clean(self, alias, name, value):
        # bool is an int subclass; a TTL of True is a typo, not a number.
        if not isinstance(value, self.types) or (isinstance(value, bool) and bool not in self.types):
            raise ImproperlyConfigured(
                f"DISTLOCK['{alias}']['OPTIONS']['{name}'] must be {self.expected}, got {redact(self.shown(value))}."
            )
        problem = self.check(value) if self.check else None
        if problem:
            raise ImproperlyConfigured(
                f"DISTLOCK['{alias}']['OPTIONS']['{name}'] {problem}, got {redact(self.shown(value))}."
            )
        return value


def positive_number(value):
    """Return an error unless ``value`` is a finite number of seconds above zero, at most ``MAX_SECONDS``."""
    if not math.isfinite(value) or value <= 0 or value > MAX_SECONDS:
        return f"must be a finite number of seconds above zero and at most {MAX_SECONDS:g}"
    return None


def optional_positive_number(value):
    return None if value is None else positive_number(value)


def positive_count(value):
    """Return an error unless ``value`` (an int) is at least 1."""
    return None if value >= 1 else "must be at least 1"


#: Bits of a fencing token left to the backend's own token below ``TOKEN_EPOCH``: room for every
#: backend's tokens (locmem's are microseconds since 1970, below 2**52 until 2112; ZooKeeper's zxids
#: while its leader epoch is below 2**20), and the epoch above them stays within a signed 64-bit column.
EPOCH_SHIFT = 52
MAX_TOKEN_EPOCH = 2 ** (63 - EPOCH_SHIFT) - 1


def token_epoch(value):
    """Return an error unless ``value`` is a ``TOKEN_EPOCH`` (0 to ``MAX_TOKEN_EPOCH``)."""
    return None if 0 <= value <= MAX_TOKEN_EPOCH else f"must be between 0 and {MAX_TOKEN_EPOCH}"


def token_in_epoch(epoch, token):
    """Return the backend's ``token`` placed in ``epoch``, or None if it does not fit below the epoch.

    Tokens of one backend compare only with each other: an alias pointed at another backend, or at a
    server started afresh, issues tokens below those its fenced rows already store, and every write
    would be refused as stale. Raising ``TOKEN_EPOCH`` puts every new token above every earlier one.
    """
    if not epoch:
        return token
    if not 0 <= token < 1 << EPOCH_SHIFT:
        return None
    return epoch << EPOCH_SHIFT | token
