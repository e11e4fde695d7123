"""Every name the telemetry contract fixes (docs/contract.md), and pdwatch's own beside them,
at the bottom of the tree.

The recorder, the SGLang plugin, the sidecar, the alert generator, the
dashboards, the testbed, the docs tables and the tests import these instead of
spelling a string twice, so a typo cannot split a producer from its consumer:
each metric family (name, type, labels, help), label, attribute, environment
variable and alert name is written here once, and tests/test_names.py fails on
a `pdwatch_` metric or `PDWATCH_` variable spelt anywhere else. This module
imports nothing of pdwatch's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal, get_args

CONTRACT_VERSION = "1.2"

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
REASON_OVERTAKEN = "overtaken"  # v1.2
EVIDENCE_REASONS = (REASON_PEER_GONE, REASON_LOOP_FROZEN, REASON_ENGINE_ERROR, REASON_OVERTAKEN)
STUCK_REASONS = (REASON_THRESHOLD, *EVIDENCE_REASONS)

# Failure families (section 8), and pdwatch's own beside them (docs/contract.md).
CONTRACT_FAMILIES = ("transfer_wedge", "bootstrap_wedge", "collective_desync", "queue_starvation", "total_wedge",
                     "restart_skew", "engine_silent")
# kv_starvation: decode legs waiting for KV memory on a decode whose KV pool is full while it serves
# others (queue_starvation's decode case, told apart by the engine's KV usage).
ADDED_FAMILIES = ("kv_starvation",)
FAMILIES = (*CONTRACT_FAMILIES, *ADDED_FAMILIES)

# Defaults (sections 4, 5).
DEFAULT_FLOORS_S = {"bootstrap": 30.0, "queued": 60.0, "prefill": 60.0, "transfer": 15.0, "decode": 30.0}
DEFAULT_FLOW_WINDOW_S = 60.0
# v1.2, section 5: a down instance is forgotten, its legs ending lost, after this long.
DEFAULT_DOWN_FORGET_S = 600.0
# An instance's state (section 5, v1.2): heartbeating; silent without a final heartbeat; left in order.
STATE_UP, STATE_DOWN, STATE_DEPARTED = "up", "down", "departed"
INSTANCE_STATES = (STATE_UP, STATE_DOWN, STATE_DEPARTED)
# pd.plugin.state (section 4, v1.2): every hook installed; some refused; the engine runs unobserved.
PLUGIN_ACTIVE, PLUGIN_PARTIAL, PLUGIN_INACTIVE = "active", "partial", "inactive"
PLUGIN_STATES = (PLUGIN_ACTIVE, PLUGIN_PARTIAL, PLUGIN_INACTIVE)
# pdwatch's: pdwatch_engine_info's plugin_state for an instance none of whose ranks says (an engine
# side from before v1.2, or another producer); no alert reads it as inactive.
PLUGIN_UNKNOWN = "unknown"
# /healthz answers 503 once the judge has not finished a pass for this many evaluate intervals (v1.2).
JUDGE_STALLED_INTERVALS = 3
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
# overtaken (v1.2): at least OVERTAKEN_K later legs with as many prompt tokens passed the leg's stage while it
# waited longer than max(OVERTAKEN_INTERVALS heartbeats, OVERTAKEN_M x the longest of those passages).
DEFAULT_OVERTAKEN_K = 5
DEFAULT_OVERTAKEN_M = 10.0
OVERTAKEN_INTERVALS = 2
# pdwatch's: the latest passages the sidecar remembers per engine process and stage, for that rule (K <= it).
OVERTAKEN_PASSAGES_KEPT = 64
# pd.schedule_policy's value for an instance that takes legs from its waiting queue in arrival order.
SCHEDULE_FCFS = "fcfs"
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
R_SCHEDULE_POLICY = "pd.schedule_policy"  # v1.2, optional: fcfs, lpm, priority, ... as the engine names it
# OpenTelemetry's semantic conventions for a distribution of instrumentation: the recorder names itself
# (pdwatch and its version) so the sidecar knows which plugin version an engine runs.
R_DISTRO_NAME = "telemetry.distro.name"
R_DISTRO_VERSION = "telemetry.distro.version"

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
# v1.2: the process's last heartbeat, sent as it leaves in order; its inventory lists what is still open.
H_FINAL = "pd.heartbeat.final"
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
# v1.2: the engine side's own health (a sidecar works without them).
# The longest the engine's loop stands still while idle, seconds (0: it spins), as the engine knows
# it: the sidecar then judges an idle loop that stops without first watching it turn while idle.
H_LOOP_IDLE_TURN = "pd.loop.idle_turn_s"
H_PLUGIN_STATE = "pd.plugin.state"  # one of PLUGIN_STATES
H_PLUGIN_REFUSED = "pd.plugin.refused"  # string[]: "Class.method: why" per hook target refused
H_SPANS_DROPPED = "pd.recorder.spans_dropped"  # monotonic: spans the engine side dropped
H_EXPORTS_FAILED = "pd.recorder.exports_failed"  # monotonic: spans in exports that were not delivered
H_HOOK_ERRORS = "pd.recorder.hook_errors"  # monotonic: exceptions caught in hooks
H_RECORDER_HEALTH = (H_SPANS_DROPPED, H_EXPORTS_FAILED, H_HOOK_ERRORS)

# pdwatch's own heartbeat attributes beside the contract's (its health, engine counters).
H_RECORDER_PREFIX = "pdwatch.recorder."
H_ENGINE_PREFIX = "pd.engine."
# The share (0..1) of the engine's KV cache token pool in use at the heartbeat: held by running
# requests, not merely cached for reuse. Sent by engines that know it (the SGLang plugin).
H_KV_USED = "pd.engine.kv_used_ratio"
H_RECORDER_HEALTH_PREFIX = "pd.recorder."  # v1.2: the contract's recorder counters above
H_DROPPED = "pdwatch.recorder.dropped"  # records the hot-path buffer had no room for
H_WORKER_ERRORS = "pdwatch.recorder.worker_errors"
H_WORKER_CPU = "pdwatch.recorder.worker_cpu_s"  # the recorder thread's CPU seconds so far
# The export queue's own drops, without the hot-path buffer's (pd.recorder.spans_dropped sums both).
# Before v1.2 this was pdwatch.recorder.spans_dropped, sent with pdwatch.recorder.hook_errors and
# .export_failed_spans: those two are the contract's pd.recorder.* names now, and no longer sent.
H_QUEUE_DROPPED = "pdwatch.recorder.queue_dropped"
H_LEGS_EVICTED = "pdwatch.recorder.legs_evicted"
# pd.loop.idle_turn_s's name before v1.2: the sidecar still reads it from engines that send it.
H_LOOP_IDLE_TURN_V11 = "pdwatch.loop.idle_turn_s"
# pdwatch's addition on the leg span pd.request: the last error the engine recorded for the leg without
# ending it (pd.open.errors while it was open), so that a leg that ends ok still says so in its trace.
A_LEG_ERROR = "pdwatch.error"

# ---- the sidecar's pd.stuck span (section 10) ------------------------------------------------
A_INSTANCE = "pd.instance"
A_FAMILY = "pdwatch.family"
A_REASON = "pdwatch.reason"  # v1.1

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
ENV_DOWN_FORGET = "PDWATCH_DOWN_FORGET_S"  # v1.2, section 5
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 4318
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


def floor_env(stage: str) -> str:
    return f"{ENV_PREFIX}FLOOR_{stage.upper()}_S"


SIDECAR_ENV = (ENV_HOST, ENV_PORT, ENV_TOKEN, *(floor_env(s) for s in ALL_STAGES), ENV_FLOW_WINDOW, ENV_FORWARD,
               ENV_NVML, ENV_GPU_INTERVAL, ENV_MAX_BODY, ENV_DOWN_FORGET)
# The sidecar's other settings, pdwatch's own (docs/sidecar.md): with SIDECAR_ENV, one variable per
# field of sidecar/settings.py, each field reading its own (validation_alias).
ENV_GPU_MAP = "PDWATCH_GPU_MAP"
ENV_MAX_OPEN_LEGS, ENV_MAX_CLOSED_LEGS = "PDWATCH_MAX_OPEN_LEGS", "PDWATCH_MAX_CLOSED_LEGS"
ENV_MAX_INSTANCES, ENV_INSTANCE_TTL = "PDWATCH_MAX_INSTANCES", "PDWATCH_INSTANCE_TTL_S"
ENV_MAX_RSS = "PDWATCH_MAX_RSS_BYTES"
ENV_EVALUATE_INTERVAL = "PDWATCH_EVALUATE_INTERVAL_S"
ENV_CAPTURE, ENV_CAPTURE_EVERY = "PDWATCH_CAPTURE", "PDWATCH_CAPTURE_EVERY_S"
ENV_CAPTURE_TIMEOUT, ENV_CAPTURE_HOSTS = "PDWATCH_CAPTURE_TIMEOUT_S", "PDWATCH_CAPTURE_HOSTS"
ENV_LOG_LEVEL = "PDWATCH_LOG_LEVEL"
# What the forwarder sends with each request to the trace store, and the CA it trusts there.
ENV_FORWARD_HEADERS, ENV_FORWARD_CERTIFICATE = "PDWATCH_FORWARD_OTLP_HEADERS", "PDWATCH_FORWARD_OTLP_CERTIFICATE"
# The overtaken rule's K and M (contract section 5b, v1.2, gives their defaults, not their variables).
ENV_OVERTAKEN_K, ENV_OVERTAKEN_M = "PDWATCH_OVERTAKEN_K", "PDWATCH_OVERTAKEN_M"
SIDECAR_OWN_ENV = (ENV_GPU_MAP, ENV_MAX_OPEN_LEGS, ENV_MAX_CLOSED_LEGS, ENV_MAX_INSTANCES, ENV_INSTANCE_TTL,
                   ENV_MAX_RSS, ENV_EVALUATE_INTERVAL, ENV_CAPTURE, ENV_CAPTURE_EVERY, ENV_CAPTURE_TIMEOUT,
                   ENV_CAPTURE_HOSTS, ENV_LOG_LEVEL, ENV_OVERTAKEN_K, ENV_OVERTAKEN_M, ENV_FORWARD_HEADERS,
                   ENV_FORWARD_CERTIFICATE)
# Engine side.
ENV_HEARTBEAT, ENV_INVENTORY_MAX = "PDWATCH_HEARTBEAT_S", "PDWATCH_INVENTORY_MAX"
ENV_CLUSTER, ENV_INSTANCE = "PDWATCH_CLUSTER", "PDWATCH_INSTANCE"
ENV_OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
ENGINE_ENV = (ENV_HEARTBEAT, ENV_INVENTORY_MAX, ENV_CLUSTER, ENV_INSTANCE, ENV_OTLP_ENDPOINT)
# The SGLang plugin's own: its switch, and GPU UUIDs for a process that cannot read its own.
ENV_SGLANG, ENV_GPU_UUIDS = "PDWATCH_SGLANG", "PDWATCH_GPU_UUIDS"
ENV_VLLM = "PDWATCH_VLLM"  # the vLLM adapter records only where this is 1 (engine_patches/vllm)
# The Python of the environment vLLM is installed in, for the live vLLM testbed (default: build/vllm's).
ENV_VLLM_PYTHON = "PDWATCH_VLLM_PYTHON"
ENV_TESTBED_KEEP = "PDWATCH_TESTBED_KEEP"  # 1: a live testbed stack keeps its folder (logs, faults) when it stops
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
# The testbed's, for the processes it starts: the NVML stub's state file, the SGLang servers'
# state folder, the emulated engines' random seed.
ENV_NVML_STUB_STATE = "PDWATCH_NVML_STUB_STATE"
ENV_TESTBED_STATE_DIR, ENV_TESTBED_SEED = "PDWATCH_TESTBED_STATE_DIR", "PDWATCH_TESTBED_SEED"

# ---- metric labels (section 6) ----------------------------------------------------------------
# v1.2: `pd_cluster`, not `cluster` (an external label of that name carries the Kubernetes cluster).
L_CLUSTER, L_ROLE, L_STAGE, L_INSTANCE = "pd_cluster", "role", "stage", "pd_instance"
L_OUTCOME, L_FAMILY, L_GPU, L_UUID, L_REASON = "outcome", "family", "gpu", "uuid", "reason"
L_TRACE_ID, L_RID = "trace_id", "rid"
L_STATE = "state"  # v1.2: pdwatch_instance_state's
# v1.2: pdwatch_engine_info's.
L_ENGINE, L_ENGINE_VERSION = "engine", "engine_version"
L_PLUGIN_VERSION, L_PLUGIN_STATE = "plugin_version", "plugin_state"
# pdwatch's additions: the contrast's, the GPU detail's, the forwarder's and the stack capture's.
L_ATTRIBUTE, L_VALUE, L_LEGS = "attribute", "value", "legs"
L_QUERY, L_ERROR, L_NAME, L_JOINED_BY = "query", "error", "name", "joined_by"
L_KIND, L_RESULT = "kind", "result"
# Labels Prometheus itself adds: its scrape target's, and a histogram bucket's bound.
L_JOB, L_TARGET, L_LE = "job", "instance", "le"
# Prometheus's own per-target series, and the jobs it scrapes sidecars under: deploy/prometheus/ names its
# job pdwatch; the ServiceMonitor of deploy/kubernetes/ sets no jobLabel, so the operator names the job after
# the Service it selects, pdwatch-node. PDWatchSidecarDown and the self dashboard read `up` of these.
SCRAPE_UP = "up"
SIDECAR_JOBS = ("pdwatch", "pdwatch-node")
SIDECAR_UP = f'{SCRAPE_UP}{{{L_JOB}=~"{"|".join(SIDECAR_JOBS)}"}}'
# The alert rules' own label: how urgent a page is (alerts/alertmanager.example.yml routes on it).
L_SEVERITY = "severity"
LEG_GROUP = (L_CLUSTER, L_ROLE, L_STAGE, L_INSTANCE)
INSTANCE_KEY = (L_CLUSTER, L_ROLE, L_INSTANCE)
GPU_KEY = (L_GPU, L_UUID, L_CLUSTER, L_ROLE, L_INSTANCE)

# ---- metrics (section 6, then pdwatch's additions) ---------------------------------------------
MetricType = Literal["counter", "gauge", "histogram"]
METRIC_PREFIX = "pdwatch_"


@dataclass(frozen=True)
class Metric:
    """One metric family as the sidecar exposes it: the collectors build it from this, and the
    alert rules, dashboards and Prometheus readers name it and its labels through it."""

    name: str  # as exposed; a counter's without its _total suffix
    type: MetricType
    labels: tuple[str, ...]
    help: str

    def __post_init__(self) -> None:
        if not self.name.startswith(METRIC_PREFIX) or self.type not in get_args(MetricType):
            raise ValueError(f"not a pdwatch metric: {self.name!r} of type {self.type!r}")
        if self.type == "counter" and self.name.endswith("_total"):
            raise ValueError(f"counter {self.name!r}: name it without _total")

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

    def sample(self, part: str) -> str:
        """A histogram's bucket, sum or count series."""
        if self.type != "histogram" or part not in ("bucket", "sum", "count"):
            raise ValueError(f"{self.name} has no {part} series")
        return f"{self.name}_{part}"

    def by(self, *labels: str) -> str:
        """The label list of a PromQL `by (...)` over this metric; a label it does not carry raises,
        so a misspelt name fails where the query is written instead of grouping into one empty series."""
        known = (*self.labels, L_JOB, L_TARGET, *((L_LE,) if self.type == "histogram" else ()))
        wrong = [label for label in labels if label not in known]
        if wrong:
            raise ValueError(f"{self.name} has no label {', '.join(wrong)}")
        return ", ".join(labels)


