"""Interrupt a waiting thread at each of its lines in turn, and see whether the threads that notify it still get through.

A signal handler that raises (Celery's soft time limit, ``gevent.Timeout``, Ctrl-C) can cut a
caller short between any two Python lines, including those of ``threading``. Afterwards the
backend's own threads must not block on anything the interrupted caller left behind, and the
caller must see its interrupt, not another error. ``lines_that_break`` raises an interrupt from a
trace function at the 1st, 2nd... line the caller runs, everywhere down its calls.
"""

import os
import sys
import threading

#: Seconds a notifier may take before it counts as blocked.
PATIENCE = 2.0


class Interrupt(BaseException):
    """What the trace function raises where an interrupt would land."""


def lines_that_break(make, *, most=300):
    """Return ``[(line, problem)]`` for every line at which interrupting ``wait()`` broke something.

    Each ``line`` says where: "n: function (file:line number)".

    ``make()`` returns a fresh ``(wait, notify)`` pair for each try; ``wait`` must return by itself
    soon (a short timeout). After ``wait()`` is cut short at its n-th line, ``notify()`` runs in
    another thread and must finish, without raising, within ``PATIENCE`` seconds (it may check that
    the structure still works). Stops once ``wait()`` ends (returning or raising) before its n-th line:
    every line was tried; after ``most`` lines at most.
    """
    problems = []
    for interrupt_at in range(1, most + 1):  # noqa: B007 - the trace reads it
        wait, notify = make()
        outcome, where = [], []
        lines = 0

        seen = set()

        def trace(frame, event, arg):
            nonlocal lines
            # Only a line's first run in a frame: the second line event of a ``with`` line is its exit,
            # where a signal cannot land before a C lock's __exit__ (one in a Python __exit__ still can).
            # And each return: raised there, it lands just after the call, before its caller goes on.
            if event in ("line", "return") and (id(frame), frame.f_lineno, event) not in seen:
                seen.add((id(frame), frame.f_lineno, event))
                lines += 1
                if lines == interrupt_at:
                    where.append(f"{interrupt_at}: {frame.f_code.co_name} "
                                 f"({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})")
                    raise Interrupt(interrupt_at)
            return trace

        def waiter():
            sys.settrace(trace)
            try:
                wait()
            except BaseException as exc:  # noqa: BLE001 - what came out is the result
                outcome.append(exc)
            else:
                outcome.append(None)
            finally:
                sys.settrace(None)

        waiting = threading.Thread(target=waiter, daemon=True)
        waiting.start()
        waiting.join(PATIENCE * 5)
        if waiting.is_alive():
            problems.append((where[0] if where else interrupt_at, "the interrupted wait did not return"))
            continue
        if lines < interrupt_at:
            return problems  # wait() ended before that line: every line was tried
        if outcome[0] is None:
            problems.append((where[0] if where else interrupt_at, "the wait swallowed the interrupt"))
        elif not isinstance(outcome[0], Interrupt):
            problems.append((where[0] if where else interrupt_at, f"the wait raised {outcome[0]!r} instead of the interrupt"))
        failures = []

        def notifier():
            try:
                notify()
            except Exception as exc:  # noqa: BLE001 - reported as a problem
                failures.append(exc)

        notifying = threading.Thread(target=notifier, daemon=True)
        notifying.start()
        notifying.join(PATIENCE)
        if notifying.is_alive():
            problems.append((where[0] if where else interrupt_at, "the notifier blocked"))
        elif failures:
            problems.append((where[0] if where else interrupt_at, f"the notifier failed: {failures[0]!r}"))
    raise AssertionError(f"wait() still ran after {most} lines: raise ``most``")
