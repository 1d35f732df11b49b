"""One row of results per scenario and backend, and the markdown table ``distlock verify`` and docs/SAFETY.md print."""

import math
from dataclasses import dataclass, field

__all__ = ["COLUMNS", "InterruptCounts", "NOT_APPLICABLE", "Result", "markdown_table", "percentile", "table_row"]

#: Shown where a figure does not apply (Redlock's tokens are not offered to the store).
NOT_APPLICABLE = "n/a"


@dataclass
class InterruptCounts:
    """What the interrupt storm found on one backend (scenario "interrupts mid-call"); 0 expected in the last five."""

    #: Lock calls made with a random interrupt armed, and how many the interrupt cut short.
    operations: int = 0
    interrupted: int = 0
    #: Grants while another owner held the lock: overlapping critical sections of different owners.
    wrong_grants: int = 0
    #: Calls that raised something other than ``LockNotAcquired``, ``BackendUnavailable`` or the interrupt,
    #: or whose extend/release of a lease valid and never interrupted found it gone.
    misread_replies: int = 0
    #: Client processes that did not finish the storm by their deadline (killed).
    hangs: int = 0
    #: Lock names still held, or not acquirable, once ttl + 1 s (+ the session timeout) passed after the client exited.
    locks_left: int = 0
    #: Wall-clock seconds of the storm itself (calibration, calls, final releases), in the client.
    seconds: float | None = None
    #: Full tracebacks of the misread replies (and of a hang), for the test's failure message; not tabled.
    tracebacks: list = field(default_factory=list)


@dataclass
class Result:
    """What a scenario found on one backend, over all its runs.

    ``violations`` lists broken properties that must hold everywhere (fenced safety, token order,
    liveness bounds, documented errors); ``notes`` reports what is expected or merely measured, such
    as the overlaps of un-fenced critical sections under a pause.
    """

    scenario: str
    backend: str
    runs: int = 0
    acquisitions: int = 0
    #: Overlapping critical sections of different holders, without fencing (P1, reported).
    overlaps: int = 0
    #: Fenced writes accepted with a token older than one the row had accepted (P2); None: not fenced.
    stale_accepted: int | None = None
    #: Fenced writes refused although no newer token had been accepted (P2); None: not fenced.
    false_rejections: int | None = None
    #: Refused fenced writes as the history, the ``FencingRejection`` table and the metric count them (P6).
    rejections: int | None = None
    rejection_rows: int | None = None
    rejection_metric: int | None = None
    #: Milliseconds from a holder's death (or fault) to the next acquisition by someone else (P7).
    recovery_ms: list = field(default_factory=list)
    #: Granted and attempted tries per second, for scenarios that measure them (contended tries); else None.
    grants_per_second: float | None = None
    tries_per_second: float | None = None
    #: The interrupt storm's figures, for that scenario only; else None.
    interrupts: InterruptCounts | None = None
    violations: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    @property
    def ok(self):
        return not self.violations


def percentile(values, q):
    """Return the nearest-rank ``q``-th percentile of ``values`` (None if empty)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _number(value):
    return NOT_APPLICABLE if value is None else str(value)


def _seconds(milliseconds):
    return "—" if milliseconds is None else f"{milliseconds / 1000:.2f} s"


def _rejections(result):
    counts = [result.rejections, result.rejection_rows, result.rejection_metric]
    known = [count for count in counts if count is not None]
    if result.rejections is None:
        return NOT_APPLICABLE
    if len(set(known)) == 1:
        return str(result.rejections) + (" (metric off)" if result.rejection_metric is None else "")
    metric = "metric off" if result.rejection_metric is None else f"metric {result.rejection_metric}"
    return f"history {result.rejections} / rows {result.rejection_rows} / {metric}"


COLUMNS = ["scenario", "backend", "runs", "acquisitions", "overlaps without fencing",
           "stale writes accepted with fencing", "false rejections", "rejections logged",
           "recovery p50", "recovery p99", "verdict"]


def table_row(result):
    verdict = "ok" if result.ok else "**VIOLATION**: " + "; ".join(result.violations)
    if result.notes:
        verdict += " (" + "; ".join(result.notes) + ")"
    return [result.scenario, result.backend, str(result.runs), str(result.acquisitions), str(result.overlaps),
            _number(result.stale_accepted), _number(result.false_rejections), _rejections(result),
            _seconds(percentile(result.recovery_ms, 50)), _seconds(percentile(result.recovery_ms, 99)), verdict]


def markdown_table(results):
    """Return ``results`` as a markdown table, one row per scenario and backend."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for result in results:
        cells = [cell.replace("|", "\\|") for cell in table_row(result)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
