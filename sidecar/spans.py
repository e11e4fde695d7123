"""From OTLP messages to the few facts the tracker uses.

Reads each resource once, each span's attributes once, and checks what the
contract requires; a span that cannot be used becomes a `Rejection` with a
reason from a fixed set (the label values of `pdwatch_spans_rejected_total`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from pdwatch import contract as c

# Every reason a span may be rejected for; a closed set keeps the label bounded.
REASONS = (
    "unknown_span",  # not a pdwatch span name
    "missing_attribute",  # a resource or span attribute the contract requires is absent
    "bad_value",  # an attribute of the wrong type or out of range
    "bad_id",  # trace or span id of the wrong length, or zero
    "instance_limit",  # more engine instances than the sidecar tracks
    "stale_incarnation",  # from a process that has since been replaced
)

STAGE_SPANS = {c.stage_span_name(s): s for s in c.ALL_STAGES}
# Ranks per engine instance (tensor parallel size); more is a malformed resource.
MAX_RANKS = 1024
ZERO16, ZERO8 = bytes(16), bytes(8)


class Rejection(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(slots=True)
class Source:
    """Who sent a batch of spans: one engine process (resource attributes, contract section 3)."""

    cluster: str
    pd_instance: str
    role: str
    incarnation: str  # service.instance.id
    tp_rank: int
    tp_size: int
    start_ns: int
    pid: int | None
    host: str
    gpu_uuids: tuple[str, ...]
    service: str
    version: str


@dataclass(slots=True)
class Heartbeat:
    """The parts of a pd.heartbeat span the tracker reads (stage and leg spans are read off the protobuf)."""

    start_ns: int
    end_ns: int
    attrs: dict


def any_value(v):
    kind = v.WhichOneof("value")
    if kind == "string_value":
        return v.string_value
    if kind == "int_value":
        return v.int_value
    if kind == "double_value":
        return v.double_value
    if kind == "bool_value":
        return v.bool_value
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if kind == "bytes_value":
        return v.bytes_value
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in v.kvlist_value.values}
    return None


_SCALARS = frozenset(("string_value", "int_value", "double_value", "bool_value"))


def attributes(kvs) -> dict:
    # The hot loop of ingest: scalars inline, only arrays and maps go through any_value.
    out = {}
    for kv in kvs:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = getattr(v, kind) if kind in _SCALARS else any_value(v)
    return out


def _str(attrs: dict, key: str, *, required: bool = True, default: str = "") -> str:
    value = attrs.get(key)
    if value is None or value == "":
        if required:
            raise Rejection("missing_attribute", f"missing attribute {key}")
        return default
    if not isinstance(value, str):
        raise Rejection("bad_value", f"attribute {key} must be a string")
    return value


def _int(attrs: dict, key: str, *, required: bool = False, default: int | None = None) -> int | None:
    value = attrs.get(key)
    if value is None:
        if required:
            raise Rejection("missing_attribute", f"missing attribute {key}")
        return default
    if not is_int(value):
        raise Rejection("bad_value", f"attribute {key} must be an integer")
    return value


def read_source(resource_attrs: dict) -> Source:
    role = _str(resource_attrs, c.R_ROLE)
    if role not in c.ROLES:
        raise Rejection("bad_value", f"resource {c.R_ROLE}={role!r} is not one of {', '.join(c.ROLES)}")
    uuids = resource_attrs.get(c.R_GPU_UUIDS) or ()
    if isinstance(uuids, str):
        uuids = (uuids,)
    if not isinstance(uuids, (list, tuple)):
        raise Rejection("bad_value", f"resource {c.R_GPU_UUIDS} must be a string or an array of strings")
    start_ns = _int(resource_attrs, c.R_START_NS, default=0)
    if start_ns < 0:
        raise Rejection("bad_value", f"resource {c.R_START_NS} is negative")
    tp_rank = _int(resource_attrs, c.R_TP_RANK, default=0)
    tp_size = _int(resource_attrs, c.R_TP_SIZE, default=1)
    # Each rank is a tracked process: a bound keeps one instance from growing without end.
    if not (0 <= tp_rank < MAX_RANKS and 1 <= tp_size <= MAX_RANKS):
        raise Rejection("bad_value", f"resource {c.R_TP_RANK}={tp_rank}, {c.R_TP_SIZE}={tp_size}: "
                                     f"ranks run 0..{MAX_RANKS - 1}")
    return Source(
        cluster=_str(resource_attrs, c.R_CLUSTER, required=False, default="default"),
        pd_instance=_str(resource_attrs, c.R_INSTANCE),
        role=role,
        incarnation=_str(resource_attrs, c.R_INSTANCE_ID),
        tp_rank=tp_rank,
        tp_size=tp_size,
        start_ns=start_ns,
        pid=_int(resource_attrs, c.R_PID),
        host=_str(resource_attrs, c.R_HOST, required=False),
        gpu_uuids=tuple(u for u in uuids[:MAX_RANKS] if isinstance(u, str)),
        service=_str(resource_attrs, c.R_SERVICE_NAME, required=False),
        version=_str(resource_attrs, c.R_ENGINE_VERSION, required=False),
    )


def room_of(span) -> int | None:
    """pd.bootstrap_room of a span, without decoding its other attributes."""
    for kv in span.attributes:
        if kv.key == c.A_ROOM:
            value = kv.value.int_value
            return value if kv.value.WhichOneof("value") == "int_value" else None
    return None


def check_ids(span) -> None:
    tid, sid, parent = span.trace_id, span.span_id, span.parent_span_id
    if len(tid) != 16 or tid == ZERO16:
        raise Rejection("bad_id", f"{span.name[:64]}: trace id must be 16 non-zero bytes")
    if len(sid) != 8 or sid == ZERO8:
        raise Rejection("bad_id", f"{span.name[:64]}: span id must be 8 non-zero bytes")
    if parent and len(parent) != 8:
        raise Rejection("bad_id", f"{span.name[:64]}: parent span id must be 8 bytes")


def ids_and_times(span) -> tuple[bytes, bytes, bytes, int, int]:
    """(trace id, span id, parent span id, start, end) of a span, as raw bytes and
    nanoseconds, after the checks the contract requires."""
    tid, sid, parent = span.trace_id, span.span_id, span.parent_span_id
    if len(tid) != 16 or tid == ZERO16 or len(sid) != 8 or sid == ZERO8 or (parent and len(parent) != 8):
        check_ids(span)  # raises with the precise reason
    start, end = span.start_time_unix_nano, span.end_time_unix_nano
    if end < start:
        raise Rejection("bad_value", f"{span.name[:64]}: ends before it starts")
    return tid, sid, parent, start, end


def read_heartbeat(span) -> Heartbeat:
    """A pd.heartbeat span, attributes decoded; any other name is not a pdwatch span."""
    if span.name != c.SPAN_HEARTBEAT:
        raise Rejection("unknown_span", f"span {span.name[:64]!r} is not a pdwatch span")
    _, _, _, start, end = ids_and_times(span)
    return Heartbeat(start_ns=start, end_ns=end, attrs=attributes(span.attributes))


def is_int(value) -> bool:
    """An integer value; a bool is not one, although Python makes it an int."""
    return isinstance(value, int) and not isinstance(value, bool)


def finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def iter_batches(request: ExportTraceServiceRequest):
    """Yield (source or Rejection, [span protos]) per resource."""
    for rs in request.resource_spans:
        spans = [span for ss in rs.scope_spans for span in ss.spans]
        if not spans:
            continue
        try:
            source = read_source(attributes(rs.resource.attributes))
        except Rejection as rej:
            yield rej, spans
            continue
        yield source, spans