INFLIGHT = Metric("pdwatch_inflight_requests", "gauge", LEG_GROUP,
                  "Open legs per stage, as the engines' latest heartbeats count them.")
STUCK = Metric("pdwatch_stuck_requests", "gauge", LEG_GROUP,
               "Open legs stuck: past their stage's threshold, or on evidence (contract section 5b).")
OLDEST_AGE = Metric("pdwatch_oldest_stage_age_seconds", "gauge", LEG_GROUP,
                    "Age of the oldest open leg in each stage (decode: since its last new token).")
THRESHOLD = Metric("pdwatch_stuck_threshold_seconds", "gauge", (L_CLUSTER, L_ROLE, L_STAGE),
                   f"Current stuck threshold: max(floor, {P99_FACTOR:g} x p99 of recent durations).")
STAGE_DURATION = Metric("pdwatch_stage_duration_seconds", "histogram", (L_CLUSTER, L_ROLE, L_STAGE),
                        "Time legs spent in each stage, from the engines' finished stage spans.")
FINISHED = Metric("pdwatch_requests_finished", "counter", (*INSTANCE_KEY, L_OUTCOME), "Legs finished, by outcome.")
STUCK_DETECTED = Metric("pdwatch_stuck_detected", "counter", (L_CLUSTER, L_ROLE, L_STAGE),
                        "Legs found stuck, each counted once.")
