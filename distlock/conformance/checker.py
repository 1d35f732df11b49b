"""Evaluate a recorded history against the safety properties P1-P7 of the fault suite.

It lives in the library because ``manage.py distlock verify`` evaluates users' runs with it too.

A history is a list of events (dicts), each with ``t`` (``time.monotonic_ns()`` of the harness,
comparable across processes on Linux), ``proc``, ``op`` and op-specific fields:

- ``acquire`` (``token``, ``owner``, ``lock``; ``phase`` "invoke", "ok", "fail" or "info" (outcome
  unknown), "ok" if absent: only granted acquisitions count in P1-P3)
- ``release`` (``owner``, ``lock``; ``phase`` "invoke" (the call starts), "ok", "fail" or "info", "ok"
  if absent; ``released`` False if the server no longer had the lease); ``lost`` (``owner``, ``lock``):
  the library declared the lease lost;
  ``expired`` (``owner``, ``lock``, optional ``since``): whoever watched the server saw the lease end,
  at ``t`` at the latest and at ``since`` at the earliest
- ``cs_enter`` / ``cs_exit`` (``owner``, ``lock``): an un-fenced critical section
- ``write`` (``kind`` "claim" or "write", ``row``, ``owner``, ``token``, ``outcome``): a fenced call as
  its client saw it
- ``store_commit`` (``row``, ``kind``, ``token``, ``accepted``, ``seq``, ``value``: read by a claim,
  written by a write): a fenced call as the store ordered it
- ``fault`` (``what``; optional ``target`` or ``targets``: the client processes or servers it hit,
  ``owner``, ``lock``, ``phase`` "start" or "end", ``ends_leases``): the nemesis acted; ``kill``
  (``target``, ``owner``, ``lock``) a client was killed. Recovery (P7)
  is measured from each kill, and from each fault that names the ``owner`` it cut off (a pause of the
  holder, its session expired). ``ends_leases`` (on its "start" and "end"): the fault hit the servers
  (a partition, a member killed or paused), which may end any lease held while it lasts, whoever owns
  it: also one granted during the fault, from its grant on (a paused etcd leader that resumes, say)
"""

from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field

__all__ = [
    "HOLDER_STEPS",
    "FAULT_OPS",
    "INFINITY",
    "SEARCH_STEP_LIMIT",
    "Verdict",
    "check",
    "classify_overlaps",
    "critical_section_overlaps",
    "expiry_floors",
    "granted",
    "linearizability_violations",
    "lost_writes",
    "overlap_excerpts",
    "stale_reads",
]

INFINITY = float("inf")

#: Events the holder of a lease records itself, one after the other: its release call started after the last.
HOLDER_STEPS = frozenset({"acquire", "renew", "cs_enter", "cs_exit", "write", "read"})

#: Search steps the linearizability check of one lock may take before it gives up (reported as undecided).
SEARCH_STEP_LIMIT = 1_000_000

#: Nemesis events: a fault that cuts off a named ``owner`` lets the server end that owner's lease.
FAULT_OPS = frozenset({"fault", "kill"})


def _processes_hit(fault):
    """Return the names a nemesis event hit (``target``, ``targets``): client processes, or servers."""
    return {fault.get("target"), *(fault.get("targets") or ())} - {None}


def granted(event):
    """Return True for an ``acquire`` event that reports a granted lock (not an attempt or a failure)."""
    return event["op"] == "acquire" and event.get("phase", "ok") == "ok"


