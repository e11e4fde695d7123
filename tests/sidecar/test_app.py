"""The sidecar's HTTP surface under a real uvicorn server on a loopback port."""

from __future__ import annotations

import gzip
import json

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from pdwatch import contract as c
from pdwatch.engine_patches.otlp_http import MemoryTransport
from pdwatch.engine_patches.recorder import Recorder, RecorderConfig
from tests.support.otlp_spans import one_request, views
from tests.support.waiting import wait_for


def recorder(url, role, instance, compression="none", headers=None):
    return Recorder(RecorderConfig(role=role, instance=instance, heartbeat_s=1.0, endpoint=url,
                                   compression=compression, headers=headers or {}), environ={})


def send_incident(rec_p, rec_d, n_ok=3, n_hung=2):
    """n_ok requests that finish, then n_hung stuck in transfer on both legs."""
    for i in range(n_ok + n_hung):
        rec_p.arrive(f"p-{i}", bootstrap_room=i, peer="decode-0")
        rec_d.arrive(f"d-{i}", bootstrap_room=i, peer="prefill-0")
        for stage in ("bootstrap", "queued", "prefill", "transfer"):
            rec_p.enter(f"p-{i}", stage)
        for stage in ("bootstrap", "transfer"):
            rec_d.enter(f"d-{i}", stage)
        if i < n_ok:
            rec_p.finish(f"p-{i}")
            rec_d.enter(f"d-{i}", "queued")
            rec_d.enter(f"d-{i}", "decode")
            rec_d.token(f"d-{i}", 3)
            rec_d.finish(f"d-{i}")
    for rec in (rec_p, rec_d):
        rec.drain()
        rec.heartbeat()
        assert rec.flush()


@pytest.mark.parametrize("compression", ["none", "gzip"])
def test_otlp_exporter_to_stuck_api_and_request_detail(live_sidecar, compression):
    sc = live_sidecar(floor_transfer_s=0.3)
    p = recorder(sc.url, "prefill", "prefill-0", compression)
    d = recorder(sc.url, "decode", "decode-0", compression)
    send_incident(p, d)
    hung = {f"{c.room_trace_id(i):032x}" for i in (3, 4)}
    want = {(t, r) for t in hung for r in ("prefill", "decode")}
    # Polled, not slept: the threshold is the floor or 3x the p99 of this run's own transfers.
    stuck = wait_for(lambda: (got := httpx.get(f"{sc.url}/api/v1/stuck").json())
                     and {(s["trace_id"], s["role"]) for s in got} == want and got)
    assert {(s["trace_id"], s["role"]) for s in stuck} == want
    for s in stuck:
        # The tracker judges age > threshold in nanoseconds; the API rounds both to the
        # millisecond, so a leg polled within 0.5 ms of its threshold reads equal to it.
        assert s["stage"] == "transfer" and s["threshold_s"] == 0.3 and s["stage_age_s"] >= 0.3
        assert s["others_flowing"] is True
        assert s["pd_instance"] == f"{s['role']}-0" and s["rid"][0] == s["role"][0]
        assert s["bootstrap_room"] in (3, 4)
        assert s["peer"] == ("decode-0" if s["role"] == "prefill" else "prefill-0")  # from the inventory
    detail = httpx.get(f"{sc.url}/api/v1/requests/{c.room_trace_id(0):032x}").json()
    legs = {leg["role"]: leg for leg in detail["legs"]}
    assert legs["prefill"]["outcome"] == "ok" and legs["decode"]["outcome"] == "ok"
    assert [s["stage"] for s in legs["decode"]["stages"]] == ["bootstrap", "transfer", "queued", "decode"]
    assert legs["decode"]["tokens"] == 3
    open_leg = httpx.get(f"{sc.url}/api/v1/requests/{c.room_trace_id(4):032x}").json()["legs"][0]
    assert open_leg["state"] == "open" and open_leg["stuck"] is True
    assert httpx.get(f"{sc.url}/api/v1/requests/{'f' * 32}").status_code == 404
    assert httpx.get(f"{sc.url}/api/v1/requests/not-an-id").status_code == 400
    p.shutdown(1)
    d.shutdown(1)


