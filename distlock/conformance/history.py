"""Histories: one JSON-lines file per process, each event stamped with ``time.monotonic_ns()``.

CLOCK_MONOTONIC is one clock for the whole machine on Linux, so the events of different processes
merge into one timeline; the wall clock is never used (a test may fake it in a client). Every event
is written and flushed at once, so a process killed with SIGKILL leaves all it recorded behind.
"""

import json
import threading
import time
from pathlib import Path

__all__ = ["History", "load"]


class History:
    """The event log of one process (``proc``), appended to ``path``; safe to share between threads."""

    def __init__(self, path, proc):
        self.proc = proc
        self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._lock = threading.Lock()

    def record(self, op, **fields):
        """Append one event and return it; ``t`` is taken now."""
        event = {"t": time.monotonic_ns(), "proc": self.proc, "op": op, **fields}
        line = json.dumps(event, default=str)
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")
        return event

    def close(self):
        with self._lock:
            self._file.close()


def load(directory):
    """Return the events of every ``*.jsonl`` file in ``directory``, merged and sorted by ``t``.

    A last line cut short by SIGKILL is skipped: the event it would have been never completed.
    """
    events = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return sorted(events, key=lambda event: event["t"])
