"""The tracker's state: engine instances, their process incarnations, legs and clusters.

Plain mutable data, owned by the one thread that runs the tracker (ingest and
the judge); readers never see these objects, only the immutable views of
`evaluation.py`.
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from pdwatch import contract as c

STAGE_NO = {stage: i for i, stage in enumerate(c.ALL_STAGES)}

# Heartbeats whose (receive - send) time feed the clock offset estimate.
OFFSET_SAMPLES = 16
# Below this, a measured offset is export latency rather than clock skew.
MIN_SKEW_NS = 1_000_000_000
# Loop stalls remembered per rank (each at most one per heartbeat; the window prunes them).
MAX_STALLS = 512
# An engine whose loop was seen to advance over this many heartbeats in a row with no legs open
# turns while idle; one that advanced only once or twice after its last leg closed may block when
# idle (an engine that waits on its input queue) and is never judged so. An engine that says how
# long its idle loop may stand still (pdwatch.loop.idle_turn_s) is taken at its word at once.
IDLE_TURNS_TO_TRUST = 3
# Loop stalls older than this count for no rule.
LOOP_STALL_WINDOW_NS = int(c.LOOP_STALL_WINDOW_S * 1e9)


# Stages whose passages the tracker remembers for the overtaken rule (contract section 5b, v1.2): every
# stage a leg waits in; in decode a leg produces, and a long generation is never overtaken.
PASSAGE_STAGES = frozenset(("bootstrap", "queued", "prefill", "transfer"))


class Passage(NamedTuple):
    """One leg's way through a stage, as its finished stage span said (engine clock)."""

    start_ns: int
    end_ns: int
    # The leg's trace id: its prompt tokens and peer are read from the leg when needed (a stage span
    # carries neither; the leg's inventory entries and its leg span do, often later).
    trace_id: str


@dataclass(slots=True, eq=False)
class Process:
    """What an engine process says of itself in its resource (contract section 3), beyond its names."""

    tp_size: int
    start_ns: int
    pid: int | None
    host: str
    gpu_uuids: tuple[str, ...]
    service: str
    version: str
    plugin_version: str  # telemetry.distro.version of a pdwatch recorder; "" when not pdwatch's or not said


@dataclass(slots=True, eq=False)
class Incarnation(Process):
    """One engine process: a `service.instance.id` under a stable `pd.instance`."""

    id: str
    rank: int
    first_seen_ns: int  # sidecar clock
    peer_ids: tuple[str, ...] = ()
    last_seen_ns: int = 0  # any span
    last_heartbeat_ns: int = 0  # sidecar clock; 0 = none yet
    interval_s: float = c.DEFAULT_HEARTBEAT_S
    seq: int = -1
    loop_iterations: int | None = None
    # Sidecar times of the first and the latest heartbeat that showed the current loop count:
    # between them the loop was seen not to advance.
    loop_since_ns: int = 0
    loop_seen_ns: int = 0
    loop_moves: bool = False  # seen to advance at least once: this engine counts its loop
    # (when, seconds) of each loop stall seen while the instance had open legs.
    stalls: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=MAX_STALLS))
    # ... and while it had none: an idle loop's pauses, for the idle rule only.
    idle_stalls: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=MAX_STALLS))
    # Heartbeats in a row that found the loop advanced while the instance was idle; at
    # IDLE_TURNS_TO_TRUST this engine's loop is known to turn while idle (turns_idle).
    idle_turns: int = 0
    turns_idle: bool = False
    # The engine's own word: its loop stands still at most this long while idle (None: not said).
    idle_turn_s: float | None = None
    tokens_generated: int = 0
    completed: int = 0
    failed: int = 0
    open_total: int | None = None
    # Sidecar time since which every inventory of this process listed open legs; 0 = idle.
    busy_since_ns: int = 0
    open_counts: dict[str, int] = field(default_factory=dict)
    # Engine-side counters pdwatch adds beside the contract (pdwatch.*, pd.engine.*).
    extra: dict[str, float] = field(default_factory=dict)
    offsets: deque[int] = field(default_factory=lambda: deque(maxlen=OFFSET_SAMPLES))
    keys: set[tuple[str, str]] = field(default_factory=set)  # open legs this process listed or reported
    # Sidecar time of its final heartbeat (v1.2): it left in order; 0 while it has sent none (or spoke since).
    final_ns: int = 0
    # pd.plugin.state and pd.plugin.refused (v1.2); "" while it has not said.
    plugin_state: str = ""
    plugin_refused: tuple[str, ...] = ()
    # The recorder's own counters (v1.2, pd.recorder.*: attribute name -> count) as its latest heartbeat said.
    recorder: dict[str, int] = field(default_factory=dict)
    # pd.schedule_policy (v1.2): the order it takes legs from its waiting queue; "" when it does not say.
    schedule_policy: str = ""
    # stage -> its latest passages, oldest first: the newest OVERTAKEN_PASSAGES_KEPT are all the overtaken
    # rule needs (those that overtook a leg still waiting are the latest to have left).
    passages: dict[str, deque[Passage]] = field(default_factory=dict)

    def offset_ns(self) -> int:
        """Sidecar clock minus engine clock, when they differ by more than export latency."""
        if not self.offsets:
            return 0
        best = min(self.offsets)  # least-delayed heartbeat is the best estimate
        return best if abs(best) >= MIN_SKEW_NS else 0