def test_the_otel_sdks_own_exporter_gets_through_gzipped(live_sidecar):
    """Another OTel SDK process, not pdwatch's recorder, sending a contract heartbeat: the SDK's span,
    its OTLP/HTTP exporter, gzip."""
    sc = live_sidecar()
    kept = MemoryTransport()
    rec = Recorder(RecorderConfig(role="decode", instance="decode-sdk", heartbeat_s=1.0), transport=kept,
                   environ={})
    rec.heartbeat()
    assert rec.flush()
    (hb,) = views(one_request(kept))
    provider = TracerProvider(resource=Resource(hb.resource.attributes))
    provider.add_span_processor(SimpleSpanProcessor(
        OTLPSpanExporter(endpoint=f"{sc.url}/v1/traces", compression=Compression.Gzip, timeout=5)))
    provider.get_tracer("elsewhere").start_span(hb.name, attributes=hb.attributes).end()
    provider.shutdown()
    assert wait_for(lambda: sc.sidecar.tracker.heartbeats_received == 1)
    assert [k[1] for k in sc.sidecar.tracker.instances] == ["decode-sdk"]
    rec.shutdown(1)


def test_metrics_expose_the_contract_names_and_exemplars(live_sidecar):
    sc = live_sidecar(floor_transfer_s=0.2)
    p, d = recorder(sc.url, "prefill", "prefill-0"), recorder(sc.url, "decode", "decode-0")
    send_incident(p, d)
    stuck_line = 'pdwatch_stuck_requests{pd_cluster="default",pd_instance="decode-0",role="decode",stage="transfer"} 2.0'
    def scrape() -> str:
        return httpx.get(f"{sc.url}/metrics").text

    text = wait_for(lambda: stuck_line in (t := scrape()) and t) or scrape()  # on time-out, assert on the last
    gpu = {m.name for m in c.REQUIRED_METRICS if m.labels == c.GPU_KEY} | {c.GPU_TELEMETRY_UP.name}
    for metric in c.REQUIRED_METRICS:  # the GPU families appear with GPU telemetry only (its own tests)
        for name in metric.series_names:
            assert metric.name in gpu or f"\n{name}" in text, name
    assert stuck_line in text
    assert 'pdwatch_requests_finished_total{outcome="ok",pd_cluster="default",pd_instance="prefill-0",role="prefill"} 3.0' in text
    assert 'pdwatch_instance_up{pd_cluster="default",pd_instance="decode-0",role="decode"} 1.0' in text
    om = httpx.get(f"{sc.url}/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    exemplars = [line for line in om.text.splitlines()
                 if line.startswith("pdwatch_stage_duration_seconds_bucket") and "# {trace_id=" in line]
    assert exemplars
    traced = {line.split('trace_id="')[1][:32] for line in exemplars}
    assert traced <= {f"{c.room_trace_id(i):032x}" for i in range(5)}
    p.shutdown(1)
    d.shutdown(1)