STUCK_INFO = Metric("pdwatch_stuck_request_info", "gauge", (*LEG_GROUP, L_TRACE_ID, L_RID, L_REASON),
                    "Stage age in seconds of each of the oldest stuck legs, named by trace id, with the reason it "
                    "is stuck.")
INSTANCE_UP = Metric("pdwatch_instance_up", "gauge", INSTANCE_KEY, "1 while every rank of the instance heartbeats.")
INSTANCE_START = Metric("pdwatch_instance_start_time_seconds", "gauge", INSTANCE_KEY,
                        "Start time of the instance's current process (rank 0), Unix seconds.")
INSTANCE_RESTARTS = Metric("pdwatch_instance_restarts", "counter", INSTANCE_KEY,
                           f"New processes seen under the same {R_INSTANCE}.")
LOOP_STALLED = Metric("pdwatch_engine_loop_stalled", "gauge", INSTANCE_KEY,
                      "1 when a rank heartbeats but its scheduler loop counter stopped moving.")
GPU_UTILIZATION = Metric("pdwatch_gpu_utilization_ratio", "gauge", GPU_KEY,
                         "Fraction of the last sample period in which a kernel ran on the GPU (NVML utilization).")
GPU_POWER = Metric("pdwatch_gpu_power_watts", "gauge", GPU_KEY, "GPU power draw in watts.")
GPU_POWER_LIMIT = Metric("pdwatch_gpu_power_limit_watts", "gauge", GPU_KEY, "GPU enforced power limit in watts.")
GPU_MEMORY_USED = Metric("pdwatch_gpu_memory_used_bytes", "gauge", GPU_KEY, "GPU memory in use, in bytes.")
GPU_TELEMETRY_UP = Metric("pdwatch_gpu_telemetry_up", "gauge", (),
                          "1 while NVML answers and GPUs are sampled, else 0 (the reason is in /healthz and the "
                          "logs).")
