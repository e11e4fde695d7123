"""Every name the telemetry contract fixes (docs/contract.md), at the bottom of the tree.

The recorder, the SGLang plugin, the sidecar, the alert generator, the
dashboards, the docs tables and the tests import these instead of spelling a
string twice, so a typo cannot split a producer from its consumer. This module
imports nothing of pdwatch's.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

CONTRACT_VERSION = "1.1"

ROLES = ("prefill", "decode", "unified")

# Stage order per role (contract section 1).
STAGES: dict[str, tuple[str, ...]] = {
    "prefill": ("bootstrap", "queued", "prefill", "transfer"),
    "decode": ("bootstrap", "transfer", "queued", "decode"),
    "unified": ("queued", "prefill", "decode"),
}
ALL_STAGES = ("bootstrap", "queued", "prefill", "transfer", "decode")

OUTCOMES = ("ok", "aborted", "failed", "timeout")
# Added by the sidecar when an instance restarts under an open leg.
OUTCOME_LOST = "lost"

# Why a leg is stuck (section 5b): the threshold of section 5, or evidence.
REASON_THRESHOLD = "threshold"
REASON_PEER_GONE = "peer_gone"
REASON_LOOP_FROZEN = "loop_frozen"
REASON_ENGINE_ERROR = "engine_error"
EVIDENCE_REASONS = (REASON_PEER_GONE, REASON_LOOP_FROZEN, REASON_ENGINE_ERROR)
STUCK_REASONS = (REASON_THRESHOLD, *EVIDENCE_REASONS)

# Failure families (section 8).
FAMILIES = ("transfer_wedge", "bootstrap_wedge", "collective_desync", "queue_starvation", "total_wedge",
            "restart_skew", "engine_silent")

# Defaults (sections 4, 5).
DEFAULT_FLOORS_S = {"bootstrap": 30.0, "queued": 60.0, "prefill": 60.0, "transfer": 15.0, "decode": 30.0}
DEFAULT_FLOW_WINDOW_S = 60.0
DEFAULT_HEARTBEAT_S = 2.0
DEFAULT_INVENTORY_MAX = 2048
# An instance is down after this many heartbeat intervals without one.
DOWN_AFTER_INTERVALS = 3
# Thresholds: max(floor, P99_FACTOR x p99 over the last THRESHOLD_WINDOW_S or THRESHOLD_SAMPLES).
P99_FACTOR = 3.0
THRESHOLD_WINDOW_S = 600.0
THRESHOLD_SAMPLES = 1000
# loop_frozen: no loop progress for max(LOOP_FROZEN_INTERVALS heartbeats, LOOP_STALL_FACTOR x the
# longest stall of that rank's loop in the last LOOP_STALL_WINDOW_S).
LOOP_FROZEN_INTERVALS = 2
LOOP_STALL_FACTOR = 3.0
LOOP_STALL_WINDOW_S = 600.0
# pdwatch_stuck_request_info keeps only this many of the oldest stuck legs.
STUCK_INFO_TOP = 20

# ---- span names (section 4) ------------------------------------------------------------------
SPAN_LEG = "pd.request"
SPAN_HEARTBEAT = "pd.heartbeat"
SPAN_STUCK = "pd.stuck"
STAGE_SPAN_PREFIX = "pd."  # pd.bootstrap, pd.queued, ...


def stage_span_name(stage: str) -> str:
    return STAGE_SPAN_PREFIX + stage


STAGE_SPAN_NAMES = tuple(stage_span_name(s) for s in ALL_STAGES)

# ---- resource attributes (section 3) ---------------------------------------------------------
R_SERVICE_NAME = "service.name"
R_INSTANCE_ID = "service.instance.id"
R_PID = "process.pid"
R_HOST = "host.name"
R_CLUSTER = "pd.cluster"
R_ROLE = "pd.role"
R_INSTANCE = "pd.instance"
R_START_NS = "pd.start_time_unix_nano"
R_TP_RANK = "pd.tp_rank"
R_TP_SIZE = "pd.tp_size"
R_GPU_UUIDS = "pd.gpu.uuids"
R_ENGINE_VERSION = "pd.engine.version"
R_PEER_IDS = "pd.peer_ids"  # v1.1

# ---- span attributes (section 4) -------------------------------------------------------------
A_ROLE = "pd.role"
A_RID = "pd.rid"
A_ROOM = "pd.bootstrap_room"
A_PEER = "pd.peer"
A_OUTCOME = "pd.outcome"
A_PROMPT_TOKENS = "pd.prompt_tokens"
A_OUTPUT_TOKENS = "pd.output_tokens"
A_STAGE = "pd.stage"
A_XFER_BYTES = "pd.transfer.bytes"
A_XFER_BACKEND = "pd.transfer.backend"
A_PROBE = "pd.probe"  # v1.1: an engine's own warm-up or health check, never "others flowing"

# ---- heartbeat attributes (section 4) --------------------------------------------------------
H_SEQ = "pd.heartbeat.seq"
H_INTERVAL = "pd.heartbeat.interval_s"
H_LOOP = "pd.loop.iterations"
H_COMPLETED = "pd.completed"
H_FAILED = "pd.failed"
H_TOKENS = "pd.tokens.generated"
H_OPEN_TOTAL = "pd.open.total"
H_OPEN_COUNT_PREFIX = "pd.open.count."
H_OPEN_TRACE_IDS = "pd.open.trace_ids"
H_OPEN_RIDS = "pd.open.rids"
H_OPEN_STAGES = "pd.open.stages"
H_OPEN_SINCE = "pd.open.stage_since_unix_nano"
H_OPEN_TOKENS = "pd.open.tokens"
H_OPEN_SPAN_IDS = "pd.open.span_ids"
# v1.1 lists, parallel to the others.
H_OPEN_ROOMS = "pd.open.bootstrap_rooms"  # -1 when unknown
H_OPEN_PEERS = "pd.open.peers"  # "" when unknown
H_OPEN_LAST_TOKEN = "pd.open.last_token_unix_nano"  # 0 before the first token
H_OPEN_ERRORS = "pd.open.errors"  # "" when none
H_OPEN_PROMPT_TOKENS = "pd.open.prompt_tokens"  # -1 when unknown
H_OPEN_PROBES = "pd.open.probes"

# pdwatch's own heartbeat attributes beside the contract's (its health, engine counters).
H_RECORDER_PREFIX = "pdwatch.recorder."
H_ENGINE_PREFIX = "pd.engine."
H_HOOK_ERRORS = "pdwatch.recorder.hook_errors"
H_WORKER_CPU = "pdwatch.recorder.worker_cpu_s"  # the recorder thread's CPU seconds so far
# The longest the engine's loop stands still while idle, seconds (0: it spins), as the engine knows
# it: the sidecar then judges an idle loop that stops without first watching it turn while idle.
H_LOOP_IDLE_TURN = "pdwatch.loop.idle_turn_s"

# ---- the sidecar's pd.stuck span (section 10) ------------------------------------------------
A_INSTANCE = "pd.instance"
A_FAMILY = "pdwatch.family"
A_REASON = "pdwatch.reason"  # v1.1

# ---- metric labels and names (section 6) -----------------------------------------------------
L_CLUSTER, L_ROLE, L_STAGE, L_INSTANCE = "cluster", "role", "stage", "pd_instance"
L_OUTCOME, L_FAMILY, L_GPU, L_UUID, L_REASON = "outcome", "family", "gpu", "uuid", "reason"
L_TRACE_ID, L_RID = "trace_id", "rid"
LEG_GROUP = (L_CLUSTER, L_ROLE, L_STAGE, L_INSTANCE)
INSTANCE_KEY = (L_CLUSTER, L_ROLE, L_INSTANCE)
GPU_KEY = (L_GPU, L_UUID, L_CLUSTER, L_ROLE, L_INSTANCE)


class Metric(NamedTuple):
    name: str  # as exposed; counters without their _total suffix
    type: str  # gauge | counter | histogram
    labels: tuple[str, ...]

    @property
    def series(self) -> str:
        """The name a query uses: a counter's samples end in _total."""
        return self.name + "_total" if self.type == "counter" else self.name

    @property
    def series_names(self) -> tuple[str, ...]:
        """Every sample name the metric exposes (a histogram's three)."""
        if self.type == "histogram":
            return tuple(f"{self.name}_{part}" for part in ("bucket", "sum", "count"))
        return (self.series,)


