"""Faults between engines and sidecar, with real recorders: spans out of
order, twice, replayed; engine clocks minutes off the sidecar's; the sidecar
restarted in the middle of an incident."""

from __future__ import annotations

import random

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from pdwatch import contract as c
from pdwatch.sidecar.tracker import Tracker
from tests.support.tracking import evaluate, ingest, judge_of, new_tracker

from .conftest import FLOORS, FakeClock, check_invariants

PREFILL = ("bootstrap", "queued", "prefill", "transfer")
PB = {"content-type": "application/x-protobuf"}


def tid(room: int) -> str:
    return f"{c.room_trace_id(room):032x}"


def incident(clock, engines, rounds: int = 6):
    """A prefill and a decode over `rounds` heartbeats: most requests finish, rooms 3, 7, 11... hang in transfer.

    Returns the two engines and the OTLP requests they sent.
    """
    # Heartbeats say 10 s apart, so the sidecar judges 20 s past the last one with both up.
    p, d = engines("prefill", "prefill-0", heartbeat_s=10.0), engines("decode", "decode-0", heartbeat_s=10.0)
    sent, room = [], 0
    for _ in range(rounds):
        for _ in range(4):
            hung = room % 4 == 3
            p.walk(f"p-{room}", room, PREFILL)
            d.walk(f"d-{room}", room, ("bootstrap", "transfer"))
            if not hung:
                p.rec.finish(f"p-{room}")
                d.rec.enter(f"d-{room}", "queued")
                d.rec.enter(f"d-{room}", "decode")
                d.rec.token(f"d-{room}", 4)
                d.rec.finish(f"d-{room}", output_tokens=4)
            room += 1
            clock.advance(0.5)
        sent += [p.request(heartbeat=True), d.request(heartbeat=True)]
    return p, d, sent


def facts(t: Tracker, now: int):
    """What the sidecar says about the incident: open legs with stage and entry, outcomes, stuck legs and ages."""
    ev = evaluate(t, now)
    open_legs = {k: (x.stage, x.stage_since_ns, x.rid, x.room) for k, x in t.open.items()}
    outcomes = {k: x.outcome for k, x in t.closed.items() if x.outcome is not None}
    stuck = {(s.trace_id, s.role): round(s.age_s, 6) for s in ev.stuck}
    return open_legs, outcomes, stuck, dict(t.finished), dict(judge_of(t).stuck_detected)


def test_out_of_order_duplicate_and_replayed_spans_change_nothing_twice(engines, clock):
    _, _, requests = incident(clock, engines)
    end = clock.now
    judge_at = end + 20 * 10**9
    in_order = new_tracker(FLOORS, clock=lambda: end)
    for req in requests:
        ingest(in_order, req)
    want = facts(in_order, judge_at)
    assert set(want[2]) == {(tid(r), role) for r in (3, 7, 11, 15, 19, 23) for role in ("prefill", "decode")}

    # The same spans one by one, shuffled, regrouped into requests, every request sent twice, then all replayed.
    rng = random.Random(7)
    singles = []
    for req in requests:
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                for s in ss.spans:
                    one = ExportTraceServiceRequest()
                    r = one.resource_spans.add()
                    r.resource.CopyFrom(rs.resource)
                    r.scope_spans.add().spans.append(s)
                    singles.append(one)
    rng.shuffle(singles)
    messy = new_tracker(FLOORS, clock=lambda: end)
    for i in range(0, len(singles), 5):
        batch = ExportTraceServiceRequest()
        for one in singles[i:i + 5]:
            batch.resource_spans.extend(one.resource_spans)
        ingest(messy, batch)
        ingest(messy, batch)  # an exporter retry after a lost response
    for req in requests:
        ingest(messy, req)  # a replay of everything
    assert facts(messy, judge_at) == want
    assert messy.duplicates >= len(singles) * 2 - len(requests)  # every span applied once
    check_invariants(messy)
    # A detection is counted once however often the rule runs.
    for _ in range(3):
        evaluate(messy, judge_at + 10**9)
    assert sum(judge_of(messy).stuck_detected.values()) == len(want[2])


def test_a_heartbeat_that_arrives_late_does_not_undo_a_newer_one(engines, clock):
    p = engines("prefill", "prefill-0")
    p.walk("p-1", 1, ("bootstrap", "queued"))
    older = p.request(heartbeat=True)
    clock.advance(1)
    p.rec.enter("p-1", "prefill")
    p.rec.enter("p-1", "transfer")
    newer = p.request(heartbeat=True)
    t = new_tracker(FLOORS, clock=clock)
    ingest(t, newer)
    ingest(t, older)
    leg = t.open[(tid(1), "prefill")]
    assert leg.stage == "transfer" and leg.stage_since_ns == clock.now


class SkewedClock:
    """An engine's clock: the sidecar's plus a fixed error."""

    def __init__(self, base: FakeClock, skew_s: float):
        self.base, self.skew = base, int(skew_s * 1e9)

    def __call__(self) -> int:
        return self.base.now + self.skew