SUSPECTED_FAILURE = Metric("pdwatch_suspected_failure", "gauge", (L_CLUSTER, L_FAMILY),
                           "1 when the diagnosis suspects this failure family in the cluster.")
SPANS_RECEIVED = Metric("pdwatch_spans_received", "counter", (), f"Spans received on {PATH_INGEST}.")
SPANS_REJECTED = Metric("pdwatch_spans_rejected", "counter", (L_REASON,), "Spans that could not be used, by reason.")
TRACKED_LEGS = Metric("pdwatch_tracked_legs", "gauge", (), "Open legs the sidecar tracks.")
INSTANCE_STATE = Metric("pdwatch_instance_state", "gauge", (*INSTANCE_KEY, L_STATE),
                        f"1 for the instance's state, 0 for the others: {STATE_UP} (every rank heartbeats), "
                        f"{STATE_DOWN} (silent without a final heartbeat: dead or frozen), {STATE_DEPARTED} (its "
                        "last heartbeat was final: it left in order).")
OPEN_AT_SILENCE = Metric("pdwatch_instance_open_at_silence", "gauge", INSTANCE_KEY,
                         "Legs a down instance listed in its last heartbeat (clients wait on them); 0 while up or "
                         "departed.")
ENGINE_SPANS_DROPPED = Metric("pdwatch_engine_spans_dropped", "counter", INSTANCE_KEY,
                              f"Spans the instance's engine side dropped ({H_SPANS_DROPPED}), summed over its "
                              "current ranks.")