@dataclass
class Verdict:
    """What the checker found; ``ok`` covers the asserted properties only (P1 and P7 are reported).

    P4 counts unless ``forgets_grants`` says why the server may forget a grant (a canary); overlaps no
    fault explains count only if ``only_faults_cause_overlaps``.
    """

    acquisitions: int = 0
    overlaps: int = 0
    max_overlap_ms: float = 0.0
    unexplained_overlaps: list = field(default_factory=list)  # P1: overlaps no fault window or lost lease explains
    stale_accepted: list = field(default_factory=list)  # P2: accepted with a token below the max accepted
    false_rejections: list = field(default_factory=list)  # P2: rejected although no higher token was accepted
    stray_tokens: list = field(default_factory=list)  # P2: accepted tokens no acquire of the writer returned
    duplicate_tokens: list = field(default_factory=list)  # P3: one token issued twice for a lock
    regressions: list = field(default_factory=list)  # P3: a later acquire got a smaller token
    linearizability_violations: list = field(default_factory=list)  # P4: one description per lock
    lost_updates: int = 0  # P5: final value minus (initial + accepted deltas)
    lost_writes: list = field(default_factory=list)  # P5: acknowledged writes neither kept nor superseded
    stale_reads: list = field(default_factory=list)  # P5: accepted claims that read another value than the last write
    rejections: int = 0
    recovery_ms: list = field(default_factory=list)  # P7: holder killed or cut off -> next acquire by another
    forgets_grants: str | bool = False
    only_faults_cause_overlaps: bool = False

    @property
    def ok(self):
        return not (self.stale_accepted or self.false_rejections or self.stray_tokens or self.duplicate_tokens
                    or self.regressions or self.lost_updates or self.lost_writes or self.stale_reads
                    or (self.linearizability_violations and not self.forgets_grants)
                    or (self.unexplained_overlaps and self.only_faults_cause_overlaps))


def _milliseconds(t, origin):
    """Format monotonic ``t`` (ns) as milliseconds since ``origin``, the history's first event."""
    if t == INFINITY:
        return "never"
    if t == -INFINITY:
        return "the start"
    return f"{(t - origin) / 1e6:.1f} ms"


# -- P1: critical sections --------------------------------------------------------------------------


def _critical_sections(history):
    """Return ``(sections, grants)``: lock -> [(start, end, owner, proc)], lock -> [(t, owner)] of granted acquires.

    A section without ``cs_exit`` (its process was killed) lasts until another owner acquires the same
    lock, the earliest moment its lease is known to be over.
    """
    opened, sections, grants, procs = {}, defaultdict(list), defaultdict(list), {}
    for event in history:
        if granted(event):
            grants[event["lock"]].append((event["t"], event["owner"]))
            procs[event["owner"]] = event.get("proc")
        elif event["op"] == "cs_enter":
            opened[event["owner"]] = (event["lock"], event["t"], event.get("proc", procs.get(event["owner"])))
        elif event["op"] == "cs_exit" and event["owner"] in opened:
            lock, start, proc = opened.pop(event["owner"])
            sections[lock].append((start, event["t"], event["owner"], proc))
    for owner, (lock, start, proc) in opened.items():
        later = [t for t, other in grants[lock] if t > start and other != owner]
        sections[lock].append((start, min(later) if later else INFINITY, owner, proc))
    return sections, grants


def _overlapping_pairs(sections):
    """Yield ``(lock, earlier, later)`` for each pair of intersecting sections of different owners."""
    for lock, intervals in sections.items():
        intervals.sort(key=lambda section: section[:2])
        for i, earlier in enumerate(intervals):
            for j in range(i + 1, len(intervals)):  # by index: a slice would copy the rest for every section
                later = intervals[j]
                if later[0] >= earlier[1]:
                    break
                if later[2] != earlier[2]:
                    yield lock, earlier, later


def critical_section_overlaps(history):
    """P1: count pairs of intersecting critical sections of different owners, per lock; and the longest, in ms."""
    overlaps, max_overlap = 0, 0.0
    for _, earlier, later in _overlapping_pairs(_critical_sections(history)[0]):
        overlaps += 1
        if earlier[1] != INFINITY:
            max_overlap = max(max_overlap, (min(earlier[1], later[1]) - later[0]) / 1e6)
    return overlaps, max_overlap