def test_engines_whose_clocks_run_minutes_off_get_true_ages(engines, clock, live_sidecar):
    sc = live_sidecar(clock=clock, floor_transfer_s=15)
    # 10 s heartbeat intervals: up across the 9.5 s the test lets pass without one.
    ahead = engines("prefill", "prefill-ahead", engine_clock=SkewedClock(clock, +300), heartbeat_s=10.0)
    behind = engines("decode", "decode-behind", engine_clock=SkewedClock(clock, -420), heartbeat_s=10.0)
    ahead.walk("p-1", 1, PREFILL)
    behind.walk("d-1", 1, ("bootstrap", "transfer"))
    with httpx.Client(base_url=sc.url) as http:
        for _ in range(3):  # a few heartbeats, 2 s apart, as engines send them
            for e in (ahead, behind):
                assert http.post("/v1/traces", content=e.request(True).SerializeToString(), headers=PB).status_code == 200
            clock.advance(2)
        sc.judge_now()
        assert http.get("/api/v1/stuck").json() == []  # 6 s in transfer: not 306 s, and not -414 s
        detail = http.get(f"/api/v1/requests/{tid(1)}").json()
        ages = {leg["role"]: leg["stage_age_s"] for leg in detail["legs"]}
        assert ages == {"prefill": 6.0, "decode": 6.0}
        summary = http.get("/api/v1/summary").json()
        offsets = {i["pd_instance"]: i["ranks"][0]["clock_offset_s"] for i in summary["instances"]}
        assert offsets == {"prefill-ahead": -300.0, "decode-behind": 420.0}
        clock.advance(9.5)  # 15.5 s in transfer
        sc.judge_now()
        stuck = {s["role"]: s["stage_age_s"] for s in http.get("/api/v1/stuck").json()}
        assert stuck == {"prefill": 15.5, "decode": 15.5}


def test_a_sidecar_restarted_mid_incident_finds_the_stuck_legs_again_with_their_entry_times(
        engines, clock, live_sidecar):
    first = live_sidecar(clock=clock)
    p, d, requests = incident(clock, engines, rounds=3)  # hung: rooms 3, 7, 11, both roles
    with httpx.Client(base_url=first.url) as http:
        for req in requests:
            http.post("/v1/traces", content=req.SerializeToString(), headers=PB)
        clock.advance(16)
        first.judge_now()
        before = {(s["trace_id"], s["role"]): s for s in http.get("/api/v1/stuck").json()}
        assert http.get("/metrics").text.count("pdwatch_stuck_detected_total{") == 2  # prefill and decode
    assert len(before) == 6
    first.__exit__(None, None, None)

    # A fresh sidecar, all state lost, hears only what engines send from now on: their next heartbeats.
    second = live_sidecar(clock=clock)
    clock.advance(2)
    with httpx.Client(base_url=second.url) as http:
        for e in (p, d):
            assert http.post("/v1/traces", content=e.request(heartbeat=True).SerializeToString(),
                             headers=PB).status_code == 200
        second.judge_now()
        after = {(s["trace_id"], s["role"]): s for s in http.get("/api/v1/stuck").json()}
        metrics = http.get("/metrics").text
    assert set(after) == set(before)
    for key, s in after.items():
        assert s["stage"] == "transfer" and s["rid"] == before[key]["rid"]
        assert s["stage_since_unix_s"] == before[key]["stage_since_unix_s"]  # the original entry time
        assert s["stage_age_s"] == before[key]["stage_age_s"] + 2
    # Detected again (pd.stuck forwarding hangs on the same first detection), counted by the new process.
    for role in ("prefill", "decode"):
        assert f'pdwatch_stuck_detected_total{{pd_cluster="default",role="{role}",stage="transfer"}} 3.0' in metrics
    second.sidecar.worker.call(check_invariants, second.sidecar.tracker)


def test_after_a_restart_a_decode_leg_with_tokens_is_aged_from_its_last_token(engines, clock):
    d = engines("decode", "decode-0")
    d.walk("d-1", 1, ("bootstrap", "transfer", "queued", "decode"))
    d.rec.token("d-1", 7)
    first = new_tracker(FLOORS, clock=clock)
    ingest(first, d.request(heartbeat=True))
    clock.advance(40)  # no token for 40 s: past the decode floor of 30
    ingest(first, d.request(heartbeat=True))
    assert [(s.stage, round(s.age_s)) for s in evaluate(first).stuck] == [("decode", 40)]
    second = new_tracker(FLOORS, clock=clock)  # restarted: the inventory says when the last token came
    ingest(second, d.request(heartbeat=True))
    assert [(s.stage, round(s.age_s)) for s in evaluate(second).stuck] == [("decode", 40)]


def without(request, attribute: str):
    """The request as an engine without pdwatch's inventory additions would send it."""
    for rs in request.resource_spans:
        for ss in rs.scope_spans:
            for span in ss.spans:
                for i in range(len(span.attributes) - 1, -1, -1):
                    if span.attributes[i].key == attribute:
                        del span.attributes[i]
    return request


def test_without_last_token_times_a_decode_leg_is_found_one_floor_later_never_falsely(engines, clock):
    d = engines("decode", "decode-0")
    d.walk("d-1", 1, ("bootstrap", "transfer", "queued", "decode"))
    d.rec.token("d-1", 7)
    d.request(heartbeat=True)
    clock.advance(40)  # no token for 40 s: past the decode floor of 30
    second = new_tracker(FLOORS, clock=clock)  # restarted, and the engine sends only the contract's lists
    ingest(second, without(d.request(heartbeat=True), c.H_OPEN_LAST_TOKEN))
    assert evaluate(second).stuck == ()
    clock.advance(29)
    ingest(second, without(d.request(heartbeat=True), c.H_OPEN_LAST_TOKEN))
    assert evaluate(second).stuck == ()
    clock.advance(2)
    ingest(second, without(d.request(heartbeat=True), c.H_OPEN_LAST_TOKEN))
    assert [(s.stage, round(s.age_s)) for s in evaluate(second).stuck] == [("decode", 31)]