ENGINE_EXPORTS_FAILED = Metric("pdwatch_engine_exports_failed", "counter", INSTANCE_KEY,
                               f"Spans in exports the instance's engine side could not deliver ({H_EXPORTS_FAILED}), "
                               "summed over its current ranks.")
ENGINE_HOOK_ERRORS = Metric("pdwatch_engine_hook_errors", "counter", INSTANCE_KEY,
                            f"Exceptions caught in the instance's hooks ({H_HOOK_ERRORS}), summed over its current "
                            "ranks.")
ENGINE_INFO = Metric("pdwatch_engine_info", "gauge",
                     (*INSTANCE_KEY, L_ENGINE, L_ENGINE_VERSION, L_PLUGIN_VERSION, L_PLUGIN_STATE),
                     f"1 per instance: its engine ({R_SERVICE_NAME}) and version, the pdwatch plugin's version and "
                     f"state ({', '.join(PLUGIN_STATES)}; {PLUGIN_UNKNOWN} when no rank says).")
EVALUATION_AGE = Metric("pdwatch_evaluation_age_seconds", "gauge", (),
                        "Seconds since the judge last finished a pass, read at scrape time.")
CLUSTER_FLOWING = Metric("pdwatch_cluster_flowing", "gauge", (L_CLUSTER,),
                         "1 when some leg of the cluster finished ok within the flow window.")
