"""Bad input at /v1/traces: each kind the issue names, sent to the real app
under real uvicorn, must get a clear 4xx or a partial success, never a 5xx;
afterwards the tracker is consistent and a good request still works. Then
hypothesis throws arbitrary bodies, content types and encodings at the app.
"""

from __future__ import annotations

import gzip
import json
import zlib

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from starlette.testclient import TestClient

from pdwatch import contract as c
from pdwatch.sidecar.app import create_app
from pdwatch.sidecar.settings import Settings

from .conftest import FUZZ_EXAMPLES, FakeClock, check_invariants, heartbeat, resource_spans, source, span

PB = {"content-type": "application/x-protobuf"}
JS = {"content-type": "application/json"}
NOW = 1_800_000_000_000_000_000
TID, SID = bytes(15) + b"\x07", bytes(7) + b"\x09"


def pb(*spans, resource=None) -> bytes:
    return resource_spans(resource or source(), list(spans)).SerializeToString()


def otlp_json(spans: list[dict], resource: dict | None = None) -> bytes:
    attrs = [{"key": k, "value": {"stringValue": v}} for k, v in (resource or source()).items()]
    return json.dumps({"resourceSpans": [{"resource": {"attributes": attrs}, "scopeSpans": [{"spans": spans}]}]}).encode()


def json_span(**over) -> dict:
    return {"name": "pd.bootstrap", "traceId": TID.hex(), "spanId": SID.hex(), "startTimeUnixNano": str(NOW),
            "endTimeUnixNano": str(NOW + 10**6), **over}


def gzip_bomb(size: int) -> bytes:
    """`size` zero bytes, gzipped a MiB at a time (the bomb is built without holding what it inflates to)."""
    z = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    mib = bytes(1 << 20)
    return b"".join(z.compress(mib) for _ in range(size >> 20)) + z.flush()


def deep_json_attribute(depth: int) -> bytes:
    deep = '{"arrayValue": {"values": [' * depth + "{}" + "]}}" * depth
    body = otlp_json([json_span(spanId="0a" * 8, attributes=[{"key": "deep", "value": "DEEP"}])])
    return body.replace(b'"DEEP"', deep.encode())


def deep_pb_value(depth: int) -> bytes:
    """A stage span whose one attribute is an array nested `depth` deep, encoded by hand (no encoder would)."""
    def field(num: int, payload: bytes) -> bytes:  # length-delimited field
        n, out = len(payload), bytearray()
        while True:
            b, n = n & 0x7F, n >> 7
            out.append(b | (0x80 if n else 0))
            if not n:
                break
        return bytes([(num << 3) | 2]) + bytes(out) + payload

    value = b""
    for _ in range(depth):  # AnyValue{array_value=ArrayValue{values=[value]}}
        value = field(5, field(1, value))
    kv = field(1, b"x") + field(2, value)
    s = span("pd.bootstrap", TID, SID, NOW, NOW + 1).SerializeToString() + field(9, kv)
    rs = resource_spans(source(), []).resource_spans[0]
    body = rs.resource.SerializeToString()
    return field(1, field(1, body) + field(2, field(2, s)))


def invalid_utf8_pb() -> bytes:
    good = pb(span("pd.bootstrap", TID, SID, NOW, NOW + 1))
    return good.replace(b"pd.bootstrap", b"pd.boo\xff\xfeap")


def inventory_hb(seq: int, n: int, lengths=None, stages=None) -> bytes:
    inv = [(f"{i + 1:032x}", "queued", NOW - 10**9) for i in range(n)]
    hb = heartbeat(seq, NOW, inv)
    if lengths is not None or stages is not None:
        attrs = {kv.key: kv for kv in hb.attributes}
        if lengths is not None:
            del attrs[c.H_OPEN_STAGES].value.array_value.values[lengths:]
        if stages is not None:
            attrs[c.H_OPEN_STAGES].value.array_value.values[0].string_value = stages
    return pb(hb)