def test_otlp_json_with_hex_ids_is_understood(live_sidecar):
    sc = live_sidecar()
    trace_id, span_id = "5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174"
    body = {"resourceSpans": [{
        "resource": {"attributes": [
            {"key": "pd.role", "value": {"stringValue": "prefill"}},
            {"key": "pd.instance", "value": {"stringValue": "prefill-7"}},
            {"key": "service.instance.id", "value": {"stringValue": "inc-1"}},
        ]},
        "scopeSpans": [{"spans": [{
            "name": "pd.request", "traceId": trace_id, "spanId": span_id, "kind": 2,
            "startTimeUnixNano": "1700000000000000000", "endTimeUnixNano": "1700000001000000000",
            "attributes": [{"key": "pd.outcome", "value": {"stringValue": "ok"}},
                           {"key": "pd.rid", "value": {"stringValue": "r-1"}}],
        }]}],
    }]}
    r = httpx.post(f"{sc.url}/v1/traces", content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json() == {}
    leg = httpx.get(f"{sc.url}/api/v1/requests/{trace_id}").json()["legs"][0]
    assert (leg["rid"], leg["outcome"], leg["span_id"], leg["pd_instance"]) == ("r-1", "ok", span_id, "prefill-7")


def test_bad_input_gets_a_clear_4xx_and_loses_nothing(live_sidecar):
    sc = live_sidecar(max_body_bytes=64 * 1024, floor_transfer_s=0.2)
    p, d = recorder(sc.url, "prefill", "prefill-0"), recorder(sc.url, "decode", "decode-0")
    send_incident(p, d)
    before = sc.sidecar.tracker.spans_received, len(sc.sidecar.tracker.open)
    url = f"{sc.url}/v1/traces"
    proto = {"Content-Type": "application/x-protobuf"}
    cases = [
        (b"\xff\xff\xff\xff", proto, 400),
        (b"{not json", {"Content-Type": "application/json"}, 400),
        (b"[1, 2]", {"Content-Type": "application/json"}, 400),
        (b"hello", {"Content-Type": "text/plain"}, 415),
        (b"", {}, 415),
        (b"x" * (64 * 1024 + 1), proto, 413),
        (gzip.compress(b"\0" * (1024 * 1024)), {**proto, "Content-Encoding": "gzip"}, 413),  # a small bomb
        (b"not gzip at all", {**proto, "Content-Encoding": "gzip"}, 400),
        (b"", {**proto, "Content-Encoding": "br"}, 415),
    ]
    for body, headers, status in cases:
        r = httpx.post(url, content=body, headers=headers)
        assert r.status_code == status, (body[:20], headers, r.text)
        assert r.json()["detail"]
    assert (sc.sidecar.tracker.spans_received, len(sc.sidecar.tracker.open)) == before
    assert len(wait_for(lambda: len(got := httpx.get(f"{sc.url}/api/v1/stuck").json()) == 4 and got) or []) == 4
    p.shutdown(1)
    d.shutdown(1)


def test_spans_missing_contract_attributes_come_back_as_partial_success(live_sidecar):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    sc = live_sidecar()
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    for key, value in (("pd.role", "decode"), ("service.instance.id", "x")):  # no pd.instance
        kv = rs.resource.attributes.add()
        kv.key, kv.value.string_value = key, value
    span = rs.scope_spans.add().spans.add()
    span.name, span.trace_id, span.span_id = "pd.heartbeat", b"\x01" * 16, b"\x02" * 8
    r = httpx.post(f"{sc.url}/v1/traces", content=req.SerializeToString(),
                   headers={"Content-Type": "application/x-protobuf"})
    assert r.status_code == 200
    resp = ExportTraceServiceResponse.FromString(r.content)
    assert resp.partial_success.rejected_spans == 1
    assert "pd.instance" in resp.partial_success.error_message
    sc.judge_now()  # counters reach /metrics with the judge's next evaluation
    metrics = httpx.get(f"{sc.url}/metrics").text
    assert 'pdwatch_spans_rejected_total{reason="missing_attribute"} 1.0' in metrics


def test_token_guards_ingest_and_api_but_not_metrics_or_health(live_sidecar):
    sc = live_sidecar(token="s3cret")
    assert httpx.get(f"{sc.url}/api/v1/stuck").status_code == 401
    assert httpx.get(f"{sc.url}/api/v1/stuck", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{sc.url}/api/v1/stuck", headers={"Authorization": "Bearer s3cret"}).json() == []
    assert httpx.post(f"{sc.url}/v1/traces", content=b"").status_code == 401
    assert httpx.get(f"{sc.url}/metrics").status_code == 200
    assert httpx.get(f"{sc.url}/healthz").json()["status"] == "ok"
    good = recorder(sc.url, "decode", "decode-0", headers={"Authorization": "Bearer s3cret"})
    good.heartbeat()
    assert good.flush()
    assert wait_for(lambda: sc.sidecar.tracker.heartbeats_received == 1)
    assert good.export.failed_spans == 0
    bad = recorder(sc.url, "decode", "decode-1")
    bad.heartbeat()
    bad.flush()
    assert bad.export.failed_spans == 1
    assert "s3cret" not in repr(sc.sidecar.settings)
    good.shutdown(1)
    bad.shutdown(1)


def test_serve_tunes_the_cyclic_gc_for_many_long_lived_legs():
    import gc

    from pdwatch.sidecar.server import GC_YOUNG_THRESHOLD, tune_gc

    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_threshold()[0] == GC_YOUNG_THRESHOLD > before[0]
        assert gc.get_freeze_count() > 0  # start-up objects are out of every collection
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