STUCK_EVIDENCE = Metric("pdwatch_stuck_evidence_requests", "gauge", (*LEG_GROUP, L_REASON),
                        f"The stuck legs that are stuck on evidence, by reason: {', '.join(EVIDENCE_REASONS)}.")

# Every metric section 6 requires, in its order.
REQUIRED_METRICS = (
    INFLIGHT, STUCK, OLDEST_AGE, THRESHOLD, STAGE_DURATION, FINISHED, STUCK_DETECTED, STUCK_INFO, INSTANCE_UP,
    INSTANCE_START, INSTANCE_RESTARTS, LOOP_STALLED, GPU_UTILIZATION, GPU_POWER, GPU_POWER_LIMIT,
    GPU_MEMORY_USED, GPU_TELEMETRY_UP, SUSPECTED_FAILURE, SPANS_RECEIVED, SPANS_REJECTED, TRACKED_LEGS,
    CLUSTER_FLOWING, STUCK_EVIDENCE, INSTANCE_STATE, OPEN_AT_SILENCE, ENGINE_SPANS_DROPPED, ENGINE_EXPORTS_FAILED,
    ENGINE_HOOK_ERRORS, ENGINE_INFO, EVALUATION_AGE,
)

# pdwatch's additions (docs/sidecar.md): what the judge found beyond section 6 ...
STUCK_CONTRAST = Metric("pdwatch_stuck_contrast_ratio", "gauge", (L_CLUSTER, L_ATTRIBUTE, L_VALUE, L_LEGS),
                        "What sets a cluster's stuck legs apart: for each attribute that separates them clearly from "
                        "the legs that finished ok in the flow window, the share of stuck (legs=\"stuck\") and of "
                        "flowing legs that have it.")
PROBES_FINISHED = Metric("pdwatch_probe_requests_finished", "counter", FINISHED.labels,
                         "Engine probe legs (warm-ups, health checks) finished, by outcome; counted apart from "
                         f"{FINISHED.series} and never as flow.")
LOOP_FROZEN = Metric("pdwatch_engine_loop_frozen", "gauge", INSTANCE_KEY,
                     "1 while a rank heartbeats but its loop stands still past the loop rule: with legs open "
                     f"(contract section 5b: its legs are stuck on evidence, {REASON_LOOP_FROZEN}), or idle when its "
                     "loop is known to turn while idle.")
