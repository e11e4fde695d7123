"""What a recorder exported, read back from its OTLP bytes for assertions.

The recorder writes protobuf spans itself (engine_patches/otlp.py); these
views give tests the fields they check, with the OTel API's own enums for
kind and status, decoded with opentelemetry-proto from the bytes that would
have gone over the wire.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.trace import SpanKind, StatusCode

from pdwatch.engine_patches.otlp_http import MemoryTransport


def value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


@dataclass(frozen=True)
class SpanView:
    name: str
    context: SimpleNamespace  # trace_id, span_id as ints, as on an SDK span
    parent: SimpleNamespace | None
    kind: SpanKind
    status: SimpleNamespace  # status_code (StatusCode), description
    attributes: dict
    resource: SimpleNamespace  # attributes
    start_time: int
    end_time: int


def one_request(transport: MemoryTransport) -> ExportTraceServiceRequest:
    """Everything the transport kept, as one request, and forgets it.

    Serialized messages concatenate into their merge: the resource_spans of
    every body, in order.
    """
    return ExportTraceServiceRequest.FromString(b"".join(transport.take()))


def views(request: ExportTraceServiceRequest) -> list[SpanView]:
    out = []
    for rs in request.resource_spans:
        resource = SimpleNamespace(attributes={kv.key: value(kv.value) for kv in rs.resource.attributes})
        for ss in rs.scope_spans:
            for s in ss.spans:
                parent = (SimpleNamespace(span_id=int.from_bytes(s.parent_span_id, "big"))
                          if s.parent_span_id else None)
                out.append(SpanView(
                    name=s.name,
                    context=SimpleNamespace(trace_id=int.from_bytes(s.trace_id, "big"),
                                            span_id=int.from_bytes(s.span_id, "big")),
                    parent=parent,
                    kind=SpanKind(s.kind - 1),  # OTLP numbers kinds from UNSPECIFIED = 0
                    status=SimpleNamespace(status_code=StatusCode(s.status.code),
                                           description=s.status.message or None),
                    attributes={kv.key: value(kv.value) for kv in s.attributes},
                    resource=resource,
                    start_time=s.start_time_unix_nano,
                    end_time=s.end_time_unix_nano,
                ))
    return out


class KeptSpans:
    """A MemoryTransport for a recorder, and the spans it kept so far (kept across calls)."""

    def __init__(self) -> None:
        self.transport = MemoryTransport()
        self._spans: list[SpanView] = []

    def get_finished_spans(self) -> list[SpanView]:
        self._spans.extend(views(one_request(self.transport)))
        return list(self._spans)

    def clear(self) -> None:
        self.transport.take()
        self._spans.clear()