INFLIGHT = Metric("pdwatch_inflight_requests", "gauge", LEG_GROUP)
STUCK = Metric("pdwatch_stuck_requests", "gauge", LEG_GROUP)
OLDEST_AGE = Metric("pdwatch_oldest_stage_age_seconds", "gauge", LEG_GROUP)
THRESHOLD = Metric("pdwatch_stuck_threshold_seconds", "gauge", (L_CLUSTER, L_ROLE, L_STAGE))
STAGE_DURATION = Metric("pdwatch_stage_duration_seconds", "histogram", (L_CLUSTER, L_ROLE, L_STAGE))
FINISHED = Metric("pdwatch_requests_finished", "counter", (*INSTANCE_KEY, L_OUTCOME))
STUCK_DETECTED = Metric("pdwatch_stuck_detected", "counter", (L_CLUSTER, L_ROLE, L_STAGE))
STUCK_INFO = Metric("pdwatch_stuck_request_info", "gauge", (*LEG_GROUP, L_TRACE_ID, L_RID, L_REASON))
INSTANCE_UP = Metric("pdwatch_instance_up", "gauge", INSTANCE_KEY)
INSTANCE_START = Metric("pdwatch_instance_start_time_seconds", "gauge", INSTANCE_KEY)
INSTANCE_RESTARTS = Metric("pdwatch_instance_restarts", "counter", INSTANCE_KEY)
LOOP_STALLED = Metric("pdwatch_engine_loop_stalled", "gauge", INSTANCE_KEY)
GPU_UTILIZATION = Metric("pdwatch_gpu_utilization_ratio", "gauge", GPU_KEY)
GPU_POWER = Metric("pdwatch_gpu_power_watts", "gauge", GPU_KEY)
GPU_POWER_LIMIT = Metric("pdwatch_gpu_power_limit_watts", "gauge", GPU_KEY)
GPU_MEMORY_USED = Metric("pdwatch_gpu_memory_used_bytes", "gauge", GPU_KEY)
GPU_TELEMETRY_UP = Metric("pdwatch_gpu_telemetry_up", "gauge", ())
SUSPECTED_FAILURE = Metric("pdwatch_suspected_failure", "gauge", (L_CLUSTER, L_FAMILY))
SPANS_RECEIVED = Metric("pdwatch_spans_received", "counter", ())
SPANS_REJECTED = Metric("pdwatch_spans_rejected", "counter", (L_REASON,))
TRACKED_LEGS = Metric("pdwatch_tracked_legs", "gauge", ())
CLUSTER_FLOWING = Metric("pdwatch_cluster_flowing", "gauge", (L_CLUSTER,))
STUCK_EVIDENCE = Metric("pdwatch_stuck_evidence_requests", "gauge", (*LEG_GROUP, L_REASON))

