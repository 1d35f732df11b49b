"""The parent's handle on a conformance client process: start it, send commands, pause, resume and kill it.

Every pause, resume and kill is recorded in the parent's own history (``nemesis.jsonl``), on the same
monotonic clock as the clients' events, so the checker can tell what the nemesis did when.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from django.conf import settings

__all__ = ["ClientDied", "ClientError", "ClientProcess", "START_TIMEOUT", "child_environment"]

#: Seconds a client may take to start (Python, Django, the backend's client library) on a busy machine.
START_TIMEOUT = 120


class ClientError(Exception):
    """A command failed in the client; ``error`` is the exception's class name there (e.g. "LockNotAcquired")."""

    def __init__(self, error, message):
        super().__init__(f"{error}: {message}")
        self.error = error


class ClientDied(Exception):
    """The client process exited (or was killed) before answering."""


def child_environment(extra=None):
    """The environment of a client: this process's, with its import path and settings module."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(path for path in sys.path if path)
    env.setdefault("DJANGO_SETTINGS_MODULE", settings.SETTINGS_MODULE)
    env.update(extra or {})
    return env


class ClientProcess:
    """One client process (``distlock.conformance.client`` or a module wrapping it) and its answers."""

    def __init__(self, proc, config, directory, *, nemesis, env=None, module="distlock.conformance.client",
                 exec_prefix=()):
        """``exec_prefix``: a command the client runs under (``ip netns exec <host>``: a client on a test host)."""
        self.proc = proc
        self.nemesis = nemesis
        directory = Path(directory)
        config = {**config, "proc": proc, "history": str(directory / f"{proc}.jsonl")}
        self._stderr = open(directory / f"{proc}.stderr", "w+", encoding="utf-8")  # noqa: SIM115 - closed in _closed
        self.process = subprocess.Popen(
            [*exec_prefix, sys.executable, "-m", module, json.dumps(config)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=child_environment(env), start_new_session=True,
        )
        self._answers = {}
        self._changed = threading.Condition()
        self._next_id = 1
        self._ended = False
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"conformance-{proc}")
        self._reader.start()

    @property
    def pid(self):
        return self.process.pid

    @property
    def alive(self):
        return self.process.poll() is None

    def _read(self):
        for line in self.process.stdout:
            if not line.startswith("{"):
                continue
            message = json.loads(line)
            with self._changed:
                self._answers[message["id"]] = message
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def wait_ready(self, wait=START_TIMEOUT):
        self.result(0, wait)
        return self

    def send(self, op, *, control=False, **args):
        """Send a command without waiting; return its id for ``result()``."""
        with self._changed:
            command_id, self._next_id = self._next_id, self._next_id + 1
        message = {"id": command_id, "op": op, "args": args}
        if control:
            message["control"] = True
        try:
            self.process.stdin.write(json.dumps(message) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise ClientDied(f"client {self.proc} is gone; {op} not sent.\n{self.stderr_tail()}") from None
        return command_id

    def result(self, command_id, wait=60):
        """Wait up to ``wait`` seconds for the answer to ``command_id``; raise ``ClientError`` if the command failed."""
        deadline = time.monotonic() + wait
        with self._changed:
            while command_id not in self._answers:
                if self._ended:
                    raise ClientDied(f"client {self.proc} exited without answering.\n{self.stderr_tail()}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"client {self.proc} did not answer within {wait:g}s")
                self._changed.wait(remaining)
            message = self._answers.pop(command_id)
        if not message["ok"]:
            raise ClientError(message["error"], message["message"])
        return message["result"]

    def call(self, op, *, wait=60, **args):
        """Send a command and wait up to ``wait`` seconds for its answer (``args`` may include a ``timeout``)."""
        return self.result(self.send(op, **args), wait)

    def stderr_tail(self, size=4000):
        try:
            self._stderr.flush()
            return Path(self._stderr.name).read_text(encoding="utf-8", errors="replace")[-size:]
        except (OSError, ValueError):
            return ""

    # -- the nemesis --------------------------------------------------------------------------------

    def pause(self, *, owner=None, lock=None):
        """Freeze the process (SIGSTOP), like a long garbage-collection pause or a swapped-out VM.

        ``owner``/``lock`` name the lease it holds: the checker then measures how long the lock stays
        unavailable to others (the pause counts as the holder's death until it resumes).
        """
        self.nemesis.record("fault", what="pause", target=self.proc, owner=owner, lock=lock)
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self):
        self.nemesis.record("fault", what="resume", target=self.proc)
        os.kill(self.pid, signal.SIGCONT)

    def kill(self, *, owner=None, lock=None):
        """Kill the process (SIGKILL); ``owner``/``lock`` name the lease it held, for the recovery time."""
        if not self.alive:
            return
        self.nemesis.record("kill", target=self.proc, owner=owner, lock=lock)
        os.kill(self.pid, signal.SIGKILL)
        self.process.wait()
        self._closed()

    def quit(self, timeout=60):
        """Ask the client to finish and wait for it; kill it if it does not."""
        if self.alive:
            try:
                self.send("quit")
                self.process.stdin.close()
                self.process.wait(timeout)
            except (ClientDied, subprocess.TimeoutExpired, BrokenPipeError, OSError):
                os.kill(self.pid, signal.SIGCONT)
                self.process.kill()
                self.process.wait()
        self._closed()

    def _closed(self):
        self._reader.join(10)
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except (BrokenPipeError, OSError):
                pass
        self._stderr.close()