def overlap_excerpts(history, *, margin_ms=500):
    """Return, per overlap of ``critical_section_overlaps``, the events around it as text: what a report of
    a failed run needs to tell its cause (a history folder may not outlive the run, in CI say).

    Each excerpt holds the lock's events and the nemesis's faults from ``margin_ms`` before the earlier
    section starts to ``margin_ms`` after the later one enters, times in ms since the history's first event.
    """
    history = sorted(history, key=lambda event: event["t"])
    origin = history[0]["t"] if history else 0
    margin = margin_ms * 1e6
    excerpts = []
    for lock, earlier, later in _overlapping_pairs(_critical_sections(history)[0]):
        first, last = earlier[0] - margin, later[0] + margin
        lines = [f"lock {lock!r}: {earlier[2]} in its section from {_milliseconds(earlier[0], origin)}, "
                 f"{later[2]} entered at {_milliseconds(later[0], origin)}"]
        for event in history:
            if first <= event["t"] <= last and (event.get("lock") == lock or event["op"] in FAULT_OPS):
                fields = {key: value for key, value in event.items() if key not in ("t", "lock")}
                lines.append(f"  {_milliseconds(event['t'], origin)} {fields}")
        excerpts.append("\n".join(lines))
    return excerpts


def _fault_windows(history):
    """Return ``[(fault, start, end)]``: when each nemesis fault acted; ``end`` None: until the next grant.

    A fault with ``phase`` "start" lasts until the next "end" with the same ``what`` and ``target``
    (or the end of the history). A fault without ``phase`` is instantaneous: its effect lasts until
    the lock is next granted to another owner than the one it names, which ``classify_overlaps``
    works out per lock.
    """
    windows, opened = [], defaultdict(deque)
    for event in history:
        if event["op"] not in FAULT_OPS:
            continue
        phase, key = event.get("phase"), (event.get("what"), event.get("target"))
        if phase == "start":
            opened[key].append(len(windows))
            windows.append((event, event["t"], INFINITY))
        elif phase == "end":
            if opened[key]:
                index = opened[key].popleft()
                windows[index] = (windows[index][0], windows[index][1], event["t"])
        else:
            windows.append((event, event["t"], None))
    return windows


def classify_overlaps(history):
    """P1: return ``(explained, unexplained)``, a description of each overlap of ``critical_section_overlaps``.

    An overlap is explained when the earlier holder's section meets the window of a fault that can
    have cut it off (``_fault_windows``): one naming that owner, or naming none and not aimed at
    another client process (``target``), and not naming another lock; or when the earlier holder's
    lease was declared ``lost`` or seen ``expired`` on that lock; or when the release of either
    holder found its lease gone and the later one entered after that lease's ttl can have run out
    (``expiry_floors``): a holder past its ttl, which only fencing stops. Anything else is a second grant no injected fault accounts for.
    """
    sections, grants = _critical_sections(history)
    origin = history[0]["t"] if history else 0
    clients = {event.get("proc") for event in history if event["op"] in ("acquire", "cs_enter")} - {None}
    ended = {(event.get("owner"), event["lock"]) for event in history if event["op"] in ("lost", "expired")}
    found_gone = {(event.get("owner"), event["lock"]) for event in history
                  if event["op"] == "release" and event.get("phase", "ok") == "ok" and event.get("released") is False}
    floors = expiry_floors(history)
    windows = _fault_windows(history)
    explained, unexplained = [], []
    for lock, earlier, later in _overlapping_pairs(sections):
        start, end, owner, proc = earlier
        description = (f"lock {lock!r}: {later[2]} entered at {_milliseconds(later[0], origin)} while {owner} "
                       f"was in its section ({_milliseconds(start, origin)} to {_milliseconds(end, origin)})")
        reason = "its lease was declared lost or seen expired" if (owner, lock) in ended else None
        for past_ttl in (owner, later[2]) if reason is None else ():
            if (past_ttl, lock) in found_gone and later[0] >= floors.get((past_ttl, lock), INFINITY):
                reason = f"{past_ttl}'s ttl had run out (its release found the lease gone)"
                break
        for fault, fault_start, fault_end in windows if reason is None else ():
            named = fault.get("owner")
            if named not in (None, owner) or fault.get("lock") not in (None, lock):
                continue
            target = fault.get("target")
            if named is None and target in clients and target != proc:
                continue
            if fault_end is None:
                after = [t for t, other in grants[lock] if t >= fault_start and other != named]
                fault_end = min(after, default=INFINITY)
            if fault_start <= end and fault_end >= start:
                reason = f"fault {fault.get('what', fault['op'])!r} at {_milliseconds(fault_start, origin)}"
                break
        if reason is None:
            unexplained.append(description)
        else:
            explained.append(f"{description}: {reason}")
    return explained, unexplained