KV_USED = Metric("pdwatch_engine_kv_used_ratio", "gauge", INSTANCE_KEY,
                 f"Share (0..1) of the instance's KV cache token pool in use, as its engine last said ({H_KV_USED}); "
                 "absent for engines that do not say.")
HEARTBEAT_AGE = Metric("pdwatch_instance_heartbeat_age_seconds", "gauge", INSTANCE_KEY,
                       "Seconds since the instance's stalest rank last heartbeated.")
DIAGNOSIS_CONFIDENCE = Metric("pdwatch_diagnosis_confidence", "gauge", (L_CLUSTER, L_FAMILY),
                              "Confidence (0..1) of each failure family the diagnosis considered.")
# ... the sidecar's own ingest and tracking ...
SPANS_FOREIGN = Metric("pdwatch_spans_foreign", "counter", (),
                       "Spans that are not pdwatch's (another instrumentation's, on the same endpoint): neither "
                       "applied nor rejected; forwarded when forwarding is on.")
SPANS_DUPLICATE = Metric("pdwatch_spans_duplicate", "counter", (),
                         "Spans and heartbeats received again or late; applied once only.")
HEARTBEATS_RECEIVED = Metric("pdwatch_heartbeats_received", "counter", (), "Heartbeats applied.")
TRACKED_INSTANCES = Metric("pdwatch_tracked_instances", "gauge", (), "Engine instances the sidecar tracks.")
GONE_PEERS = Metric("pdwatch_gone_peers", "gauge", (),
                    "Peer ids (KV agent names, bootstrap addresses) of ended processes the sidecar remembers for the "
                    f"{REASON_PEER_GONE} rule.")
LEGS_EVICTED = Metric("pdwatch_legs_evicted", "counter", (L_REASON,),
                      "Legs dropped from tracking: open_limit (new legs refused at the memory cap), closed_limit "
                      "(finished legs forgotten at the history cap), vanished (gone from their engine's inventory "
                      f"without a leg span), instance_gone (their instance sent nothing for {ENV_INSTANCE_TTL}).")
INSTANCES_EXPIRED = Metric("pdwatch_instances_expired", "counter", (),
                           f"Instances forgotten after sending nothing for {ENV_INSTANCE_TTL}.")
LABEL_SETS_REFUSED = Metric("pdwatch_label_sets_refused", "counter", (),
                            "Observations dropped because a metric reached its label-set cap.")
EVALUATION_TIMESTAMP = Metric("pdwatch_evaluation_timestamp_seconds", "gauge", (),
                              "When the judge made the evaluation this scrape shows, Unix seconds.")
INGEST_REFUSED = Metric("pdwatch_ingest_refused", "counter", (L_REASON,),
                        "OTLP requests refused before reading: busy (429, too many in flight) or memory (503, "
                        f"resident memory over {ENV_MAX_RSS}).")
INGEST_ERRORS = Metric("pdwatch_ingest_errors", "counter", (),
                       "OTLP requests answered 400 because applying their spans raised an unexpected error (a "
                       "pdwatch bug; the log has the traceback).")
RESIDENT_MEMORY = Metric("pdwatch_sidecar_resident_memory_bytes", "gauge", (),
                         "Resident memory of the sidecar process (VmRSS).")
MEMORY_LIMIT = Metric("pdwatch_sidecar_memory_limit_bytes", "gauge", (),
                      "Resident memory above which ingest is refused with 503; 0 = no limit.")
JUDGE_TICKS = Metric("pdwatch_judge_ticks", "counter", (), "Evaluations the judge made.")
JUDGE_ERRORS = Metric("pdwatch_judge_errors", "counter", (), "Judge ticks that raised (a pdwatch bug; see the log).")
JUDGE_TICK_SECONDS = Metric("pdwatch_judge_tick_seconds", "gauge", (), "How long the latest judge tick took.")
STACK_CAPTURES = Metric("pdwatch_stack_captures", "counter", (L_RESULT,),
                        "Stack captures of engine processes, by result: taken, failed, rate_limited, dropped (queue "
                        "full), not_local (no PID of this host).")
