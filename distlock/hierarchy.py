"""``DISTLOCK_HIERARCHY``: lock-name prefixes from coarse to fine, and the ranked locks each thread or task holds.

With the setting, acquiring a lock coarser than one the caller already holds raises ``LockOrderError``
before any I/O: callers that all take their locks coarse to fine can never wait for each other in a
circle. ``lock_many()`` takes its names level by level, coarse first, so a set never breaks the rule.

A name's level is the position of the longest prefix it starts with; a name that no prefix matches
has no level and is never checked. "Holds" is per ``contextvars`` context: per thread, per asyncio
task (which starts with a copy of its creator's), per greenlet. The setting is read lazily and again
after ``setting_changed``; an invalid one is reported by the system check ``distlock.E008`` and, at
run time, logged once and ignored: no lock call raises for configuration.
"""

import logging
import unicodedata

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver

from distlock.exceptions import LockOrderError
from distlock.held import HeldLeases

__all__ = ["check_order", "hold", "level", "order_key", "prefixes", "problems"]

logger = logging.getLogger(__name__)

#: The ranked leases acquired in this context (weakly); released ones count no more.
_held = HeldLeases("distlock_held_leases")

#: The parsed setting (a tuple of prefixes, empty when unset or invalid); None until first read.
_current = None


def problems(value):
    """Return what is wrong with ``value`` as a ``DISTLOCK_HIERARCHY``, one message each; [] if usable."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        return [f"settings.DISTLOCK_HIERARCHY must be a list of lock-name prefixes from coarse to fine, "
                f"got {type(value).__name__} {value!r}."]
    found = []
    seen = {}
    for position, prefix in enumerate(value):
        if not isinstance(prefix, str) or not prefix:
            found.append(f"settings.DISTLOCK_HIERARCHY[{position}] must be a non-empty str, got {prefix!r}.")
            continue
        prefix = unicodedata.normalize("NFC", prefix)
        if prefix in seen:
            found.append(f"settings.DISTLOCK_HIERARCHY repeats the prefix {prefix!r} (positions {seen[prefix]} and "
                         f"{position}): a prefix has one level.")
        seen.setdefault(prefix, position)
    return found


def prefixes():
    """Return the configured prefixes, coarse first; an empty tuple when unset or invalid."""
    global _current  # noqa: PLW0603 - a cache reset by the receiver below
    if _current is None:
        value = getattr(settings, "DISTLOCK_HIERARCHY", None)
        found = problems(value)
        if found:
            logger.warning("settings.DISTLOCK_HIERARCHY is ignored: %s Run `manage.py check` (distlock.E008).",
                           " ".join(found))
            _current = ()
        else:
            _current = tuple(unicodedata.normalize("NFC", prefix) for prefix in value or ())
    return _current


@receiver(setting_changed, dispatch_uid="distlock.hierarchy.reset")
def _reset(*, setting, **kwargs):
    global _current  # noqa: PLW0603
    if setting == "DISTLOCK_HIERARCHY":
        _current = None


def level(name, ranked):
    """Return the position in ``ranked`` of the longest prefix of ``name``, or None if none matches."""
    found, longest = None, -1
    for position, prefix in enumerate(ranked):
        if len(prefix) > longest and name.startswith(prefix):
            found, longest = position, len(prefix)
    return found


def order_key(ranked):
    """Return the sort key of ``lock_many()``: coarse levels first, then by name; unranked names last."""
    def key(name):
        position = level(name, ranked)
        return (len(ranked) if position is None else position, name)

    return key


def _live_holds():
    return [lease for lease, _ in _held.entries()]


def check_order(names, ranked):
    """Raise ``LockOrderError`` if any of ``names`` is coarser than a lock this context holds."""
    holds = _live_holds()
    if not holds:
        return
    for name in names:
        wanted = level(name, ranked)
        if wanted is None:
            continue
        for lease in holds:
            held = level(lease.name, ranked)
            if held is not None and wanted < held:
                raise LockOrderError(
                    f"Lock {name!r} (DISTLOCK_HIERARCHY level {ranked[wanted]!r}) is coarser than lock "
                    f"{lease.name!r} (level {ranked[held]!r}), which this thread or task holds: take the coarser "
                    f"lock first, or both together with lock_many().",
                    name=name, held=lease.name)


def hold(lease, ranked):
    """Remember that this context holds ``lease``, if its name has a level."""
    if level(lease.name, ranked) is None:
        return
    _held.add(lease)