# -- P4: the lock service against a fenced mutex ----------------------------------------------------


@dataclass
class _Operation:
    """An acquire or release of one lease, which may take effect anywhere from ``call`` to ``end``."""

    kind: str
    lease: int
    call: float
    end: float
    token: object = None


@dataclass
class _Lease:
    """One grant to an owner and what the history says of its end (see ``linearizability_violations``)."""

    owner: object
    acquire: int | None = None
    releases: list = field(default_factory=list)
    last_step: float = -INFINITY
    #: The earliest moment its ttl can have run out (``expiry_floors``), or None if the grant does not say.
    expiry_floor: float | None = None
    #: ``(earliest, latest)`` moments at which the server may have ended it on its own.
    endings: list = field(default_factory=list)


def _expiry_floor(grant, call):
    """The earliest moment the ttl of the lease ``grant`` (an acquire ``ok``) can run out, or None.

    A grant records its ``ttl`` (seconds). Unless renewed, the lease ends when it runs out: the server
    ends it (database, Redis, Redlock), or the holder's process deletes its key (ZooKeeper, etcd,
    whose sessions can also end it sooner: the history then shows it ``lost`` or a fault). The ttl
    counts from after the call began (``call``), and the clients only ever extend a lease by its own
    ttl, so it cannot run out before ``call + ttl``.
    """
    if grant.get("ttl") is None or call == -INFINITY:
        return None
    return call + grant["ttl"] * 1e9


def expiry_floors(history):
    """Return ``{(owner, lock): earliest moment its ttl can run out}`` for each grant that records a ttl."""
    floors, invoked = {}, defaultdict(deque)
    for event in sorted(history, key=lambda event: event["t"]):
        if event["op"] != "acquire":
            continue
        calls = invoked[(event.get("proc"), event.get("lock"))]
        if event.get("phase") == "invoke":
            calls.append(event["t"])
            continue
        call = calls.popleft() if calls else -INFINITY
        floor = _expiry_floor(event, call) if event.get("phase", "ok") == "ok" else None
        if floor is not None:
            floors[(event.get("owner"), event["lock"])] = floor
    return floors