# ... its GPU sampler's detail ...
GPU_DEVICE_ERRORS = Metric("pdwatch_gpu_device_errors", "gauge", (*GPU_KEY, L_QUERY, L_ERROR),
                           "1 for each NVML query that failed on this GPU in the last pass, labelled with the query "
                           "and NVML's error.")
GPU_INFO = Metric("pdwatch_gpu_info", "gauge", (*GPU_KEY, L_NAME, L_JOINED_BY),
                  "1 per GPU; names the device and how its owner was found: uuid, pid, config, none, or "
                  "uuid/pid/config_last_known for a failing device that no longer says.")
GPU_LAST_SAMPLE = Metric("pdwatch_gpu_last_sample_timestamp_seconds", "gauge", (),
                         "Unix time of the last completed GPU sampling pass.")
# ... and its forwarder to a trace store (exposed only while forwarding is on).
FORWARD_SPANS = Metric("pdwatch_forward_spans", "counter", (L_KIND, L_RESULT),
                       "Spans forwarded to the trace store, by kind (lifecycle: the engines' spans as received, with "
                       f"foreign spans and without heartbeats; stuck: {SPAN_STUCK}) and result: sent, dropped (queue "
                       "full) or failed (refused, or retries ran out).")
FORWARD_QUEUE_DEPTH = Metric("pdwatch_forward_queue_depth", "gauge", (), "Spans waiting to be forwarded.")
FORWARD_QUEUE_CAPACITY = Metric("pdwatch_forward_queue_capacity_spans", "gauge", (),
                                "Most lifecycle spans the queue holds.")
FORWARD_RETRIES = Metric("pdwatch_forward_retries", "counter", (), "Retried POSTs to the trace store.")
FORWARD_REQUESTS = Metric("pdwatch_forward_requests", "counter", (), "POSTs the trace store accepted.")
FORWARD_METRICS = (FORWARD_SPANS, FORWARD_QUEUE_DEPTH, FORWARD_QUEUE_CAPACITY, FORWARD_RETRIES, FORWARD_REQUESTS)

ADDED_METRICS = (
    STUCK_CONTRAST, PROBES_FINISHED, LOOP_FROZEN, KV_USED, HEARTBEAT_AGE, DIAGNOSIS_CONFIDENCE, SPANS_FOREIGN, SPANS_DUPLICATE,
    HEARTBEATS_RECEIVED, TRACKED_INSTANCES, GONE_PEERS, LEGS_EVICTED, INSTANCES_EXPIRED, LABEL_SETS_REFUSED,
    EVALUATION_TIMESTAMP, INGEST_REFUSED, INGEST_ERRORS, RESIDENT_MEMORY, MEMORY_LIMIT, JUDGE_TICKS, JUDGE_ERRORS,
    JUDGE_TICK_SECONDS, STACK_CAPTURES, GPU_DEVICE_ERRORS, GPU_INFO, GPU_LAST_SAMPLE, *FORWARD_METRICS,
)
# Every metric family a sidecar can expose.
METRICS = (*REQUIRED_METRICS, *ADDED_METRICS)

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
# v1.2: pdwatch's own blind spots.
ALERT_ENGINE_TELEMETRY_LOSS = "PDWatchEngineTelemetryLoss"
ALERT_PLUGIN_INACTIVE = "PDWatchPluginInactive"
ALERT_JUDGE_STALLED = "PDWatchJudgeStalled"
ALERT_SIDECAR_DOWN = "PDWatchSidecarDown"
ALERT_NAMES = (
    ALERT_STUCK_WHILE_OTHERS_FLOW, ALERT_TOTAL_WEDGE, ALERT_TRANSFER_WEDGE, ALERT_BOOTSTRAP_WEDGE,
    ALERT_COLLECTIVE_DESYNC, ALERT_QUEUE_STARVATION, ALERT_RESTART_SKEW, ALERT_ENGINE_SILENT,
    ALERT_TELEMETRY_MISSING, ALERT_ENGINE_TELEMETRY_LOSS, ALERT_PLUGIN_INACTIVE, ALERT_JUDGE_STALLED,
    ALERT_SIDECAR_DOWN,
)


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