# (case, headers, body, allowed statuses, spans that must be rejected when 200)
CASES = [
    ("gzip bomb: 1 GiB of zeros in 1 MiB", {**PB, "content-encoding": "gzip"},
     lambda: gzip_bomb(1 << 30), {413}, 0),
    ("gzip, truncated", {**PB, "content-encoding": "gzip"}, lambda: gzip.compress(pb())[:-9], {400}, 0),
    ("gzip header on a plain body", {**PB, "content-encoding": "gzip"}, lambda: pb(), {400}, 0),
    ("deflate", {**PB, "content-encoding": "deflate"}, lambda: zlib.compress(pb()), {415}, 0),
    ("text/plain", {"content-type": "text/plain"}, lambda: b"hello", {415}, 0),
    ("protobuf: random bytes", PB, lambda: bytes(range(256)) * 40, {400}, 0),
    ("protobuf: truncated", PB, lambda: pb(span("pd.bootstrap", TID, SID, NOW, NOW + 1))[:-3], {400}, 0),
    ("protobuf: nested 10,000 deep", PB, lambda: deep_pb_value(10_000), {400}, 0),
    ("protobuf: invalid UTF-8 in a string", PB, invalid_utf8_pb, {400}, 0),
    ("protobuf: trace id of 15 bytes", PB, lambda: pb(span("pd.bootstrap", TID[:15], SID, NOW, NOW + 1)), {200}, 1),
    ("protobuf: span id of 9 bytes", PB, lambda: pb(span("pd.request", TID, SID + b"\1", NOW, NOW + 1)), {200}, 1),
    ("protobuf: zero trace id", PB, lambda: pb(span("pd.queued", bytes(16), SID, NOW, NOW + 1)), {200}, 1),
    ("protobuf: ends before it starts", PB, lambda: pb(span("pd.queued", TID, SID, NOW, NOW - 1)), {200}, 1),
    ("protobuf: times at 2^64-1", PB, lambda: pb(span("pd.queued", TID, SID, 2**64 - 1, 2**64 - 1)), {200}, 0),
    ("protobuf: unknown span name", PB, lambda: pb(span("pd.lunch", TID, SID, NOW, NOW + 1)), {200}, 1),
    ("protobuf: stage of the other role", PB, lambda: pb(span("pd.decode", TID, SID, NOW, NOW + 1)), {200}, 1),
    ("protobuf: heartbeat seq NaN", PB, lambda: pb(heartbeat(0, NOW, **{c.H_SEQ: float("nan")})), {200}, 1),
    ("protobuf: heartbeat with NaN and inf counters", PB, lambda: pb(heartbeat(
        1, NOW, **{c.H_INTERVAL: float("nan"), "pd.engine.weird": float("inf"), "pdwatch.x": float("nan")})), {200}, 0),
    ("protobuf: heartbeat a century off", PB, lambda: pb(heartbeat(2, NOW + 100 * 365 * 86400 * 10**9)), {200}, 1),
    ("protobuf: inventory lists of unequal length", PB, lambda: inventory_hb(3, 5, lengths=3), {200}, 1),
    ("protobuf: inventory with an unknown stage", PB, lambda: inventory_hb(4, 3, stages="warp"), {200}, 1),
    ("protobuf: inventory trace ids not a list", PB, lambda: pb(heartbeat(
        5, NOW, **{c.H_OPEN_TOTAL: 1, c.H_OPEN_TRACE_IDS: 7, c.H_OPEN_STAGES: ["queued"], c.H_OPEN_SINCE: [1]})),
     {200}, 1),
    ("protobuf: 1,000,000-element attribute array", PB, lambda: pb(span(
        "pd.bootstrap", TID, SID, NOW, NOW + 1, {"pd.huge": list(range(1_000_000))})), {200}, 0),
    ("protobuf: rank 2^40", PB, lambda: pb(span("pd.queued", TID, SID, NOW, NOW + 1),
                                             resource={**source(), c.R_TP_RANK: 2**40}), {200}, 1),
    ("protobuf: gpu uuids an integer", PB, lambda: pb(span("pd.queued", TID, SID, NOW, NOW + 1),
                                                       resource={**source(), c.R_GPU_UUIDS: 5}), {200}, 1),
    ("protobuf: resource without pd.role", PB, lambda: pb(span("pd.queued", TID, SID, NOW, NOW + 1),
                                                           resource={c.R_INSTANCE: "x", c.R_INSTANCE_ID: "y"}), {200}, 1),
    ("json: not JSON", JS, lambda: b"{resourceSpans: ", {400}, 0),
    ("json: a list", JS, lambda: b"[1, 2]", {400}, 0),
    ("json: nested 100,000 deep", JS, lambda: b"[" * 100_000 + b"]" * 100_000, {400}, 0),
    ("json: attribute nested 200 deep", JS, lambda: deep_json_attribute(200), {200, 400}, 0),
    ("json: attribute nested 900 deep", JS, lambda: deep_json_attribute(900), {200, 400}, 0),
    ("json: invalid UTF-8", JS, lambda: otlp_json([json_span()]).replace(b"pd.bootstrap", b"pd.\xff\xfe"), {400}, 0),
    ("json: trace id odd hex", JS, lambda: otlp_json([json_span(traceId="abc")]), {200}, 1),
    ("json: trace id not hex", JS, lambda: otlp_json([json_span(traceId="zz" * 16)]), {200}, 1),
    ("json: trace id a number", JS, lambda: otlp_json([json_span(traceId=12)]), {400}, 0),
    ("json: negative time", JS, lambda: otlp_json([json_span(startTimeUnixNano="-1")]), {400}, 0),
    ("json: time past 2^64", JS, lambda: otlp_json([json_span(endTimeUnixNano=str(2**64))]), {400}, 0),
    ("json: NaN time", JS, lambda: otlp_json([json_span(endTimeUnixNano="NaN")]), {400}, 0),
    ("json: NaN double attribute", JS, lambda: otlp_json([json_span(
        attributes=[{"key": "pd.x", "value": {"doubleValue": "NaN"}}])]), {200}, 0),
    ("json: unknown fields", JS, lambda: otlp_json([json_span(color="blue")]), {200}, 0),
    ("json: spans not a list", JS, lambda: json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": 5}]}]}).encode(),
     {400}, 0),
    # Last: a tracker holding 100,000 legs makes each later invariant check slow.
    ("protobuf: 100,000-leg inventory", PB, lambda: inventory_hb(6, 100_000), {200}, 0),
]