def _lock_operations(events, fault_events):
    """Return ``(operations, leases)`` of one lock from its events and the faults that name its owners or hit their
    processes."""
    operations, leases, current = [], [], {}
    invoked = defaultdict(deque)
    releasing = {}  # owner -> (proc, call) of a release called and not yet returned: in flight

    def add(kind, lease, call, end, token=None):
        operations.append(_Operation(kind, lease, call, end, token))
        return len(operations) - 1

    def orphan(owner):
        """A lease without acquire, for a release acknowledged to an owner never granted the lock: never legal."""
        leases.append(_Lease(owner))
        current[owner] = len(leases) - 1
        return current[owner]

    server_faults_open = Counter()  # (what, target) of faults of the servers that started and have not ended
    for event in sorted([*events, *fault_events], key=lambda event: event["t"]):
        op, owner, t = event["op"], event.get("owner"), event["t"]
        if op in FAULT_OPS and event.get("ends_leases"):
            key = (event.get("what"), event.get("target"))
            if event.get("phase") == "start":
                server_faults_open[key] += 1
            elif event.get("phase") == "end" and server_faults_open[key]:
                server_faults_open[key] -= 1
        if op == "release" and event.get("phase") == "invoke":
            releasing[owner] = (event.get("proc"), t)
            continue
        if op == "release":
            releasing.pop(owner, None)
        if op == "acquire":
            phase = event.get("phase", "ok")
            if phase == "invoke":
                invoked[event.get("proc")].append(t)
                continue
            call = invoked[event.get("proc")].popleft() if invoked[event.get("proc")] else -INFINITY
            if phase == "fail" or (phase == "info" and owner is None):
                continue  # no effect, or one nothing later can depend on (``linearizability_violations``)
            leases.append(_Lease(owner, last_step=t if phase == "ok" else call,
                                 expiry_floor=_expiry_floor(event, call)))
            current[owner] = len(leases) - 1
            if +server_faults_open:  # granted while the servers are faulty: it may end any time from now on
                leases[-1].endings.append((t, INFINITY))
            leases[-1].acquire = add("acquire", current[owner], call, t if phase == "ok" else INFINITY,
                                     event.get("token"))
        elif op in HOLDER_STEPS and owner in current:
            leases[current[owner]].last_step = t
        elif op == "release" and event.get("phase", "ok") == "ok" and event.get("released") is not False:
            index = orphan(owner) if owner not in current else current[owner]
            leases[index].releases.append(add("release", index, leases[index].last_step, t))
        elif op == "release" and owner in current:
            lease = leases[current[owner]]
            if event.get("phase", "ok") != "ok":
                lease.endings.append((lease.last_step, INFINITY))
            else:  # found gone: its ttl ran out (from its floor on) or, without a ttl that ends it, by now
                lease.endings.append((min(t, lease.expiry_floor if lease.expiry_floor is not None else t), t))
        elif op in ("lost", "expired") and owner in current:
            leases[current[owner]].endings.append((event.get("since", t) if op == "expired" else t, t))
        elif op in FAULT_OPS and event.get("ends_leases"):
            for index in current.values():
                leases[index].endings.append((t, INFINITY))
        elif op in FAULT_OPS:
            if owner in current:
                leases[current[owner]].endings.append((t, INFINITY))
            # A release whose process was killed or paused in flight may have reached the server, and
            # taken effect, any time since its call: another owner may be granted before the fault.
            hit = _processes_hit(event)
            for releaser, (proc, call) in releasing.items():
                if proc in hit and releaser in current:
                    leases[current[releaser]].endings.append((call, INFINITY))
    for index, lease in enumerate(leases):
        if lease.endings and not lease.releases:
            latest = min(end for _, end in lease.endings)
            earliest = min(min(start for start, _ in lease.endings), latest)
            lease.releases.append(add("release", index, earliest, latest))
    return operations, leases


class _SearchGaveUp(Exception):
    """The search took more steps than it may: the lock is neither shown linearizable nor not."""


