"""Shared pieces of the hardening suite: the sidecar tests' real engines and
live server, a builder for hand-made OTLP requests (to say what no recorder
would), and the tracker's invariants, checked after every fault."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from pdwatch import contract as c
from pdwatch.sidecar import views
from pdwatch.sidecar.tracker import _SEEN_SPANS_MAX, Tracker
from tests.support.sidecar import T0, Engine, FakeClock, LiveSidecar
from tests.support.tracking import evaluate, judge_of, new_tracker

__all__ = ["T0", "Engine", "FakeClock", "LiveSidecar", "any_value", "resource_spans", "span", "check_invariants"]

# Examples per fuzz test: small by default so the suite stays quick; raise it to search longer.
FUZZ_EXAMPLES = int(os.environ.get("PDWATCH_FUZZ_EXAMPLES", "300"))
FLOORS = {"bootstrap": 30, "queued": 60, "prefill": 60, "transfer": 15, "decode": 30}


def any_value(v) -> AnyValue:
    out = AnyValue()
    if isinstance(v, bool):
        out.bool_value = v
    elif isinstance(v, int):
        out.int_value = v
    elif isinstance(v, float):
        out.double_value = v
    elif isinstance(v, str):
        out.string_value = v
    elif isinstance(v, bytes):
        out.bytes_value = v
    elif isinstance(v, list):
        out.array_value.values.extend(any_value(x) for x in v)
    elif isinstance(v, dict):
        out.kvlist_value.values.extend(KeyValue(key=k, value=any_value(x)) for k, x in v.items())
    return out


def kvs(attrs: dict) -> list[KeyValue]:
    return [KeyValue(key=k, value=any_value(v)) for k, v in attrs.items()]


def span(name: str, trace_id: bytes, span_id: bytes, start: int, end: int, attrs: dict | None = None,
         parent: bytes = b"") -> Span:
    return Span(name=name, trace_id=trace_id, span_id=span_id, parent_span_id=parent, start_time_unix_nano=start,
                end_time_unix_nano=end, attributes=kvs(attrs or {}))


def source(role="prefill", instance="prefill-0", incarnation="inc-1", **extra) -> dict:
    return {c.R_ROLE: role, c.R_INSTANCE: instance, c.R_INSTANCE_ID: incarnation, c.R_CLUSTER: "default", **extra}


def resource_spans(resource: dict, spans: list[Span]) -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.extend(kvs(resource))
    rs.scope_spans.add().spans.extend(spans)
    return req


def heartbeat(seq: int, at_ns: int, inventory: list[tuple[str, str, int]] | None = None, span_id: bytes | None = None,
              **attrs) -> Span:
    """A pd.heartbeat; inventory is [(trace id hex, stage, entry ns)]."""
    a = {c.H_SEQ: seq, c.H_INTERVAL: 2.0, **attrs}
    if inventory is not None:
        a[c.H_OPEN_TOTAL] = len(inventory)
        a[c.H_OPEN_TRACE_IDS] = [t for t, _, _ in inventory]
        a[c.H_OPEN_STAGES] = [s for _, s, _ in inventory]
        a[c.H_OPEN_SINCE] = [n for _, _, n in inventory]
    sid = span_id or (seq + 1).to_bytes(8, "big")
    return span(c.SPAN_HEARTBEAT, bytes(15) + b"\x01", sid, at_ns, at_ns, a)


def check_invariants(t: Tracker) -> None:
    """What must hold after any input, however wrong: bounded, consistent, and every view renders as strict JSON."""
    assert len(t.open) <= t.max_open
    assert len(t.closed) <= t.max_closed
    assert len(t.instances) <= t.max_instances
    assert len(t._seen_spans) <= _SEEN_SPANS_MAX
    for key, leg in t.open.items():
        assert key == (leg.trace_id, leg.role)
        assert leg.role in c.ROLES and leg.outcome is None and leg.end_ns is None
        assert len(leg.trace_id) == 32 and int(leg.trace_id, 16) > 0
        assert leg.stage is None or leg.stage in c.STAGES[leg.role]
        assert leg.inc is not None and key in leg.inc.keys
        inst = t.instances.get((leg.cluster, leg.pd_instance))
        assert inst is not None and leg.inc in inst.ranks.values()
    for (cluster, _), inst in t.instances.items():
        assert cluster in t.clusters
        assert inst.role in c.ROLES and all(0 <= r < 1024 for r in inst.ranks)
    for n in (*t.rejected.values(), *t.evicted.values(), t.duplicates, t.spans_received):
        assert isinstance(n, int) and n >= 0
    ev = evaluate(t)
    for s in ev.stuck:
        assert s.age_s == s.age_s and s.threshold_s > 0  # not NaN
    docs = [views.stuck_list(ev), views.summary(ev), list(ev.diagnosis)]
    docs += [views.request_detail(judge_of(t).request_view(tid)) for tid, _ in list(t.open)[:50]]
    for doc in docs:
        json.dumps(doc, allow_nan=False)  # what FastAPI's JSONResponse demands


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def tracker(clock):
    return new_tracker(FLOORS, clock=clock)


@pytest.fixture
def engines(clock):
    made = []

    def make(role, instance, engine_clock=None, **kw):
        e = Engine(role, instance, engine_clock or clock, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.rec.shutdown(timeout_s=1)


@pytest.fixture
def live_sidecar():
    from pdwatch.sidecar.settings import Settings

    started = []

    def start(clock=time.time_ns, nvml_library=None, forward_options=None, **settings):
        s = LiveSidecar(Settings(**{"nvml": "off", **settings}), clock=clock, nvml_library=nvml_library,
                        forward_options=forward_options).__enter__()
        started.append(s)
        return s

    logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)
    yield start
    for s in started:
        s.__exit__(None, None, None)