# Every metric section 6 requires, in its order.
REQUIRED_METRICS = (
    INFLIGHT, STUCK, OLDEST_AGE, THRESHOLD, STAGE_DURATION, FINISHED, STUCK_DETECTED, STUCK_INFO, INSTANCE_UP,
    INSTANCE_START, INSTANCE_RESTARTS, LOOP_STALLED, GPU_UTILIZATION, GPU_POWER, GPU_POWER_LIMIT,
    GPU_MEMORY_USED, GPU_TELEMETRY_UP, SUSPECTED_FAILURE, SPANS_RECEIVED, SPANS_REJECTED, TRACKED_LEGS,
    CLUSTER_FLOWING, STUCK_EVIDENCE,
)

# ---- alert names (section 9) ------------------------------------------------------------------
ALERT_STUCK_WHILE_OTHERS_FLOW = "PDRequestStuckWhileOthersFlow"
ALERT_TOTAL_WEDGE = "PDTotalWedge"
ALERT_TRANSFER_WEDGE = "PDTransferWedgeSuspected"
ALERT_BOOTSTRAP_WEDGE = "PDBootstrapWedgeSuspected"
ALERT_COLLECTIVE_DESYNC = "PDCollectiveDesyncSuspected"
ALERT_QUEUE_STARVATION = "PDQueueStarvation"
ALERT_RESTART_SKEW = "PDRestartSkew"
ALERT_ENGINE_SILENT = "PDEngineSilent"
ALERT_TELEMETRY_MISSING = "PDWatchTelemetryMissing"
ALERT_NAMES = (
    ALERT_STUCK_WHILE_OTHERS_FLOW, ALERT_TOTAL_WEDGE, ALERT_TRANSFER_WEDGE, ALERT_BOOTSTRAP_WEDGE,
    ALERT_COLLECTIVE_DESYNC, ALERT_QUEUE_STARVATION, ALERT_RESTART_SKEW, ALERT_ENGINE_SILENT,
    ALERT_TELEMETRY_MISSING,
)