def _search(operations, leases, tokens_must_increase, step_limit):
    """Look for an order of ``operations`` the fenced mutex accepts; return None if there is one.

    Otherwise return ``(owner, last_token, operation)`` where the search got furthest: the lease
    holding the lock then (or None), the highest token granted, and the pending operation nothing
    could be placed before. Raise ``_SearchGaveUp`` after ``step_limit`` steps.

    Only operations called before the earliest end still pending can come next (Wing & Gong), and a
    state (set already placed, holder, highest token) is never explored twice (Lowe). The mutex
    narrows the choice further: a held lock admits only its holder's release; a free one only the
    acquire of the pending operation's own lease, or of a lease whose release can come before it.
    """
    required = sorted((i for i, operation in enumerate(operations) if operation.end < INFINITY),
                      key=lambda i: operations[i].end)
    releases = sorted((i for i, operation in enumerate(operations) if operation.kind == "release"),
                      key=lambda i: operations[i].call)

    def pending(placed, index):
        while index < len(required) and placed >> required[index] & 1:
            index += 1
        return index

    # A lease none of whose operations must happen (an ``info`` acquire that nothing ends for sure) is
    # never worth placing: it could only raise the highest token and hold the lock for a while.
    needed = {operations[i].lease for i in required}

    def settled(placed, release):
        """True once ``release`` can no longer make its lease's acquire worth trying (see ``candidates``)."""
        lease = operations[release].lease
        acquire = leases[lease].acquire
        return acquire is None or lease not in needed or placed >> release & 1 or placed >> acquire & 1

    def allowed(acquire, last):
        token = operations[acquire].token
        return not (tokens_must_increase and None not in (token, last) and token <= last)

    def candidates(placed, holder, last, head, next_release):
        horizon = operations[head].end
        if holder is not None:
            return [r for r in leases[holder].releases if not placed >> r & 1 and operations[r].call <= horizon]
        tenants = [operations[head].lease]
        for release in releases[next_release:]:
            if operations[release].call > horizon:
                break
            if not settled(placed, release):
                tenants.append(operations[release].lease)
        acquires = (leases[lease].acquire for lease in dict.fromkeys(tenants))
        return [a for a in acquires if a is not None and not placed >> a & 1 and operations[a].call <= horizon
                and allowed(a, last)]

    first = pending(0, 0)
    if first == len(required):
        return None
    # A frame: placed (bit set), holder, last token, index in ``required``, in ``releases``, choices, tried.
    stack = [[0, None, None, first, 0, None, 0]]
    seen, steps, furthest = set(), 0, ((-1, -1), None)
    while stack:
        frame = stack[-1]
        placed, holder, last, waiting, next_release, choices, tried = frame
        if choices is None:
            while next_release < len(releases) and settled(placed, releases[next_release]):
                next_release += 1
            frame[4] = next_release
            frame[5] = choices = candidates(placed, holder, last, required[waiting], next_release)
            progress = (waiting, placed.bit_count())
            if progress > furthest[0]:
                furthest = (progress, (holder, last, operations[required[waiting]]))
        if tried == len(choices):
            stack.pop()
            continue
        frame[6] += 1
        chosen = operations[choices[tried]]
        now_placed = placed | 1 << choices[tried]
        if chosen.kind == "release":
            state = (now_placed, None, last)
        else:
            token = chosen.token
            state = (now_placed, chosen.lease, last if token is None else token if last is None else max(last, token))
        if state in seen:
            continue
        seen.add(state)
        steps += 1
        if steps > step_limit:
            raise _SearchGaveUp
        following = pending(now_placed, waiting)
        if following == len(required):
            return None
        stack.append([*state, following, next_release, None, 0])
    return furthest[1]


def _describe_failure(lock, failure, operations, leases, origin):
    """Describe in one line why, where the failed search got furthest, no operation could come next."""
    holder, last, operation = failure
    lease = leases[operation.lease]
    when = _milliseconds(operation.end, origin)
    if operation.kind == "release" and lease.acquire is None:
        return f"lock {lock!r}: {lease.owner} released it (acknowledged at {when}) without ever holding it"
    if operation.kind == "release" and holder not in (None, operation.lease):
        return (f"lock {lock!r}: {lease.owner}'s release was acknowledged at {when} while "
                f"{leases[holder].owner} held the lock")
    if operation.kind == "release":
        return f"lock {lock!r}: {lease.owner}'s lease ended by {when} although it did not hold the lock then"
    token = "a grant" if operation.token is None else f"token {operation.token}"
    if holder is not None:
        other = leases[holder]
        ends = [operations[r].call for r in other.releases]
        return (f"lock {lock!r}: {lease.owner} got {token} (ok at {when}) while {other.owner} held it, whose lease "
                + (f"ends no earlier than {_milliseconds(min(ends), origin)}" if ends else
                   "nothing ends (no release, lost, expired or fault naming it)"))
    if None not in (operation.token, last) and operation.token <= last:
        return f"lock {lock!r}: {lease.owner} got {token} (ok at {when}), not above token {last} granted before it"
    return f"lock {lock!r}: {lease.owner}'s grant of {token} (ok at {when}) fits no order of the lock's operations"


