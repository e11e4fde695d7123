"""Driving a tracker and its judge directly, as the sidecar's worker does."""

from __future__ import annotations

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from pdwatch.sidecar.evaluation import Evaluation
from pdwatch.sidecar.judge import Judge
from pdwatch.sidecar.spans import decode
from pdwatch.sidecar.tracker import Applied, Tracker


def ingest(tracker: Tracker, request: ExportTraceServiceRequest) -> Applied:
    """One OTLP request into the tracker: decoded once, then applied."""
    return tracker.apply(decode(request))


def evaluate(tracker: Tracker, now: int | None = None) -> Evaluation:
    """One judge's tick over the tracker (the judgment state lives on the legs, so any judge will do)."""
    return Judge(tracker).tick(now)