# ---- the HTTP interface (section 7) -----------------------------------------------------------
PATH_INGEST = "/v1/traces"
PATH_METRICS = "/metrics"
PATH_STUCK = "/api/v1/stuck"
PATH_REQUEST = "/api/v1/requests/{trace_id}"
PATH_DIAGNOSIS = "/api/v1/diagnosis"
PATH_HEALTH = "/healthz"
STUCK_FIELDS = ("trace_id", "rid", "bootstrap_room", "cluster", "role", "stage", "pd_instance", "peer",
                "stage_age_s", "threshold_s", "reason")
DIAGNOSIS_FIELDS = ("family", "confidence", "evidence", "action")

# ---- settings (section 11) --------------------------------------------------------------------
ENV_PREFIX = "PDWATCH_"
ENV_HOST, ENV_PORT, ENV_TOKEN = "PDWATCH_HOST", "PDWATCH_PORT", "PDWATCH_TOKEN"
ENV_FLOW_WINDOW = "PDWATCH_FLOW_WINDOW_S"
ENV_FORWARD = "PDWATCH_FORWARD_OTLP_ENDPOINT"
ENV_NVML, ENV_GPU_INTERVAL = "PDWATCH_NVML", "PDWATCH_GPU_INTERVAL_S"
ENV_MAX_BODY = "PDWATCH_MAX_BODY_BYTES"
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 4318
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


def floor_env(stage: str) -> str:
    return f"PDWATCH_FLOOR_{stage.upper()}_S"


SIDECAR_ENV = (ENV_HOST, ENV_PORT, ENV_TOKEN, *(floor_env(s) for s in ALL_STAGES), ENV_FLOW_WINDOW, ENV_FORWARD,
               ENV_NVML, ENV_GPU_INTERVAL, ENV_MAX_BODY)
# Engine side.
ENV_HEARTBEAT, ENV_INVENTORY_MAX = "PDWATCH_HEARTBEAT_S", "PDWATCH_INVENTORY_MAX"
ENV_CLUSTER, ENV_INSTANCE = "PDWATCH_CLUSTER", "PDWATCH_INSTANCE"
ENV_OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
ENGINE_ENV = (ENV_HEARTBEAT, ENV_INVENTORY_MAX, ENV_CLUSTER, ENV_INSTANCE, ENV_OTLP_ENDPOINT)
# Client commands (`pdwatch diagnose`, `trace`, `report`: pdwatch/settings.py), beside ENV_TOKEN.
# The sidecar's address as engines and clients reach it by default (written nowhere else).
DEFAULT_SIDECAR_URL = f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"
ENV_SIDECAR, ENV_PROMETHEUS = "PDWATCH_SIDECAR", "PDWATCH_PROMETHEUS"
ENV_PROMETHEUS_HEADERS, ENV_TIMEOUT = "PDWATCH_PROMETHEUS_HEADERS", "PDWATCH_TIMEOUT_S"
ENV_TRACE_URL = "PDWATCH_TRACE_URL"
CLIENT_ENV = (ENV_SIDECAR, ENV_TOKEN, ENV_PROMETHEUS, ENV_PROMETHEUS_HEADERS, ENV_TIMEOUT, ENV_TRACE_URL)
DISTRIBUTION = "pdwatch"


def package_version() -> str:
    """The installed distribution's version: pyproject.toml is its one source."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:  # a source tree run without installing it
        return "0+unknown"


# ---- identity (section 2) ---------------------------------------------------------------------

def room_trace_id(bootstrap_room: int) -> int:
    """Trace id both legs derive from a shared bootstrap room (section 2)."""
    digest = hashlib.sha256(f"pdwatch:{int(bootstrap_room)}".encode("ascii")).digest()
    return int.from_bytes(digest[:16], "big")


def parse_traceparent(value: str | None) -> tuple[int, int] | None:
    """(trace_id, parent span_id) from a W3C traceparent, or None if unusable."""
    if not value:
        return None
    parts = value.strip().split("-")
    if len(parts) < 4 or len(parts[0]) != 2 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    if parts[0] == "ff":
        return None
    try:
        trace_id = int(parts[1], 16)
        span_id = int(parts[2], 16)
    except ValueError:
        return None
    if trace_id == 0 or span_id == 0:
        return None
    return trace_id, span_id


def format_traceparent(trace_id: int, span_id: int, sampled: bool = True) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"