@dataclass(slots=True, eq=False)
class Instance:
    """A stable `pd.instance` (same across restarts) of one cluster."""

    cluster: str
    name: str
    role: str
    ranks: dict[int, Incarnation] = field(default_factory=dict)  # tp_rank -> Incarnation
    restarts: int = 0
    restart_times_ns: list[int] = field(default_factory=list)  # sidecar clock, bounded
    retired: deque[str] = field(default_factory=lambda: deque(maxlen=16))  # old incarnation ids
    # Sidecar times of recent ok finishes, for "serves others" (bounded: only recency matters).
    ok_times_ns: deque[int] = field(default_factory=lambda: deque(maxlen=4096))

    @property
    def owner(self) -> Incarnation | None:
        """The rank that owns request bookkeeping (contract section 3)."""
        return self.ranks.get(0) or (self.ranks[min(self.ranks)] if self.ranks else None)


@dataclass(slots=True, eq=False)
class Leg:
    trace_id: str
    role: str
    cluster: str
    pd_instance: str
    inc: Incarnation | None
    rid: str = ""
    room: int | None = None
    span_id: str | None = None
    peer: str | None = None
    stage: str | None = None
    stage_since_ns: int = 0  # engine clock
    progress_ns: int = 0  # engine clock: last new token (decode) or stage entry
    tokens: int = 0
    prompt_tokens: int | None = None
    # The leg's last stage ended (a stage span said so); its leg span is due.
    stage_done: bool = False
    arrive_ns: int | None = None
    end_ns: int | None = None
    closed_at_ns: int = 0  # sidecar clock: when the tracker saw it end
    outcome: str | None = None  # None while open, or closed without a leg span ("vanished")
    # Finished stages as flat (stage index, start_ns, end_ns) triples: a compact
    # array instead of a tuple per stage is most of the memory an open leg costs.
    history: array[int] | None = None
    errors: dict[int, str] | None = None  # stage index -> reason, for stages that ended in failure
    listed_seq: int = -1
    listed_at_ns: int = 0  # sidecar clock of the latest inventory that listed the leg
    error: str | None = None  # the engine's last error for the open leg (pd.open.errors)
    error_seq: int = -1  # the inventory that first carried it
    # Stage entries so far: the judge starts a leg's verdict over when this moves.
    entries: int = 0
    probe: bool = False  # an engine's own warm-up or health check (contract v1.1 section 2)

    def enter(self, stage: str, since_ns: int) -> None:
        """Into a new stage (or back into one): the judge's verdict on it starts over."""
        self.stage, self.stage_since_ns, self.progress_ns = stage, since_ns, since_ns
        self.stage_done = False
        self.entries += 1


def record_stage(leg: Leg, stage: str, start_ns: int, end_ns: int, error: str | None) -> None:
    if leg.history is None:
        leg.history = array("Q")  # OTLP times are unsigned 64-bit
    n = STAGE_NO[stage]
    leg.history.extend((n, start_ns, end_ns))
    if error is not None:
        if leg.errors is None:
            leg.errors = {}
        leg.errors[n] = error


def record_passage(inc: Incarnation, stage: str, start_ns: int, end_ns: int, trace_id: str) -> None:
    kept = inc.passages.get(stage)
    if kept is None:
        kept = inc.passages[stage] = deque(maxlen=c.OVERTAKEN_PASSAGES_KEPT)
    kept.append(Passage(start_ns, end_ns, trace_id))


def stage_history(leg: Leg) -> list[tuple[str, int, int, str | None]]:
    """(stage, start_ns, end_ns, error) of each finished stage, in start order."""
    h = leg.history
    if not h:
        return []
    errors = leg.errors or {}
    out = [(c.ALL_STAGES[h[i]], h[i + 1], h[i + 2], errors.get(h[i])) for i in range(0, len(h), 3)]
    out.sort(key=lambda item: item[1])
    return out


def arrival_ns(leg: Leg) -> int:
    """When the leg arrived, engine clock: its leg span's start, else its first stage's."""
    if leg.arrive_ns is not None:
        return leg.arrive_ns
    h = leg.history
    starts = [h[i + 1] for i in range(0, len(h), 3)] if h else []
    return min([*starts, leg.stage_since_ns]) if leg.stage is not None else min(starts, default=0)


@dataclass(slots=True, eq=False)
class Cluster:
    name: str
    last_ok_ns: int = 0  # sidecar clock of the latest leg that finished ok


@dataclass(slots=True, frozen=True)
class Retirement:
    """A process replaced by a newer one under the same pd.instance (a restart), as the tracker saw it."""

    cluster: str
    instance: str
    inc: Incarnation
    at_ns: int  # sidecar clock
