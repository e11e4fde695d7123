"""Driving a tracker and its judge directly, as the sidecar's worker does."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from pdwatch.sidecar.evaluation import Evaluation
from pdwatch.sidecar.judge import Judge
from pdwatch.sidecar.settings import Settings
from pdwatch.sidecar.spans import decode
from pdwatch.sidecar.tracker import Applied, Limits, Tracker


def new_tracker(floors: dict[str, float] | None = None, *, clock: Callable[[], int] = time.time_ns,
                **settings: Any) -> Tracker:
    """A tracker sized by these settings (Settings' field names), with its one judge judging by them."""
    fields = {f"floor_{stage}_s": float(s) for stage, s in (floors or {}).items()} | settings
    chosen = Settings.model_construct(**fields)
    tracker = Tracker(Limits.of(chosen), clock=clock)
    tracker.__dict__["_judge"] = Judge(tracker, chosen)
    return tracker


def judge_of(tracker: Tracker) -> Judge:
    """The tracker's one judge: its verdicts (stuck since when, found once) live in it, from tick to tick."""
    judge = tracker.__dict__.get("_judge")
    if judge is None:
        judge = tracker.__dict__["_judge"] = Judge(tracker)
    return judge


def ingest(tracker: Tracker, request: ExportTraceServiceRequest) -> Applied:
    """One OTLP request into the tracker: decoded once, then applied."""
    return tracker.apply(decode(request))


def evaluate(tracker: Tracker, now: int | None = None) -> Evaluation:
    """One tick of the tracker's judge."""
    return judge_of(tracker).tick(now)
