"""Bad input into every public entry point: only documented exceptions may come out, nothing may stay behind.

The API documents ``TypeError``/``ValueError`` naming the argument, raised before any network call;
``LockNotAcquired`` for a lock it could not grant (a ttl shorter than one round trip is never granted);
``NotImplementedError`` from ``read_lock()``/``write_lock()`` on a backend without read/write locks;
``InvalidLockBackendError`` for an unknown alias. Input the API accepts (odd but valid names, tiny or
huge numbers) must work like any other: acquired, released, and gone from the server afterwards.
"""

import math
import time

import distlock
from distlock.backends.base import READ_WRITE
from distlock.conformance.report import Result
from distlock.exceptions import (
    BackendUnavailable,
    InvalidLockBackendError,
    LockError,
    LockNotAcquired,
    TokenRegression,
)
from distlock.handler import locks
from distlock.validation import MAX_NAME_LENGTH, MAX_SECONDS

__all__ = [
    "ARGUMENT_ERRORS",
    "BAD_NAMES",
    "BAD_SECONDS",
    "BAD_TOKENS",
    "ENTRY_POINTS",
    "InputCheck",
    "ODD_NAME_ENDINGS",
    "ODD_SECONDS",
    "bad_input",
]

#: What bad arguments may raise (``InvalidLockBackendError`` is an ``ImproperlyConfigured``, not a ``LockError``).
ARGUMENT_ERRORS = (TypeError, ValueError, InvalidLockBackendError)

#: The lock entry points, called the way users call them.
ENTRY_POINTS = ("acquire", "lock", "read_lock", "write_lock")

BAD_NAMES = ["", "x" * (MAX_NAME_LENGTH + 1), "nul\x00byte", "line\nbreak", "tab\t", "del\x7f", "lone \ud800 surrogate",
             None, 7, 3.5, b"bytes", ["list"]]
#: Valid, if unusual, name endings: path syntax, ZooKeeper's reserved word, escapes, non-ASCII, globs.
ODD_NAME_ENDINGS = ["/", "..", ".", "zookeeper", "a/../b", "%2F%00", " spaced ", "ünïcødé", "名前", "lock 🔒", "*",
                    "?[x]", "\\", ":", "'\";--"]
BAD_SECONDS = [0, -1, -0.0, math.nan, math.inf, -math.inf, MAX_SECONDS * 1.01, 1e300, "1", True, [1], object()]
ODD_SECONDS = [1e-3, 0.25, 10**6, MAX_SECONDS]
BAD_TOKENS = [0, -1, 2**63, "5", 5.0, True, None, object()]


class InputCheck:
    """Feed inputs to one alias, keeping count of what was accepted and of every undocumented outcome."""

    def __init__(self, alias, prefix):
        self.alias = alias
        self.prefix = prefix
        self.tried = 0
        self.accepted = 0
        self.violations = []
        #: Calls that met ``BackendUnavailable`` once and passed when repeated: a server that stalled.
        self.transient = 0

    @property
    def read_write(self):
        return READ_WRITE in locks[self.alias].capabilities

    def lock_call(self, entry, name, **arguments):
        """Call lock entry point ``entry`` non-blocking and release what it acquires; judge what it raised.

        Whether the release deleted anything is not judged here (a 1 ms ttl expires first): ``leftovers()``
        tells what stayed on the server. ``BackendUnavailable`` is a violation only if the same call
        meets it twice: input that breaks a backend does so every time, a stalled server once.
        """
        self.tried += 1
        arguments = {"using": self.alias, "blocking": False, **arguments}
        try:
            try:
                self._call(entry, name, arguments)
            except BackendUnavailable:
                time.sleep(0.5)
                self._call(entry, name, arguments)
                self.transient += 1
        except ARGUMENT_ERRORS:
            return "refused"
        except LockNotAcquired:
            return "busy"  # documented: e.g. a ttl shorter than one round trip cannot be granted
        except NotImplementedError:
            if entry in ("read_lock", "write_lock") and not self.read_write:
                return "refused"
            self._violation(entry, name, arguments, "NotImplementedError on a backend that claims read/write locks")
            return "error"
        except LockError as exc:
            self._violation(entry, name, arguments, f"{type(exc).__name__}: {exc}")
            return "error"
        except Exception as exc:  # noqa: BLE001 - anything undocumented is what this check looks for
            self._violation(entry, name, arguments, f"undocumented {type(exc).__name__}: {exc}")
            return "error"
        self.accepted += 1
        return "accepted"

    @staticmethod
    def _call(entry, name, arguments):
        if entry == "acquire":
            distlock.acquire(name, **arguments).release()
        else:
            with getattr(distlock, entry)(name, **arguments):
                pass

    def _violation(self, entry, name, arguments, what):
        shown = {key: value for key, value in arguments.items() if key not in ("using", "blocking")}
        self.violations.append(f"{entry}({_short(name)}, {_short(shown)}) -> {what}")

    def refused_call(self, what, call):
        """Run ``call`` (a bad token or ttl); only ``TypeError``/``ValueError`` may come out."""
        self.tried += 1
        try:
            call()
        except (TypeError, ValueError):
            return "refused"
        except Exception as exc:  # noqa: BLE001
            self.violations.append(f"{what} -> undocumented {type(exc).__name__}: {exc}")
            return "error"
        self.violations.append(f"{what} -> accepted")
        return "accepted"

    def leftovers(self):
        """Return the names under this check's prefix that the server still holds."""
        return sorted(info.name for info in locks[self.alias].held_locks(self.prefix))


