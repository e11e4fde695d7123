"""What the judge found at one moment, as immutable values: all that readers ever see.

The metrics collectors, the JSON API, the live page and the forwarder read
the latest `Evaluation` and nothing else of the tracker, so a read can never
change state, and never waits on ingest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdwatch import contract as c

from .gpu.join import Owner
from .gpu.sampler import DeviceSample


def stuck_description(stage: str, age_s: float, threshold_s: float, reason: str) -> str:
    """The one sentence a pd.stuck span and the API give for a stuck leg."""
    if reason == "threshold":
        return f"stuck in {stage} for {age_s:.0f} s (threshold {threshold_s:.0f} s)"
    return f"stuck in {stage} for {age_s:.0f} s: {reason.replace('_', ' ')} (threshold {threshold_s:.0f} s)"


@dataclass(frozen=True, slots=True)
class StuckLeg:
    trace_id: str
    rid: str
    room: int | None
    cluster: str
    role: str
    stage: str
    pd_instance: str
    peer: str | None
    age_s: float
    threshold_s: float
    reason: str  # contract section 5b: threshold | peer_gone | loop_frozen | engine_error
    why: str  # the evidence in words, with its figures
    stage_since_ns: int  # engine clock
    stuck_since_ns: int  # sidecar clock: when first judged stuck in this stage
    span_id: str | None
    offset_ns: int  # the engine's clock offset, sidecar minus engine
    prompt_tokens: int | None
    error: str | None
    incarnation: str | None
    arrive_ns: int | None


@dataclass(frozen=True, slots=True)
class StageRun:
    """One finished stage of a leg (engine clock)."""

    stage: str
    start_ns: int
    end_ns: int
    error: str | None


@dataclass(frozen=True, slots=True)
class LegDetail:
    """One leg of a request, open or done, as the judge saw it when asked (GET /api/v1/requests/{id})."""

    role: str
    rid: str
    room: int | None
    cluster: str
    pd_instance: str
    incarnation: str | None
    peer: str | None
    span_id: str | None
    open: bool
    outcome: str | None
    arrive_ns: int | None  # engine clock
    end_ns: int | None  # engine clock
    tokens: int
    prompt_tokens: int | None
    stages: tuple[StageRun, ...]  # in start order
    error: str | None  # the engine's last error for the leg that did not end it (inventory or leg span)
    # While open: where it is, since when (engine clock), how long (decode: since its last new token),
    # and the judge's latest verdict if it is stuck.
    stage: str | None
    stage_since_ns: int | None
    age_s: float | None
    stuck: StuckLeg | None


@dataclass(frozen=True, slots=True)
class RequestView:
    """Both legs of one request (a request's detail is asked for one at a time, not published each tick:
    a view of every leg in every evaluation would double the memory an open leg costs)."""

    trace_id: str
    legs: tuple[LegDetail, ...]


@dataclass(frozen=True, slots=True)
class Group:
    """One (cluster, role, stage, pd_instance): what its open legs came to."""

    stuck: int
    oldest_age_s: float
    evidence: dict[str, int]  # reason -> legs stuck on that evidence


@dataclass(frozen=True, slots=True)
class Rank:
    rank: int
    incarnation: str
    pid: int | None
    host: str
    start_ns: int
    heartbeat_seq: int
    heartbeat_age_s: float | None
    up: bool
    loop_iterations: int | None
    loop_still_s: float  # seconds its loop was seen not to advance
    loop_rule_s: float
    idle_turn_s: float | None  # pd.loop.idle_turn_s, as the engine said it
    completed: int
    failed: int
    tokens_generated: int
    open_total: int | None
    offset_s: float
    gpu_uuids: tuple[str, ...]
    peer_ids: tuple[str, ...]
    engine: dict[str, float]


@dataclass(frozen=True, slots=True)
class InstanceView:
    cluster: str
    name: str
    role: str
    up: bool
    loop_stalled: bool  # 3 intervals without loop progress (pdwatch_engine_loop_stalled)
    loop_frozen: bool  # the loop rule of contract section 5b holds, or pdwatch's idle rule beside it
    restarts: int
    restart_times_ns: tuple[int, ...]
    start_ns: int | None  # the current process (rank 0)
    heartbeat_age_s: float | None  # the stalest rank's
    open_counts: dict[str, int]
    open_total: int
    finished_ok_recent: int  # within the flow window
    ranks: tuple[Rank, ...]
    kv_used: float | None = None  # share of its KV pool in use, as its engine last said (None: not said)
    state: str = "up"  # contract section 5 (v1.2): up, down or departed
    open_at_silence: int = 0  # legs it listed in its last heartbeat, while down
    # v1.2, the engine side's health: pd.recorder.* summed over its current ranks (attribute -> count) ...
    recorder: dict[str, int] = field(default_factory=dict)
    # ... what it runs (its rank 0's service.name, pd.engine.version, pdwatch's telemetry.distro.version) ...
    engine: str = ""
    engine_version: str = ""
    plugin_version: str = ""
    # ... and how much of it the plugin sees: the least-observed rank's state (c.PLUGIN_UNKNOWN while no
    # rank says), and every rank's refusals.
    plugin_state: str = c.PLUGIN_UNKNOWN
    plugin_refused: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class GpuView:
    device: DeviceSample
    owner: Owner | None
    joined_by: str  # uuid | pid | config | none, or *_last_known


@dataclass(frozen=True, slots=True)
class Histogram:
    bounds: tuple[float, ...]
    # (cluster, role, stage) -> (bucket counts incl. +Inf, exemplars per bucket, sum)
    series: dict[tuple[str, str, str], tuple[tuple[int, ...], tuple[Any, ...], float]]


@dataclass(frozen=True, slots=True)
class Counters:
    spans_received: int
    spans_foreign: int
    spans_rejected: dict[str, int]
    duplicates: int
    heartbeats: int
    tracked_legs: int
    tracked_instances: int
    evicted: dict[str, int]
    instances_expired: int
    finished: dict[tuple[str, str, str, str], int]
    probes_finished: dict[tuple[str, str, str, str], int]
    stuck_detected: dict[tuple[str, str, str], int]
    label_sets_refused: int
    gone_peers: int


@dataclass(frozen=True, slots=True)
class Evaluation:
    at_ns: int
    seq: int  # +1 per judge tick
    stuck: tuple[StuckLeg, ...]  # oldest first
    groups: dict[tuple[str, str, str, str], Group]
    thresholds: dict[tuple[str, str, str], float]  # (cluster, role, stage) -> seconds
    flowing: dict[str, bool]  # cluster -> another leg finished ok within the flow window
    flow_window_s: float
    instances: tuple[InstanceView, ...]
    counters: Counters
    histogram: Histogram
    gpu_up: bool
    gpu_reason: str | None
    gpu_driver: str | None
    gpu_sampled_at: float | None
    gpus: tuple[GpuView, ...]
    diagnosis: tuple[dict[str, Any], ...]  # per cluster, contract section 7's shape
    # cluster -> family -> confidence, every family the classifier considered
    confidences: dict[str, dict[str, float]] = field(default_factory=dict)

    def clusters(self) -> list[str]:
        return sorted({i.cluster for i in self.instances} | set(self.flowing))


EMPTY = Evaluation(
    at_ns=0, seq=0, stuck=(), groups={}, thresholds={}, flowing={}, flow_window_s=0.0, instances=(),
    counters=Counters(0, 0, {}, 0, 0, 0, 0, {}, 0, {}, {}, {}, 0, 0), histogram=Histogram((), {}),
    gpu_up=False, gpu_reason="not sampled yet", gpu_driver=None, gpu_sampled_at=None, gpus=(), diagnosis=(),
)
