"""The sidecar's state objects: engine instances, their process incarnations,
legs and clusters. Plain data; the tracker owns the rules that change them."""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass, field

from pdwatch import contract as c

_STAGE_NO = {stage: i for i, stage in enumerate(c.ALL_STAGES)}

# Heartbeats whose (receive - send) time feed the clock offset estimate.
OFFSET_SAMPLES = 16
# Below this, a measured offset is export latency rather than clock skew.
MIN_SKEW_NS = 1_000_000_000


@dataclass(slots=True, eq=False)
class Incarnation:
    """One engine process: a `service.instance.id` under a stable `pd.instance`."""

    id: str
    rank: int
    tp_size: int
    start_ns: int
    pid: int | None
    host: str
    gpu_uuids: tuple[str, ...]
    service: str
    version: str
    first_seen_ns: int  # sidecar clock
    last_seen_ns: int = 0  # any span
    last_heartbeat_ns: int = 0  # sidecar clock; 0 = none yet
    interval_s: float = 2.0
    seq: int = -1
    loop_iterations: int | None = None
    loop_changed_ns: int = 0
    tokens_generated: int = 0
    completed: int = 0
    failed: int = 0
    open_total: int | None = None
    open_counts: dict = field(default_factory=dict)
    # Engine-side counters pdwatch adds beside the contract (pdwatch.*, pd.engine.*).
    extra: dict = field(default_factory=dict)
    offsets: deque = field(default_factory=lambda: deque(maxlen=OFFSET_SAMPLES))
    keys: set = field(default_factory=set)  # open legs this process listed or reported

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
    ranks: dict = field(default_factory=dict)  # tp_rank -> Incarnation
    restarts: int = 0
    restart_times_ns: list = field(default_factory=list)  # sidecar clock, bounded
    retired: deque = field(default_factory=lambda: deque(maxlen=16))  # old incarnation ids
    # Sidecar times of recent ok finishes, for "serves others" (bounded: only recency matters).
    ok_times_ns: deque = field(default_factory=lambda: deque(maxlen=4096))

    def finished_ok_since(self, since_ns: int) -> int:
        times = self.ok_times_ns
        while times and times[0] < since_ns:
            times.popleft()
        return len(times)

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
    # The leg's last stage ended (a stage span said so); its leg span is due.
    stage_done: bool = False
    arrive_ns: int | None = None
    end_ns: int | None = None
    outcome: str | None = None  # None while open, or closed without a leg span ("vanished")
    # Finished stages as flat (stage index, start_ns, end_ns) triples: a compact
    # array instead of a tuple per stage is most of the memory an open leg costs.
    history: array | None = None
    errors: dict | None = None  # stage index -> reason, for stages that ended in failure
    listed_seq: int = -1
    stuck_at_ns: int | None = None  # sidecar clock, while stuck
    ever_stuck: bool = False
    probe: bool = False  # an engine's own warm-up or health check (contract v1.1 section 2)


def record_stage(leg: "Leg", stage: str, start_ns: int, end_ns: int, error: str | None) -> None:
    if leg.history is None:
        leg.history = array("Q")  # OTLP times are unsigned 64-bit
    n = _STAGE_NO[stage]
    leg.history.extend((n, start_ns, end_ns))
    if error is not None:
        if leg.errors is None:
            leg.errors = {}
        leg.errors[n] = error


def stage_history(leg: "Leg") -> list[tuple[str, int, int, str | None]]:
    """(stage, start_ns, end_ns, error) of each finished stage, in start order."""
    h = leg.history
    if not h:
        return []
    errors = leg.errors or {}
    out = [(c.ALL_STAGES[h[i]], h[i + 1], h[i + 2], errors.get(h[i])) for i in range(0, len(h), 3)]
    out.sort(key=lambda item: item[1])
    return out


@dataclass(slots=True, eq=False)
class Cluster:
    name: str
    last_ok_ns: int = 0  # sidecar clock of the latest leg that finished ok


@dataclass(slots=True)
class StuckLeg:
    leg: Leg
    age_s: float
    threshold_s: float


@dataclass(slots=True)
class Evaluation:
    """What the stuck rule found at one moment; read by the API and metrics."""

    at_ns: int
    stuck: list  # StuckLeg, oldest first
    # (cluster, role, stage, pd_instance) -> (stuck count, oldest age s)
    groups: dict
    thresholds: dict  # (cluster, role, stage) -> seconds
    flowing: dict  # cluster -> bool
