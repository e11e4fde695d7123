"""Builds OTLP protobuf spans from the recorder's finished pieces.

Pure functions, run on the recorder's worker thread. The spans are written
straight into `opentelemetry-proto` messages with the times the engine thread
recorded: the SDK's live-span machinery (a Span object, its lock and
processors, then a second pass through the generic encoder) cost about 40 µs
a span against about 6 µs here, all of it on the engine process's GIL. Ids
are fixed when a leg arrives, so heartbeats can name a leg and its stage
spans can point at it before the leg span exists.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from pdwatch import contract as c
from pdwatch.contract.otlp import add_attributes

from .legs import LegDone, StageDone, new_span_id, new_trace_id

if TYPE_CHECKING:
    from google.protobuf.internal.containers import RepeatedCompositeFieldContainer
    from opentelemetry.util.types import AttributeValue

    from .config import RecorderConfig

SCOPE = InstrumentationScope(name="pdwatch.engine_patches")
_SERVER, _INTERNAL = Span.SpanKind.SPAN_KIND_SERVER, Span.SpanKind.SPAN_KIND_INTERNAL
_ERROR = Status.StatusCode.STATUS_CODE_ERROR


def resource(cfg: RecorderConfig, instance_id: str, start_ns: int) -> Resource:
    """Contract section 3, on every span this process sends; built once."""
    from opentelemetry.sdk.resources import Resource as SdkResource

    attrs: dict[str, AttributeValue] = {
        c.R_SERVICE_NAME: cfg.service_name,
        c.R_INSTANCE_ID: instance_id,
        c.R_PID: cfg.pid,
        c.R_HOST: cfg.host,
        c.R_CLUSTER: cfg.cluster or "",
        c.R_ROLE: cfg.role,
        c.R_INSTANCE: cfg.instance or "",
        c.R_START_NS: start_ns,
        c.R_TP_RANK: cfg.tp_rank,
        c.R_TP_SIZE: cfg.tp_size,
        c.R_ENGINE_VERSION: cfg.engine_version,
        # OpenTelemetry's names for the instrumentation distribution: the sidecar learns the plugin's version.
        c.R_DISTRO_NAME: c.DISTRIBUTION,
        c.R_DISTRO_VERSION: c.package_version(),
    }
    if cfg.gpu_uuids:
        attrs[c.R_GPU_UUIDS] = list(cfg.gpu_uuids)
    if cfg.peer_ids:
        attrs[c.R_PEER_IDS] = list(cfg.peer_ids)
    if cfg.schedule_policy:
        attrs[c.R_SCHEDULE_POLICY] = cfg.schedule_policy
    # The SDK's Resource.create adds OTEL_RESOURCE_ATTRIBUTES and its own
    # telemetry.sdk.* defaults, once; the contract's attributes are given last and win.
    merged = SdkResource.create(attrs).attributes
    out = Resource()
    add_attributes(out, merged)
    return out


def _ids(span: Span, trace_id: int, span_id: int, parent_span_id: int | None) -> None:
    span.trace_id = trace_id.to_bytes(16, "big")
    span.span_id = span_id.to_bytes(8, "big")
    if parent_span_id is not None:
        span.parent_span_id = parent_span_id.to_bytes(8, "big")


# Each fill_* writes one span in place, into the slot the export queue handed
# out: a span built apart and then put into a request would be copied again.

def fill_stage(span: Span, piece: StageDone, role: str) -> None:
    leg = piece.leg
    span.name = c.stage_span_name(piece.stage)
    span.kind = _INTERNAL
    span.start_time_unix_nano = piece.start_ns
    span.end_time_unix_nano = piece.end_ns
    _ids(span, leg.trace_id, new_span_id(), leg.span_id)
    # pd.bootstrap_room fourth: the sidecar reads it there first (sidecar/spans.py _ROOM_AT).
    attrs: dict[str, AttributeValue] = {c.A_ROLE: role, c.A_STAGE: piece.stage, c.A_RID: leg.rid}
    if leg.room is not None:
        attrs[c.A_ROOM] = leg.room
    if piece.attrs:
        attrs.update(piece.attrs)
    add_attributes(span, attrs)
    if piece.error:
        span.status.code = _ERROR
        span.status.message = piece.error


def fill_leg(span: Span, piece: LegDone, role: str) -> None:
    leg = piece.leg
    span.name = c.SPAN_LEG
    span.kind = _SERVER
    span.start_time_unix_nano = leg.arrive_ns
    span.end_time_unix_nano = piece.end_ns
    _ids(span, leg.trace_id, leg.span_id, leg.parent_span_id)
    attrs: dict[str, AttributeValue] = {
        c.A_ROLE: role,
        c.A_RID: leg.rid,
        c.A_OUTCOME: piece.outcome,
        c.A_OUTPUT_TOKENS: piece.output_tokens,
    }
    if leg.prompt_tokens >= 0:
        attrs[c.A_PROMPT_TOKENS] = leg.prompt_tokens
    if leg.probe:
        attrs[c.A_PROBE] = True
    if leg.room is not None:
        attrs[c.A_ROOM] = leg.room
    if leg.peer:
        attrs[c.A_PEER] = leg.peer
    if leg.error:
        attrs[c.A_LEG_ERROR] = leg.error
    add_attributes(span, attrs)
    if piece.outcome != "ok":
        span.status.code = _ERROR
        span.status.message = piece.reason or piece.outcome


def fill_heartbeat(span: Span, attrs: Mapping[str, AttributeValue], now_ns: int) -> None:
    span.name = c.SPAN_HEARTBEAT
    span.kind = _INTERNAL
    span.start_time_unix_nano = span.end_time_unix_nano = now_ns
    _ids(span, new_trace_id(), new_span_id(), None)
    add_attributes(span, attrs)


def new_request(res: Resource) -> tuple[ExportTraceServiceRequest, RepeatedCompositeFieldContainer[Span]]:
    """An empty export request for this process's resource and pdwatch's scope, and where its spans go."""
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.CopyFrom(res)
    ss = rs.scope_spans.add()
    ss.scope.CopyFrom(SCOPE)
    return req, ss.spans
