"""Turns finished leg and stage pieces into OpenTelemetry spans and exports them.

Runs only on the recorder's worker thread. Spans are created after the fact
with the timestamps the engine thread recorded, so no SDK object lives for an
open leg; the leg span's ids are fixed at arrival so that heartbeats can name
it and stage spans can point at it before it exists.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.util.types import AttributeValue

from pdwatch import contract as c

from .config import RecorderConfig
from .legs import LegDone, StageDone

log = logging.getLogger("pdwatch.recorder")


class PresetIdGenerator(IdGenerator):
    """Hands out ids chosen by the caller for the next span, random otherwise.

    The SDK asks for a trace id only for root spans and a span id for every
    span; the worker thread presets both right before creating a leg span.
    """

    def __init__(self) -> None:
        self._random = RandomIdGenerator()
        self.next_trace_id: int | None = None
        self.next_span_id: int | None = None

    def generate_trace_id(self) -> int:
        tid, self.next_trace_id = self.next_trace_id, None
        return tid or self._random.generate_trace_id()

    def generate_span_id(self) -> int:
        sid, self.next_span_id = self.next_span_id, None
        return sid or self._random.generate_span_id()


class CountingExporter(SpanExporter):
    """Wraps the real exporter to count what it was given and what failed."""

    def __init__(self, inner: SpanExporter):
        self.inner = inner
        self.taken = 0
        self.failed_spans = 0
        self.failed_batches = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.taken += len(spans)
        try:
            result = self.inner.export(spans)
        except Exception:  # an exporter must never take the worker down
            result = SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS:
            self.failed_spans += len(spans)
            self.failed_batches += 1
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


def build_resource(cfg: RecorderConfig, instance_id: str, start_ns: int) -> Resource:
    attrs: dict[str, AttributeValue] = {
        c.R_SERVICE_NAME: cfg.service_name,
        c.R_INSTANCE_ID: instance_id,
        c.R_PID: cfg.pid,
        c.R_HOST: cfg.host,
        c.R_CLUSTER: cfg.cluster,
        c.R_ROLE: cfg.role,
        c.R_INSTANCE: cfg.instance,
        c.R_START_NS: start_ns,
        c.R_TP_RANK: cfg.tp_rank,
        c.R_TP_SIZE: cfg.tp_size,
        c.R_ENGINE_VERSION: cfg.engine_version,
    }
    if cfg.gpu_uuids:
        attrs[c.R_GPU_UUIDS] = list(cfg.gpu_uuids)
    if cfg.peer_ids:
        attrs[c.R_PEER_IDS] = list(cfg.peer_ids)
    # Resource.create would merge in OTEL_RESOURCE_ATTRIBUTES and SDK defaults;
    # the contract's attributes must win, so they are given last.
    return Resource.create(attrs)


class SpanSink:
    """Owns the tracer provider; creates, ends and queues spans for export."""

    def __init__(self, cfg: RecorderConfig, resource: Resource, exporter: SpanExporter | None):
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=f"{cfg.endpoint}/v1/traces", timeout=cfg.export_timeout_s)
        self.exporter = CountingExporter(exporter)
        self.ids = PresetIdGenerator()
        self.provider = TracerProvider(resource=resource, id_generator=self.ids)
        self.processor = BatchSpanProcessor(
            self.exporter,
            max_queue_size=cfg.max_export_queue,
            schedule_delay_millis=200,
            max_export_batch_size=min(512, cfg.max_export_queue),
        )
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("pdwatch.engine_patches")
        self.role = cfg.role
        self.max_queue = cfg.max_export_queue
        self.ended = 0
        self.dropped = 0
        self._lock = threading.Lock()

    def _room_full(self) -> bool:
        # Spans ended but not yet taken by the exporter are waiting in the
        # batch processor's queue; past its size it would drop silently.
        return self.ended - self.exporter.taken >= self.max_queue

    def _end(self, span: Span, end_ns: int) -> None:
        span.end(end_time=end_ns)
        self.ended += 1

    def stage(self, piece: StageDone) -> None:
        if self._room_full():
            self.dropped += 1
            return
        leg = piece.leg
        parent = trace.set_span_in_context(
            NonRecordingSpan(SpanContext(leg.trace_id, leg.span_id, False, TraceFlags(TraceFlags.SAMPLED)))
        )
        attrs: dict[str, AttributeValue] = {c.A_ROLE: self.role, c.A_STAGE: piece.stage, c.A_RID: leg.rid}
        if leg.room is not None:
            attrs[c.A_ROOM] = leg.room
        if piece.attrs:
            attrs.update(piece.attrs)
        span = self.tracer.start_span(
            c.stage_span_name(piece.stage),
            context=parent,
            kind=SpanKind.INTERNAL,
            attributes=attrs,
            start_time=piece.start_ns,
        )
        if piece.error:
            span.set_status(Status(StatusCode.ERROR, piece.error))
        self._end(span, piece.end_ns)

    def leg(self, piece: LegDone) -> None:
        if self._room_full():
            self.dropped += 1
            return
        leg = piece.leg
        if leg.parent_span_id is not None:
            ctx = trace.set_span_in_context(
                NonRecordingSpan(SpanContext(leg.trace_id, leg.parent_span_id, True, TraceFlags(TraceFlags.SAMPLED)))
            )
        else:
            ctx = trace.set_span_in_context(trace.INVALID_SPAN)  # a root, not the caller's context
            self.ids.next_trace_id = leg.trace_id
        self.ids.next_span_id = leg.span_id
        attrs: dict[str, AttributeValue] = {
            c.A_ROLE: self.role,
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
        span = self.tracer.start_span(
            c.SPAN_LEG, context=ctx, kind=SpanKind.SERVER, attributes=attrs, start_time=leg.arrive_ns
        )
        if piece.outcome != "ok":
            span.set_status(Status(StatusCode.ERROR, piece.reason or piece.outcome))
        self._end(span, piece.end_ns)

    def heartbeat(self, attrs: Mapping[str, AttributeValue], now_ns: int) -> bool:
        if self._room_full():
            self.dropped += 1
            return False
        span = self.tracer.start_span(
            c.SPAN_HEARTBEAT,
            context=trace.set_span_in_context(trace.INVALID_SPAN),
            kind=SpanKind.INTERNAL,
            attributes=attrs,
            start_time=now_ns,
        )
        self._end(span, now_ns)
        return True

    def flush(self, timeout_s: float) -> bool:
        return self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        self.provider.shutdown()
