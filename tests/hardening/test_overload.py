"""Overload: memory limit and ingest back-pressure answer 503/429 with
Retry-After, caps on legs, instances and label sets hold, and legs of an
instance that vanished are evicted after the TTL; every one of them counted
in /metrics."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from pdwatch import contract as c
from pdwatch.sidecar.overload import IngestGuard, read_rss_bytes

from .conftest import check_invariants, heartbeat, resource_spans, source, span

PB = {"content-type": "application/x-protobuf"}


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} not in /metrics"
    return float(m.group(1))


def test_rss_is_read_from_proc_status():
    rss = read_rss_bytes()
    with open("/proc/self/status") as f:
        kib = int(next(line for line in f if line.startswith("VmRSS:")).split()[1])
    assert rss is not None and abs(rss - kib * 1024) < 64 << 20
    assert read_rss_bytes("/nonexistent/status") is None


def test_over_the_memory_limit_ingest_answers_503_with_retry_after_and_recovers(live_sidecar, engines, clock):
    sc = live_sidecar(clock=clock, max_rss_bytes=1 << 20)  # any live process holds more than 1 MiB
    p = engines("prefill", "prefill-0")
    p.walk("p-1", 1, ("bootstrap", "queued"))
    body = p.request(heartbeat=True).SerializeToString()
    r = httpx.post(f"{sc.url}/v1/traces", content=body, headers=PB)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert "memory" in r.json()["detail"]
    assert not sc.sidecar.tracker.open  # refused before reading: nothing applied
    text = httpx.get(f"{sc.url}/metrics").text
    assert metric(text, "pdwatch_ingest_refused_total", '{reason="memory"}') == 1
    assert metric(text, "pdwatch_sidecar_resident_memory_bytes") > 1 << 20
    assert metric(text, "pdwatch_sidecar_memory_limit_bytes") == 1 << 20
    # The API stays up while ingest is refused, and ingest resumes once memory is back under the limit.
    assert httpx.get(f"{sc.url}/api/v1/summary").status_code == 200
    sc.sidecar.guard.max_rss = 1 << 40
    sc.sidecar.guard._rss_at = -1e18  # read again now rather than within the cache interval
    assert httpx.post(f"{sc.url}/v1/traces", content=body, headers=PB).status_code == 200
    assert (f"{c.room_trace_id(1):032x}", "prefill") in sc.sidecar.tracker.open


def test_too_many_requests_in_flight_get_429_with_retry_after(live_sidecar, engines, clock):
    sc = live_sidecar(clock=clock)
    guard = sc.sidecar.guard
    p = engines("prefill", "prefill-0")
    p.walk("p-1", 1, ("bootstrap",))
    body = p.request(heartbeat=True).SerializeToString()

    async def burst(n: int) -> list[httpx.Response]:
        # Each body holds back its tail until every request has reached the handler (let in or
        # refused), so the ones let in stay in flight while the rest arrive, however slow the host.
        async def slow():
            yield body[:10]
            deadline = time.monotonic() + 30
            while guard.in_flight + guard.refused["busy"] < n and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            yield body[10:]

        async with httpx.AsyncClient(base_url=sc.url, timeout=30,
                                     limits=httpx.Limits(max_connections=n)) as client:
            return await asyncio.gather(*(client.post("/v1/traces", content=slow(), headers=PB) for _ in range(n)))

    responses = asyncio.run(burst(guard.max_in_flight + 8))
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) == guard.max_in_flight and codes.count(429) == 8, codes
    busy = [r for r in responses if r.status_code == 429]
    assert all(r.headers["retry-after"] == "1" for r in busy)
    assert guard.refused["busy"] == len(busy) and guard.in_flight == 0
    text = httpx.get(f"{sc.url}/metrics").text
    assert metric(text, "pdwatch_ingest_refused_total", '{reason="busy"}') == len(busy)


def test_guard_refuses_in_order_busy_then_memory():
    rss = [10]
    g = IngestGuard(5, max_in_flight=1, status_path="/proc/self/status")
    g.current_rss = lambda: rss[0]
    assert g.refusal()[0] == 503
    g.in_flight = 1
    assert g.refusal()[0] == 429
    g.in_flight, rss[0] = 0, 1
    assert g.refusal() is None
    assert g.refused == {"busy": 1, "memory": 1}


def test_caps_on_open_legs_instances_and_label_sets_hold_and_are_counted(live_sidecar, clock):
    sc = live_sidecar(clock=clock, max_open_legs=50, max_instances=3)
    t = sc.sidecar.tracker
    t.samples.max_keys = t.durations.max_label_sets = 1  # one (cluster, role, stage) series each
    with httpx.Client(base_url=sc.url) as http:
        inv = [(f"{i + 1:032x}", "queued", clock.now) for i in range(80)]
        body = resource_spans(source(), [heartbeat(1, clock.now, inv)]).SerializeToString()
        assert http.post("/v1/traces", content=body, headers=PB).status_code == 200
        for i in range(5):  # instances 4 and 5 are refused
            body = resource_spans(source(instance=f"d-{i}", role="decode", incarnation=f"i{i}",
                                         **{c.R_CLUSTER: f"c{i}"}),
                                  [span("pd.bootstrap", bytes(15) + bytes([i + 1]), bytes(7) + bytes([i + 1]),
                                        clock.now, clock.now + 1)]).SerializeToString()
            r = http.post("/v1/traces", content=body, headers=PB)
            assert r.status_code == 200
            rejected = ExportTraceServiceResponse.FromString(r.content).partial_success.rejected_spans
            assert rejected == (0 if i < 2 else 1)
        sc.judge_now()
        text = http.get("/metrics").text
    assert len(t.open) == 50 and t.evicted["open_limit"] == 30 + 2  # the decode legs found the table full
    assert metric(text, "pdwatch_legs_evicted_total", '{reason="open_limit"}') == 32
    assert metric(text, "pdwatch_spans_rejected_total", '{reason="instance_limit"}') == 3
    assert metric(text, "pdwatch_tracked_instances") == 3
    # Series (c0, decode, bootstrap) fills the cap of one; c1's observation is refused in both places.
    assert metric(text, "pdwatch_label_sets_refused_total") == 2
    assert text.count("pdwatch_stage_duration_seconds_count{") == 1
    sc.read(check_invariants, t)


def test_legs_of_an_instance_that_vanished_are_evicted_after_the_ttl(live_sidecar, engines, clock):
    sc = live_sidecar(clock=clock, instance_ttl_s=600, max_instances=2)
    t = sc.sidecar.tracker
    gone, alive = engines("decode", "decode-gone"), engines("decode", "decode-alive")
    gone.walk("d-5", 5, ("bootstrap", "transfer", "queued", "decode"))
    gone.rec.finish("d-5")
    for i, e in enumerate((gone, alive)):
        e.walk(f"d-{i}", i, ("bootstrap", "transfer"))
        assert httpx.post(f"{sc.url}/v1/traces", content=e.request(True).SerializeToString(),
                          headers=PB).status_code == 200
    assert len(t.open) == 2
    for _ in range(7):  # 700 s: only one instance keeps heartbeating
        clock.advance(100)
        httpx.post(f"{sc.url}/v1/traces", content=alive.request(True).SerializeToString(), headers=PB)
    sc.judge_now()
    stuck = httpx.get(f"{sc.url}/api/v1/stuck").json()
    assert [s["pd_instance"] for s in stuck] == ["decode-alive"]
    assert [k for k in t.instances] == [("default", "decode-alive")]
    assert t.evicted["instance_gone"] == 1 and t.instances_expired == 1
    text = httpx.get(f"{sc.url}/metrics").text
    assert metric(text, "pdwatch_legs_evicted_total", '{reason="instance_gone"}') == 1
    assert metric(text, "pdwatch_instances_expired_total") == 1
    assert 'pd_instance="decode-gone"' not in text  # its label sets went with it
    # The summary's finished counts are the metric's: the forgotten instance's finished leg left both.
    assert httpx.get(f"{sc.url}/api/v1/summary").json()["clusters"]["default"]["finished"] == {}
    # Its slot is free again: a new instance is accepted under the cap of 2.
    new = engines("decode", "decode-new")
    new.walk("d-9", 9, ("bootstrap",))
    r = httpx.post(f"{sc.url}/v1/traces", content=new.request(True).SerializeToString(), headers=PB)
    assert not ExportTraceServiceResponse.FromString(r.content).HasField("partial_success")
    check_invariants(t)


@pytest.mark.parametrize("name, value", [("PDWATCH_MAX_RSS_BYTES", "-1"), ("PDWATCH_INSTANCE_TTL_S", "0")])
def test_bad_overload_settings_stop_the_start(name, value, monkeypatch):
    from pdwatch.sidecar.settings import Settings

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        Settings.from_sources({})


def test_a_bug_while_applying_spans_answers_400_and_is_counted(live_sidecar, engines, clock, monkeypatch):
    sc = live_sidecar(clock=clock)

    def broken(request):
        raise KeyError("a pdwatch bug")

    monkeypatch.setattr(sc.sidecar.tracker, "apply", broken)
    p = engines("prefill", "prefill-0")
    p.walk("p-1", 1, ("bootstrap",))
    r = httpx.post(f"{sc.url}/v1/traces", content=p.request().SerializeToString(), headers=PB)
    # 400, not 500: OTLP exporters retry a 5xx, and the same body would fail the same way forever.
    assert r.status_code == 400 and "could not be applied" in r.json()["detail"]
    assert metric(httpx.get(f"{sc.url}/metrics").text, "pdwatch_ingest_errors_total") == 1
    assert sc.sidecar.guard.errors == 1
