"""Evaluate a recorded history against the safety properties P1-P3 and P5-P7 of the fault suite.

It lives in the library because ``manage.py distlock verify`` evaluates users' runs with it too.

A history is a list of events (dicts), each with ``t`` (``time.monotonic_ns()`` of the harness,
comparable across processes on Linux), ``proc``, ``op`` and op-specific fields:

- ``acquire`` (``token``, ``owner``, ``lock``; ``phase`` "invoke", "ok" or "fail", "ok" if absent: only
  granted acquisitions count), ``release``, ``lost``
- ``cs_enter`` / ``cs_exit`` (``owner``, ``lock``): an un-fenced critical section
- ``store_commit`` (``row``, ``token``, ``accepted``, ``seq``): a fenced write as the store ordered it
- ``fault`` (``what``): the nemesis acted; ``kill`` (``owner``, ``lock``) a holder was killed. Recovery
  (P7) is measured from each kill, and from each fault that names the ``owner`` it cut off (a pause of
  the holder, its session expired)
"""

from collections import defaultdict
from dataclasses import dataclass, field

__all__ = ["INFINITY", "Verdict", "check", "critical_section_overlaps", "granted"]

INFINITY = float("inf")


def granted(event):
    """Return True for an ``acquire`` event that reports a granted lock (not an attempt or a failure)."""
    return event["op"] == "acquire" and event.get("phase", "ok") == "ok"


@dataclass
class Verdict:
    """What the checker found; ``ok`` covers the asserted properties only (P1 and P7 are reported)."""

    acquisitions: int = 0
    overlaps: int = 0
    max_overlap_ms: float = 0.0
    stale_accepted: list = field(default_factory=list)  # P2: accepted with a token below the max accepted
    false_rejections: list = field(default_factory=list)  # P2: rejected although no higher token was accepted
    stray_tokens: list = field(default_factory=list)  # P2: accepted tokens no acquire of the writer returned
    duplicate_tokens: list = field(default_factory=list)  # P3: one token issued twice for a lock
    regressions: list = field(default_factory=list)  # P3: a later acquire got a smaller token
    lost_updates: int = 0  # P5: final value minus (initial + accepted deltas)
    rejections: int = 0
    recovery_ms: list = field(default_factory=list)  # P7: holder killed or cut off -> next acquire by another

    @property
    def ok(self):
        return not (self.stale_accepted or self.false_rejections or self.stray_tokens or self.duplicate_tokens
                    or self.regressions or self.lost_updates)


def critical_section_overlaps(history):
    """P1: count pairs of intersecting critical sections of different owners, per lock.

    A section without ``cs_exit`` (its process was killed) lasts until another owner acquires the same
    lock, the earliest moment its lease is known to be over.
    """
    opened, sections = {}, defaultdict(list)
    acquires = defaultdict(list)
    for event in history:
        if granted(event):
            acquires[event["lock"]].append((event["t"], event["owner"]))
        elif event["op"] == "cs_enter":
            opened[event["owner"]] = (event["lock"], event["t"])
        elif event["op"] == "cs_exit" and event["owner"] in opened:
            lock, start = opened.pop(event["owner"])
            sections[lock].append((start, event["t"], event["owner"]))
    for owner, (lock, start) in opened.items():
        later = [t for t, other in acquires[lock] if t > start and other != owner]
        sections[lock].append((start, min(later) if later else INFINITY, owner))
    overlaps, max_overlap = 0, 0.0
    for intervals in sections.values():
        intervals.sort()
        for i, (start, end, owner) in enumerate(intervals):
            for other_start, other_end, other_owner in intervals[i + 1:]:
                if other_start >= end:
                    break
                if other_owner != owner:
                    overlaps += 1
                    if end != INFINITY:
                        max_overlap = max(max_overlap, (min(end, other_end) - other_start) / 1e6)
    return overlaps, max_overlap


def check(history, *, initial=None, final=None, rows=None):
    """Return the ``Verdict`` for ``history`` (sorted by ``t`` here, store commits by ``seq``).

    ``initial``/``final`` (row -> value) enable P5 for counters whose commits carry a ``delta``.
    """
    history = sorted(history, key=lambda event: event["t"])
    verdict = Verdict()
    verdict.overlaps, verdict.max_overlap_ms = critical_section_overlaps(history)

    issued = defaultdict(set)  # owner -> tokens its acquires returned
    last_token = {}
    seen_tokens = defaultdict(set)
    for event in history:
        if not granted(event):
            continue
        verdict.acquisitions += 1
        lock, token = event["lock"], event["token"]
        issued[event["owner"]].add(token)
        if token in seen_tokens[lock]:
            verdict.duplicate_tokens.append(event)
        seen_tokens[lock].add(token)
        if lock in last_token and token <= last_token[lock]:
            verdict.regressions.append(event)
        last_token[lock] = max(token, last_token.get(lock, token))

    commits = sorted((e for e in history if e["op"] == "store_commit"), key=lambda e: e["seq"])
    highest, deltas = {}, defaultdict(int)
    for commit in commits:
        row, token = commit["row"], commit["token"]
        top = highest.get(row)
        if commit["accepted"]:
            if top is not None and token < top:
                verdict.stale_accepted.append(commit)
            if commit.get("owner") is not None and token not in issued[commit["owner"]]:
                verdict.stray_tokens.append(commit)
            highest[row] = token if top is None else max(top, token)
            deltas[row] += commit.get("delta", 0)
        else:
            verdict.rejections += 1
            if top is None or token >= top:
                verdict.false_rejections.append(commit)
    if initial is not None and final is not None:
        verdict.lost_updates = sum(abs(final[row] - initial[row] - deltas[row]) for row in final)

    kills = [e for e in history if e["op"] == "kill" or (e["op"] == "fault" and e.get("owner") is not None)]
    for kill in kills:
        after = [e["t"] for e in history if granted(e) and e["t"] > kill["t"]
                 and e["owner"] != kill["owner"] and e["lock"] == kill["lock"]]
        if after:
            verdict.recovery_ms.append((min(after) - kill["t"]) / 1e6)
    return verdict