def linearizability_violations(history, *, tokens_must_increase=True, step_limit=SEARCH_STEP_LIMIT):
    """P4: return one description per lock whose acquires and releases no fenced-mutex order explains.

    The model is Knossos' mutex with the fence of Hazelcast's FencedLock: an acquire is legal only
    while nobody holds the lock and (``tokens_must_increase``) with a token above every token granted
    before; a release only by the holder. ``tokens_must_increase`` is False for backends that do not
    promise ordered tokens (Redlock): mutual exclusion alone is checked then.

    Each lease (a grant to an owner, up to that owner's next grant of the lock) is an acquire from
    its ``invoke`` (the start of time if none was recorded) to its ``ok`` (+inf for ``info``: it may
    not have happened). A ``fail`` took no effect, nor, as far as the model can tell, does an
    ``info`` of an unknown owner: its lease could only have expired unseen. The lease's release is
    placed only where explicit evidence puts the end of the lease:

    - its own acknowledged ``release`` (ok, ``released`` not False): between the holder's last step
      before it (``HOLDER_STEPS``, which the release call followed) and its reply;
    - otherwise, the server ended it on its own. A ``lost`` of the owner ends it at that moment: the
      earliest time the history knows of it. So does a release that found it gone (``released``
      False), unless the grant recorded its ttl (``expiry_floors``): then any time from the moment
      that ttl can have run out to the release's reply.
      An ``expired`` event ends it between its ``since`` (default its ``t``) and its ``t``. A fault or
      kill naming the owner (paused, killed, session expired), or a fault of the servers
      (``ends_leases``) that starts or ends while it holds, lets the server end it any time from then on,
      and so does a release that failed or was cut short, from its call on. A fault that hits the
      owner's process (``target``, ``targets``) while a release of the lease is in flight (its
      ``invoke`` recorded, its reply not) does too, from that release's ``invoke`` on; not from the
      holder's last step, which would excuse a grant made while a holder killed later still held.
      All perhaps after the history (+inf). With several of these, the earliest start and the
      earliest end count;
    - without any of these the lease never ends.

    Another owner's grant is never evidence that a lease ended: it would explain every double grant.
    So a second grant while a lease holds, with no such evidence, is a violation, unless the server
    may forget grants (``check(forgets_grants=...)``). Each lock is searched on its own (``_search``).
    """
    origin = history[0]["t"] if history else 0
    by_lock, client_faults, server_faults = defaultdict(list), [], []
    for event in history:
        if event["op"] in FAULT_OPS and event.get("ends_leases"):
            server_faults.append(event)
        elif event["op"] in FAULT_OPS:
            client_faults.append(event)
        elif event["op"] in ("acquire", "release", "lost", "expired") or (
                event["op"] in HOLDER_STEPS and "lock" in event):
            by_lock[event["lock"]].append(event)
    violations = []
    for lock, events in by_lock.items():
        owners = {event.get("owner") for event in events} - {None}
        procs = {event.get("proc") for event in events} - {None}
        faults = [fault for fault in client_faults if fault.get("lock") in (None, lock)
                  and (fault.get("owner") in owners or not procs.isdisjoint(_processes_hit(fault)))] + server_faults
        operations, leases = _lock_operations(events, faults)
        try:
            failure = _search(operations, leases, tokens_must_increase, step_limit)
        except _SearchGaveUp:
            violations.append(f"lock {lock!r}: undecided, no order found nor ruled out in {step_limit} steps")
            continue
        if failure is not None:
            violations.append(_describe_failure(lock, failure, operations, leases, origin))
    return violations


