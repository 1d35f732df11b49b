"""The old path of ``FencedQuerySet``, kept for one release: import it from ``distlock.fencing``."""

import warnings

__all__ = []


def __getattr__(name):
    """Return ``FencedQuerySet`` from its new module, with a ``DeprecationWarning``."""
    if name != "FencedQuerySet":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn("distlock.querysets.FencedQuerySet has moved: use `from distlock.fencing import FencedQuerySet`. "
                  "The old path will be removed in the next release.", DeprecationWarning, stacklevel=2)
    # Imported on use only, as the shim's one import (exempted in tests/test_architecture.py).
    from distlock.fencing import FencedQuerySet  # noqa: PLC0415

    return FencedQuerySet
