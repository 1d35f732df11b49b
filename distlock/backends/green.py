"""Whether this process runs on green threads: backends whose client libraries need to know (kazoo, gRPC)."""

import sys


def green_library():
    """Return "gevent" or "eventlet" if that library monkey-patched ``socket`` in this process, else None."""
    if "gevent" in sys.modules:
        from gevent import monkey  # noqa: PLC0415 - only in a process that imported gevent

        if monkey.is_module_patched("socket"):
            return "gevent"
    if "eventlet" in sys.modules:
        from eventlet import patcher  # noqa: PLC0415 - only in a process that imported eventlet

        if patcher.is_monkey_patched("socket"):
            return "eventlet"
    return None
