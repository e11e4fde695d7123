"""Names fixed by the telemetry contract (docs/contract.md), shared by every part.

Engine side and sidecar import these instead of spelling strings twice, so a
typo cannot split the producer from the consumer.
"""

from __future__ import annotations

import hashlib

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

# Default stuck floors in seconds (section 5).
DEFAULT_FLOORS_S = {"bootstrap": 30.0, "queued": 60.0, "prefill": 60.0, "transfer": 15.0, "decode": 30.0}
DEFAULT_FLOW_WINDOW_S = 60.0
DEFAULT_HEARTBEAT_S = 2.0
DEFAULT_INVENTORY_MAX = 2048
# An instance is down after this many heartbeat intervals without one.
DOWN_AFTER_INTERVALS = 3

# Span names.
SPAN_LEG = "pd.request"
SPAN_HEARTBEAT = "pd.heartbeat"
SPAN_STUCK = "pd.stuck"
STAGE_SPAN_PREFIX = "pd."  # pd.bootstrap, pd.queued, ...


def stage_span_name(stage: str) -> str:
    return STAGE_SPAN_PREFIX + stage


# Resource attributes (section 3).
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

# Span attributes (section 4).
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
# v1.1: an engine's own probe request (warm-up, health check), never "others flowing".
A_PROBE = "pd.probe"

# Heartbeat attributes (section 4).
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
# pdwatch's additions to the inventory (parallel lists too), so a leg that
# never finishes can still be named by room and peer.
H_OPEN_ROOMS = "pd.open.bootstrap_rooms"  # -1 when the leg has no room
H_OPEN_PEERS = "pd.open.peers"  # "" when unknown
# When each listed leg's latest token came (0 before its first), so a sidecar
# that starts late can age a silent decode from its last token.
H_OPEN_LAST_TOKEN = "pd.open.last_token_unix_nano"
# v1.1 lists: the prompt length (-1 when unknown) and whether the leg is a probe.
H_OPEN_PROMPT_TOKENS = "pd.open.prompt_tokens"
H_OPEN_PROBES = "pd.open.probes"

# Attributes of the sidecar's pd.stuck span (section 10).
A_INSTANCE = "pd.instance"
A_FAMILY = "pdwatch.family"


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
