"""One judge: time passes on its tick alone; reads of every kind change nothing and emit nothing."""

from __future__ import annotations

import httpx

from pdwatch import contract as c
from tests.support.otlp_receiver import OtlpReceiver
from tests.support.waiting import wait_for

PB = {"Content-Type": "application/x-protobuf"}
FAST = {"linger_s": 0.0, "backoff_s": 0.01}


def test_reads_of_every_kind_change_nothing_and_emit_nothing(live_sidecar, engines, clock):
    with OtlpReceiver() as rcv:
        # A judge that ticks only when told to: nothing else may move the state between reads.
        sc = live_sidecar(clock=clock, evaluate_interval_s=3600, forward_otlp_endpoint=rcv.url, forward_options=FAST)
        p = engines("prefill", "prefill-0")
        p.walk("p-1", 1, ("bootstrap", "queued", "prefill", "transfer"))
        assert httpx.post(f"{sc.url}/v1/traces", content=p.request(True).SerializeToString(), headers=PB).status_code == 200
        clock.advance(20)  # past the transfer floor: stuck, but only the judge may say so
        assert httpx.post(f"{sc.url}/v1/traces", content=p.request(True).SerializeToString(), headers=PB).status_code == 200
        sc.judge_now()
        assert wait_for(lambda: [s for _, s in rcv.spans() if s.name == c.SPAN_STUCK])  # the judge's one pd.stuck
        tracker, judge, fwd = sc.sidecar.tracker, sc.sidecar.judge, sc.sidecar.forwarder

        def state():
            return sc.read(lambda: (
                sc.sidecar.latest(), dict(judge.stuck_detected), tracker.spans_received, tracker.duplicates,
                len(tracker.open), len(tracker.closed), fwd.queue_depth, dict(fwd.spans),
                [(v.stuck_at_ns, v.ever_stuck, v.evidence) for v in judge.verdicts.values()]))

        before = state()
        posts_before = len(rcv.posts)
        trace = f"{c.room_trace_id(1):032x}"
        with httpx.Client(base_url=sc.url) as http:
            for _ in range(25):
                clock.advance(7)  # time moves on for readers too; the judge has not looked
                assert [s["trace_id"] for s in http.get(c.PATH_STUCK).json()] == [trace]
                assert http.get(c.PATH_REQUEST.format(trace_id=trace)).status_code == 200
                assert http.get(c.PATH_DIAGNOSIS).status_code == 200
                assert http.get("/api/v1/summary").status_code == 200
                assert http.get(c.PATH_METRICS).status_code == 200
                assert http.get(c.PATH_METRICS, headers={"Accept": "application/openmetrics-text"}).status_code == 200
                assert http.get(c.PATH_HEALTH).status_code == 200
        after = state()
        assert after == before
        assert after[0] is before[0]  # the very same evaluation object: no read made a new one
        assert len(rcv.posts) == posts_before  # nothing was forwarded by a read


def test_the_judge_finds_a_stuck_leg_with_nobody_reading(live_sidecar, engines, clock):
    with OtlpReceiver() as rcv:
        sc = live_sidecar(clock=clock, evaluate_interval_s=0.05, forward_otlp_endpoint=rcv.url, forward_options=FAST)
        d = engines("decode", "decode-0")
        d.walk("d-1", 4, ("bootstrap", "transfer"))
        assert httpx.post(f"{sc.url}/v1/traces", content=d.request(True).SerializeToString(), headers=PB).status_code == 200
        clock.advance(16)  # and the engine still heartbeats: a silent one's own legs are not judged
        assert httpx.post(f"{sc.url}/v1/traces", content=d.request(True).SerializeToString(), headers=PB).status_code == 200
        stuck = wait_for(lambda: [s for _, s in rcv.spans() if s.name == c.SPAN_STUCK])
        assert len(stuck) == 1 and stuck[0].trace_id.hex() == f"{c.room_trace_id(4):032x}"
        assert sc.sidecar.latest().counters.stuck_detected == {("default", "decode", "transfer"): 1}