def _short(value, limit=60):
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def bad_input(alias, backend, prefix, store=None):
    """Run the whole corpus against ``alias`` (in this process); ``store``: a ``FencedStore`` for the token checks."""
    check = InputCheck(alias, prefix)
    valid_name = f"{prefix}:valid"
    for entry in ENTRY_POINTS:
        for name in BAD_NAMES:
            if check.lock_call(entry, name) == "accepted":
                check.violations.append(f"{entry}({_short(name)}) accepted an invalid name")
        for ending in [*ODD_NAME_ENDINGS, "m" * (MAX_NAME_LENGTH - len(prefix) - 1)]:
            check.lock_call(entry, f"{prefix}:{ending}")
        for argument in ("ttl", "timeout", "max_hold"):
            for value in BAD_SECONDS:
                if argument == "timeout" and value in (0, -0.0) and not isinstance(value, bool):
                    continue  # timeout=0 means "try once"
                if check.lock_call(entry, valid_name, **{argument: value}) == "accepted":
                    check.violations.append(f"{entry}({argument}={_short(value)}) accepted an invalid value")
            for value in ODD_SECONDS:
                check.lock_call(entry, valid_name, **{argument: value})
        for argument, value in [("blocking", "yes"), ("blocking", None), ("auto_renew", "yes"), ("using", ""),
                                ("using", None), ("using", "no-such-alias-" + prefix)]:
            if check.lock_call(entry, valid_name, **{argument: value}) == "accepted":
                check.violations.append(f"{entry}({argument}={_short(value)}) accepted an invalid value")
    _extensions(check, f"{prefix}:extended")
    if store is not None:
        _bad_tokens(check, store)
    left = check.leftovers()
    if left:
        check.violations.append(f"{len(left)} lock(s) left behind on the server: {_short(left, 200)}")
    notes = [f"{check.transient} call(s) met a transient BackendUnavailable"] if check.transient else []
    return Result(scenario="bad input", backend=backend, runs=check.tried, acquisitions=check.accepted,
                  violations=check.violations, notes=notes)


def _extensions(check, name):
    """``Lease.extend()`` with bad ttls (refused, lease unchanged) and odd ones (never more validity than granted)."""
    try:
        lease = distlock.acquire(name, ttl=30, using=check.alias, timeout=10)
    except TokenRegression as exc:  # the alias's tokens went back in the calls before: reported, not raised
        check.violations.append(f"acquire({_short(name)}) -> TokenRegression: {exc}")
        return
    try:
        for ttl in BAD_SECONDS:
            check.refused_call(f"lease.extend({_short(ttl)})", lambda ttl=ttl: lease.extend(ttl))
        for ttl in ODD_SECONDS:
            check.tried += 1
            try:
                extended = lease.extend(ttl)
            except BackendUnavailable:
                time.sleep(0.5)
                extended = lease.extend(ttl)
                check.transient += 1
            if extended and lease.remaining() > ttl:
                check.violations.append(f"lease.extend({ttl:g}) left {lease.remaining():.3g}s of validity, "
                                        f"more than the {ttl:g}s the server granted")
    finally:
        lease.release()


def _bad_tokens(check, store):
    """Bad tokens into ``claim``, ``save`` and ``fenced_update``: refused, and the row untouched."""
    pk = store.add_row(value=7)
    rows = store.Row.objects.using(store.database)
    before = rows.filter(pk=pk).values_list("value", "fencing_token").get()
    for token in BAD_TOKENS:
        check.refused_call(f"claim({_short(token)})", lambda token=token: rows.claim(token, pk=pk))
        check.refused_call(f"save(fencing_token={_short(token)})",
                          lambda token=token: store.Row(pk=pk, value=8).save(using=store.database, fencing_token=token))
        check.refused_call(f"fenced_update({_short(token)})",
                          lambda token=token: rows.filter(pk=pk).fenced_update(token, value=9))
    check.refused_call("save(lease='not a lease')",
                      lambda: store.Row(pk=pk, value=8).save(using=store.database, lease="not a lease"))
    check.refused_call("save() without a token on a fenced row",
                      lambda: store.Row(pk=pk, value=8).save(using=store.database))
    after = rows.filter(pk=pk).values_list("value", "fencing_token").get()
    if after != before:
        check.violations.append(f"a refused fenced write changed the row: {before} -> {after}")
