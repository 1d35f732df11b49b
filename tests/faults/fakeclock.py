"""A conformance client whose wall clock the parent jumps and freezes: ``python -m tests.faults.fakeclock CONFIG``.

The wall clock is faked inside Python, before Django or distlock is imported: ``time.time``,
``time.time_ns`` and ``datetime.datetime`` (``now``, ``utcnow``, ``today``) read ``WALL``; the
monotonic clock stays real. ``faketime``/libfaketime 0.9.10 (Debian 12) was tried first: with
``FAKETIME_DONT_FAKE_MONOTONIC=1``, which keeps the monotonic clock real, it makes Python's
``time.sleep`` fail with EINVAL (its ``clock_nanosleep`` wrapper), so it cannot run a client at all.
The patch does not reach clocks read in C by extension modules (grpc, psycopg): distlock itself is
what the clock-jump scenario judges. grpc's Python layer turns timeouts into absolute deadlines with
``time.time()`` and hands them to its C core, which compares them with the real clock: with a fake
in Python only, the two would disagree by the jump (every etcd call would time out at once after a
jump back), which a real clock step never causes. So grpc's modules keep the real clock.

The parent sends ``{"op": "clock", "control": true, "args": {"offset": s}}`` (or ``{"freeze": true}``,
``{"offset": 0}`` to go back); control commands run at once, even while the client waits in an acquire.
"""

import datetime as datetime_module
import importlib
import time
import types

_real_time = time.time
#: The ``time`` module as it was, for the modules that must keep the real wall clock.
_REAL_TIME_MODULE = types.SimpleNamespace(**{name: getattr(time, name) for name in dir(time)
                                             if not name.startswith("__")})
#: grpc's Python modules that compute wall-clock deadlines for its C core (see above).
REAL_CLOCK_MODULES = ("grpc._channel", "grpc._common", "grpc._utilities")


class WallClock:
    """The fake wall clock: real time plus ``offset`` seconds, or a frozen instant."""

    def __init__(self):
        self.offset = 0.0
        self.frozen_at = None

    def now(self):
        return self.frozen_at if self.frozen_at is not None else _real_time() + self.offset

    def set(self, offset=None, freeze=False):
        """Jump by ``offset`` seconds from real time, or freeze at the current fake time."""
        if freeze:
            self.frozen_at = self.now()
        else:
            self.frozen_at = None
            self.offset = float(offset or 0)
        return {"wall": self.now(), "real": _real_time()}


WALL = WallClock()
_RealDatetime = datetime_module.datetime


class _DatetimeMeta(type):
    # Datetimes made in C (psycopg, the datetime module itself) are real ones: they must still pass
    # ``isinstance(value, datetime.datetime)`` once the module attribute is the fake class.
    def __instancecheck__(cls, instance):
        return isinstance(instance, _RealDatetime)

    def __subclasscheck__(cls, subclass):
        return issubclass(subclass, _RealDatetime)


class FakeDatetime(_RealDatetime, metaclass=_DatetimeMeta):
    @classmethod
    def now(cls, tz=None):
        return _RealDatetime.fromtimestamp(WALL.now(), tz)

    @classmethod
    def utcnow(cls):
        return _RealDatetime.fromtimestamp(WALL.now(), datetime_module.timezone.utc).replace(tzinfo=None)

    @classmethod
    def today(cls):
        return cls.now()


def install():
    for name in REAL_CLOCK_MODULES:
        try:
            importlib.import_module(name).time = _REAL_TIME_MODULE
        except ImportError:
            continue  # grpc is not installed: nothing to keep consistent
    time.time = WALL.now
    time.time_ns = lambda: int(WALL.now() * 1e9)
    datetime_module.datetime = FakeDatetime


def main():
    install()
    from distlock.conformance import client  # noqa: PLC0415 - after the clock is faked

    client.main(control={"clock": WALL.set})


if __name__ == "__main__":
    main()