def test_each_kind_of_bad_input_gets_a_4xx_or_a_partial_success(live_sidecar, engines, clock):
    sc = live_sidecar(clock=clock)
    seen = []
    with httpx.Client(base_url=sc.url, timeout=60) as http:
        for name, headers, make, allowed, must_reject in CASES:
            r = http.post("/v1/traces", content=make(), headers=headers)
            assert r.status_code in allowed, (name, r.status_code, r.text[:200])
            if r.status_code == 200:
                if headers["content-type"] == PB["content-type"]:
                    partial = ExportTraceServiceResponse.FromString(r.content).partial_success
                    rejected, message = partial.rejected_spans, partial.error_message
                else:
                    partial = r.json().get("partialSuccess", {})
                    rejected, message = int(partial.get("rejectedSpans", 0)), partial.get("errorMessage", "")
                assert rejected == must_reject, (name, rejected, message)
                assert bool(message) == bool(must_reject), name
            else:
                assert r.json()["detail"], name  # a clear reason, not an empty error
            seen.append((name, r.status_code))
            sc.sidecar.worker.call(check_invariants, sc.sidecar.tracker)
        for path in ("/api/v1/stuck", "/api/v1/summary", "/api/v1/diagnosis", "/metrics", "/healthz",
                     f"/api/v1/requests/{'1' * 32}", f"/api/v1/requests/{TID.hex()}"):
            assert http.get(path).status_code in (200, 404), path
        # Still works: a real engine's request is applied as before.
        p = engines("prefill", "prefill-9")
        p.walk("p-1", 1, ("bootstrap", "queued"))
        body = p.request(heartbeat=True).SerializeToString()
        r = http.post("/v1/traces", content=body, headers=PB)
        assert r.status_code == 200 and not ExportTraceServiceResponse.FromString(r.content).HasField("partial_success")
    assert (f"{c.room_trace_id(1):032x}", "prefill") in sc.sidecar.tracker.open
    assert sc.sidecar.guard.errors == 0  # no input reached the catch-all
    assert len(seen) == len(CASES)


# ---- hypothesis against the app in-process ----------------------------------

json_doc = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(
        ["resourceSpans", "scopeSpans", "spans", "resource", "attributes", "key", "value", "traceId", "spanId",
         "name", "startTimeUnixNano", "endTimeUnixNano", "stringValue", "intValue", "arrayValue", "values"]),
        inner, max_size=4)),
    max_leaves=24)


@st.composite
def bodies(draw):
    kind = draw(st.sampled_from(["pb", "json", "raw"]))
    if kind == "pb":
        body, ctype = draw(st.binary(max_size=512)), "application/x-protobuf"
    elif kind == "json":
        body, ctype = json.dumps(draw(json_doc)).encode(), "application/json"
    else:
        body = draw(st.binary(max_size=256))
        ctype = draw(st.sampled_from(["application/json", "application/protobuf", "text/plain", "", "a/b; x=y"]))
    encoding = draw(st.sampled_from([None, "gzip", "identity", "br", "GZIP"]))
    if encoding and encoding.lower() == "gzip" and draw(st.booleans()):
        body = gzip.compress(body)
    headers = {"content-type": ctype}
    if encoding:
        headers["content-encoding"] = encoding
    return body, headers


@pytest.fixture(scope="module")
def in_process():
    clock = FakeClock()
    app = create_app(Settings(nvml="off", max_body_bytes=1 << 16), clock=clock)
    with TestClient(app, raise_server_exceptions=True) as client:
        yield client, app.state.sidecar


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                           HealthCheck.too_slow])
@given(case=bodies())
def test_any_body_gets_a_4xx_or_200_never_a_5xx(in_process, case):
    client, sc = in_process
    body, headers = case
    r = client.post("/v1/traces", content=body, headers=headers)
    assert r.status_code in (200, 400, 413, 415), (r.status_code, r.text[:200])
    if r.status_code == 200 and headers["content-type"] != "application/json":
        ExportTraceServiceResponse.FromString(r.content)
    assert sc.guard.errors == 0
    sc.worker.call(check_invariants, sc.tracker)