# -- P5: the fenced register ------------------------------------------------------------------------


def _commits_by_row(history):
    commits = defaultdict(list)
    for event in sorted((e for e in history if e["op"] == "store_commit"), key=lambda e: e["seq"]):
        commits[event["row"]].append(event)
    return commits


def lost_writes(history, *, final=None):
    """P5: return the acknowledged writes that are neither in the final state nor superseded.

    In store order, an accepted write is superseded by a later accepted write with a token at least
    as high; the last one must be what ``final`` (row -> value) holds, when its ``value`` was logged.
    A write whose client saw it accepted (``write`` event, kind "write", outcome "accepted") without
    an accepted commit of that row, owner and token in the store's log was lost before the log.
    """
    lost = []
    stored = Counter()
    for row, commits in _commits_by_row(history).items():
        writes = [c for c in commits if c["accepted"] and c.get("kind", "write") == "write"]
        stored.update((c["row"], c.get("owner"), c["token"]) for c in writes)
        highest_later = None
        for write in reversed(writes):
            if highest_later is None:
                if final is not None and row in final and write.get("value") not in (None, final[row]):
                    lost.append(write)
            elif highest_later < write["token"]:
                lost.append(write)
            highest_later = write["token"] if highest_later is None else max(highest_later, write["token"])
    for event in history:
        if event["op"] == "write" and event.get("kind") == "write" and event.get("outcome") == "accepted":
            key = (event["row"], event.get("owner"), event["token"])
            if stored[key]:
                stored[key] -= 1
            else:
                lost.append(event)
    return lost


def stale_reads(history, *, initial=None):
    """P5: return the accepted claims that read another value than the last accepted write before them in store order.

    Before any write the row holds its ``initial`` value (row -> value) if given, else what its first
    claim read. Commits without a logged ``value`` leave the row's value unknown until the next one.
    """
    stale = []
    for row, commits in _commits_by_row(history).items():
        value = None if initial is None else initial.get(row)
        for commit in commits:
            if not commit["accepted"]:
                continue
            if commit.get("kind", "write") == "write":
                value = commit.get("value")
            elif value is not None and commit.get("value") not in (None, value):
                stale.append(commit)
            elif value is None:
                value = commit.get("value")
    return stale


def check(history, *, initial=None, final=None, rows=None, tokens_must_increase=True, forgets_grants=False,
          only_faults_cause_overlaps=False):
    """Return the ``Verdict`` for ``history`` (sorted by ``t`` here, store commits by ``seq``).

    ``initial``/``final`` (row -> value) enable P5 for counters whose commits carry a ``delta``, and
    the register's final state. ``tokens_must_increase``: False for backends without ordered tokens
    (P4 then checks mutual exclusion only). ``forgets_grants``: why the server may forget a grant (a
    restart without persistence), or False: P4 then counts in ``ok``. ``only_faults_cause_overlaps``:
    every overlap must be explained by an injected fault or a lost lease (``classify_overlaps``).
    """
    history = sorted(history, key=lambda event: event["t"])
    verdict = Verdict(forgets_grants=forgets_grants, only_faults_cause_overlaps=only_faults_cause_overlaps)
    verdict.overlaps, verdict.max_overlap_ms = critical_section_overlaps(history)
    verdict.unexplained_overlaps = classify_overlaps(history)[1]
    verdict.linearizability_violations = linearizability_violations(history, tokens_must_increase=tokens_must_increase)
    verdict.lost_writes = lost_writes(history, final=final)
    verdict.stale_reads = stale_reads(history, initial=initial)

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
                 and e["owner"] != kill["owner"] and e["lock"] == kill.get("lock")]
        if after:
            verdict.recovery_ms.append((min(after) - kill["t"]) / 1e6)
    return verdict
