"""The tracker and the stuck rule, fed by real recorders through the real OTLP encoder."""

from __future__ import annotations

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from pdwatch import contract as c
from pdwatch.sidecar import rules
from pdwatch.sidecar.spans import decode
from tests.support.tracking import evaluate, ingest, judge_of, new_tracker

PREFILL_TO_TRANSFER = ("bootstrap", "queued", "prefill", "transfer")
DECODE_TO_TRANSFER = ("bootstrap", "transfer")


def stuck_keys(tracker):
    return {(s.trace_id, s.role, s.stage) for s in evaluate(tracker).stuck}


def tid(room):
    return f"{c.room_trace_id(room):032x}"


def test_a_leg_is_stuck_only_past_its_stage_floor(tracker, engines, clock):
    p = engines("prefill", "prefill-0")
    p.walk("p-1", 1, PREFILL_TO_TRANSFER)
    p.send(tracker)
    clock.advance(14.9)
    p.send(tracker)  # still heartbeating: a silent instance's own legs are not judged (contract section 5)
    assert stuck_keys(tracker) == set()
    clock.advance(0.2)
    assert stuck_keys(tracker) == {(tid(1), "prefill", "transfer")}
    (s,) = evaluate(tracker).stuck
    assert s.threshold_s == 15 and 15 < s.age_s < 15.2
    assert judge_of(tracker).stuck_detected == {("default", "prefill", "transfer"): 1}
    clock.advance(10)
    p.send(tracker)
    evaluate(tracker)
    assert judge_of(tracker).stuck_detected == {("default", "prefill", "transfer"): 1}  # each leg once


def test_both_legs_of_a_request_join_under_one_trace_id(tracker, engines, clock):
    p, d = engines("prefill", "prefill-0"), engines("decode", "decode-0")
    p.walk("p-9", 9, PREFILL_TO_TRANSFER)
    d.walk("d-9", 9, DECODE_TO_TRANSFER)
    p.send(tracker)
    d.send(tracker)
    clock.advance(16)
    p.send(tracker)
    d.send(tracker)
    assert stuck_keys(tracker) == {(tid(9), "prefill", "transfer"), (tid(9), "decode", "transfer")}
    legs = {leg.role: leg for leg in tracker.open.values()}
    assert (legs["prefill"].rid, legs["decode"].rid) == ("p-9", "d-9")
    assert legs["prefill"].pd_instance == "prefill-0" and legs["decode"].pd_instance == "decode-0"


def test_a_decode_that_keeps_producing_tokens_is_never_stuck(tracker, engines, clock):
    d = engines("decode", "decode-0")
    d.walk("d-1", 1, ("bootstrap", "transfer", "queued", "decode"))
    d.send(tracker)
    for _ in range(12):  # 120 s of generation, 4x the decode floor
        clock.advance(10)
        d.rec.token("d-1", 5)
        d.send(tracker)
        assert stuck_keys(tracker) == set()
    clock.advance(31)  # then it stops producing, and keeps heartbeating
    d.send(tracker)
    assert stuck_keys(tracker) == {(tid(1), "decode", "decode")}


def test_decoding_tells_heartbeats_apart_for_the_forwarder(tracker, engines, clock):
    p = engines("prefill", "prefill-0")
    p.walk("p-1", 1, PREFILL_TO_TRANSFER)
    stages_only = decode(p.request(heartbeat=False))
    assert (stages_only.spans, stages_only.heartbeats, stages_only.foreign) == (3, 0, 0)  # forwardable as it came
    assert tracker.apply(stages_only) == (0, [])
    p.walk("p-2", 2, ("bootstrap",))
    with_beat = decode(p.request(heartbeat=True))
    assert with_beat.heartbeats == 1 and tracker.apply(with_beat).rejected == 0


def test_a_leg_span_reads_the_same_on_the_fast_path_and_the_long_way(engines):
    """The ingest reads a well-formed pd.request through a typed fast path; every attribute, pdwatch.error
    included, must read as the general path reads it."""
    from pdwatch.sidecar import spans

    d = engines("decode", "decode-0")
    d.rec.arrive("d-1", bootstrap_room=7, prompt_tokens=40, peer="prefill-0", stage="bootstrap")
    d.rec.leg_error("d-1", "read after the lease")
    d.rec.finish("d-1", "ok", output_tokens=3)
    request = d.request(heartbeat=False)
    (leg,) = [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans if s.name == c.SPAN_LEG]
    fast = spans._leg_fast(leg, "decode")
    assert fast is not None and fast == spans._leg(leg, "decode")
    assert (fast.error, fast.room, fast.prompt_tokens, fast.output_tokens) == ("read after the lease", 7, 40, 3)


def test_threshold_adapts_to_three_times_the_p99(tracker, engines, clock):
    p = engines("prefill", "prefill-0")
    for i in range(200):  # transfers in this cluster normally take 10 s
        p.walk(f"p-{i}", i, PREFILL_TO_TRANSFER)
        clock.advance(10)
        p.rec.finish(f"p-{i}")
    p.send(tracker)
    assert judge_of(tracker).thresholds.threshold(("default", "prefill", "transfer"), clock.now) == 30
    p.walk("p-x", 10_000, PREFILL_TO_TRANSFER)
    p.send(tracker)
    clock.advance(20)  # past the 15 s floor, well within 3 x p99
    p.send(tracker)
    assert stuck_keys(tracker) == set()
    clock.advance(11)
    p.send(tracker)
    assert stuck_keys(tracker) == {(tid(10_000), "prefill", "transfer")}


def test_old_samples_leave_the_window(tracker, engines, clock):
    p = engines("prefill", "prefill-0")
    p.walk("p-1", 1, PREFILL_TO_TRANSFER)
    clock.advance(100)
    p.rec.finish("p-1")
    p.send(tracker)
    key = ("default", "prefill", "transfer")
    assert judge_of(tracker).thresholds.threshold(key, clock.now) == 300
    clock.advance(601)
    assert judge_of(tracker).thresholds.threshold(key, clock.now) == 15


def test_duplicate_and_replayed_spans_change_nothing_twice(tracker, engines, clock):
    p = engines("prefill", "prefill-0")
    p.walk("p-1", 1, PREFILL_TO_TRANSFER)
    clock.advance(1)
    p.rec.finish("p-1")
    request = p.request(heartbeat=True)
    assert ingest(tracker, request) == (0, [])
    assert ingest(tracker, request) == (0, [])  # an exporter retry
    assert tracker.finished == {("default", "prefill", "prefill-0", "ok"): 1}
    assert tracker.heartbeats_received == 1
    assert tracker.duplicates == 6  # 4 stage spans, 1 leg span, 1 heartbeat
    key = ("default", "prefill", "transfer")
    assert len(tracker.samples._samples[key]) == 1


def test_a_stale_heartbeat_does_not_resurrect_a_finished_leg(tracker, engines, clock):
    d = engines("decode", "decode-0")
    d.walk("d-1", 1, DECODE_TO_TRANSFER)
    d.rec.drain()
    d.rec.heartbeat()  # lists d-1 as open
    early = d.request(heartbeat=False)
    d.rec.enter("d-1", "queued")
    d.rec.enter("d-1", "decode")
    d.rec.finish("d-1")
    late = d.request(heartbeat=False)
    ingest(tracker, late)  # the finish arrives first...
    ingest(tracker, early)  # ...then the older heartbeat
    assert tracker.open == {}
    clock.advance(100)
    assert stuck_keys(tracker) == set()


def test_stage_spans_move_an_open_leg_to_the_next_stage(tracker, engines, clock):
    p = engines("prefill", "prefill-0")
    p.walk("p-1", 1, ("bootstrap", "queued"))
    p.send(tracker)
    clock.advance(2)
    p.rec.enter("p-1", "prefill")
    p.send(tracker, heartbeat=False)  # only the pd.queued span, no inventory yet
    (leg,) = tracker.open.values()
    assert leg.stage == "prefill" and leg.stage_since_ns == clock.now


def test_legs_missing_from_a_complete_inventory_have_ended(tracker, engines, clock):
    d = engines("decode", "decode-0")
    d.walk("d-1", 1, DECODE_TO_TRANSFER)
    d.walk("d-2", 2, DECODE_TO_TRANSFER)
    d.send(tracker)
    d.rec.finish("d-1")
    # The leg span of d-1 is lost on the way; the next inventory no longer lists it.
    d.rec.drain()
    d.rec.flush()
    d.transport.take()
    clock.advance(1)
    d.send(tracker)
    assert {leg.rid for leg in tracker.open.values()} == {"d-2"}
    assert tracker.evicted["vanished"] == 1
    assert tracker.finished == {}  # not counted as finished: its outcome is unknown


def test_a_cut_inventory_only_judges_legs_older_than_its_newest_entry(tracker, engines, clock):
    d = engines("decode", "decode-0", inventory_max=2)
    for i in range(4):
        d.walk(f"d-{i}", i, DECODE_TO_TRANSFER)
        clock.advance(1)
    d.send(tracker)  # the inventory lists d-0 and d-1 of 4; stage spans told of d-2 and d-3
    assert {leg.room for leg in tracker.open.values()} == {0, 1, 2, 3}
    d.rec.finish("d-0")
    d.rec.drain()
    d.rec.flush()
    d.transport.take()  # d-0's leg span is lost
    d.send(tracker)  # lists d-1, d-2 of 3: d-0 has ended, d-3 may well be open
    assert {leg.room for leg in tracker.open.values()} == {1, 2, 3}
    assert tracker.evicted["vanished"] == 1


def test_an_instance_restart_ends_the_old_open_legs_as_lost(tracker, engines, clock):
    old = engines("decode", "decode-0")
    old.walk("d-1", 1, DECODE_TO_TRANSFER)
    old.send(tracker)
    clock.advance(5)
    new = engines("decode", "decode-0")  # same pd.instance, new service.instance.id
    new.send(tracker)
    (inst,) = tracker.instances.values()
    assert inst.restarts == 1
    assert tracker.open == {}
    assert tracker.finished == {("default", "decode", "decode-0", "lost"): 1}
    clock.advance(60)
    assert stuck_keys(tracker) == set()
    # The old process's last words arrive late: refused, nothing changes.
    old.rec.enter("d-1", "queued")
    rejected, messages = old.send(tracker)
    assert rejected == 2 and tracker.rejected["stale_incarnation"] == 2
    assert tracker.open == {}


def test_others_flowing_is_per_cluster_and_expires(tracker, engines, clock):
    a = engines("prefill", "prefill-a", cluster="a")
    b = engines("prefill", "prefill-b", cluster="b")
    a.walk("p-1", 1, PREFILL_TO_TRANSFER)
    a.rec.finish("p-1")
    a.send(tracker)
    b.send(tracker)
    assert evaluate(tracker).flowing == {"a": True, "b": False}
    clock.advance(61)
    assert evaluate(tracker).flowing == {"a": False, "b": False}


def test_instance_down_after_three_silent_intervals_and_loop_stall(tracker, engines, clock):
    d = engines("decode", "decode-0", loop_idle_turn_s=0.5)  # its idle loop turns at least every 0.5 s
    d.rec.loop_tick()
    d.send(tracker)
    (inst,) = tracker.instances.values()
    clock.advance(2.9)
    assert rules.instance_up(inst, clock.now)
    d.send(tracker)  # heartbeats go on, the loop counter does not move
    assert not rules.loop_stalled(inst, clock.now)
    clock.advance(0.2)
    assert rules.loop_stalled(inst, clock.now)
    clock.advance(3.1)
    assert not rules.instance_up(inst, clock.now)


def test_an_idle_loop_that_blocks_on_its_input_is_never_stalled(tracker, engines, clock):
    """vLLM's idle EngineCore steps no more: no pd.loop.idle_turn_s, never seen turning idle."""
    d = engines("decode", "decode-0")
    d.rec.loop_tick()
    d.send(tracker)
    (inst,) = tracker.instances.values()
    for _ in range(20):  # an idle minute, heartbeats every second
        clock.advance(1)
        d.send(tracker)
        assert not rules.loop_stalled(inst, clock.now)
    # A leg arrives and the loop still does not move: stalled 3 intervals after the leg, not after
    # the idle minute's start.
    d.walk("d-1", 1, DECODE_TO_TRANSFER)
    d.send(tracker)
    clock.advance(2.9)
    d.send(tracker)
    assert not rules.loop_stalled(inst, clock.now)
    clock.advance(0.2)
    d.send(tracker)
    assert rules.loop_stalled(inst, clock.now)


def test_open_legs_are_bounded_and_eviction_is_counted(clock, engines):

    tracker = new_tracker(clock=clock, max_open_legs=3)
    d = engines("decode", "decode-0")
    for i in range(5):
        d.walk(f"d-{i}", i, DECODE_TO_TRANSFER)
    d.send(tracker)
    # The oldest legs stay (they are the stuck candidates); newcomers are refused, counted.
    assert {leg.rid for leg in tracker.open.values()} == {"d-0", "d-1", "d-2"}
    assert tracker.evicted["open_limit"] == 4  # d-3 and d-4, once from stage spans, once from the inventory


def _request_from(resource: dict, spans: list) -> ExportTraceServiceRequest:
    from google.protobuf import json_format

    return json_format.ParseDict(
        {"resourceSpans": [{"resource": {"attributes": [
            {"key": k, "value": v} for k, v in resource.items()]}, "scopeSpans": [{"spans": spans}]}]},
        ExportTraceServiceRequest(),
    )


RESOURCE = {"pd.role": {"stringValue": "decode"}, "pd.instance": {"stringValue": "decode-0"},
            "service.instance.id": {"stringValue": "abc"}}
TRACE = "AAAAAAAAAAAAAAAAAAAAAQ=="  # 16 bytes, base64
SPAN = "AAAAAAAAAAE="  # 8 bytes


def test_unusable_spans_are_rejected_by_reason_and_change_nothing(tracker):
    cases = [
        ({"pd.role": {"stringValue": "decode"}}, {"name": "pd.heartbeat", "traceId": TRACE, "spanId": SPAN},
         "missing_attribute"),
        (RESOURCE, {"name": "pd.transferred", "traceId": TRACE, "spanId": SPAN}, "unknown_span"),
        (RESOURCE, {"name": "pd.request", "traceId": "AAAA", "spanId": SPAN}, "bad_id"),
        (RESOURCE, {"name": "pd.request", "traceId": TRACE, "spanId": SPAN}, "missing_attribute"),
        (RESOURCE, {"name": "pd.heartbeat", "traceId": TRACE, "spanId": SPAN, "attributes": [
            {"key": "pd.heartbeat.seq", "value": {"intValue": "1"}},
            {"key": "pd.open.total", "value": {"intValue": "2"}},
            {"key": "pd.open.trace_ids", "value": {"arrayValue": {"values": [{"stringValue": "a" * 32}] * 2}}},
            {"key": "pd.open.stages", "value": {"arrayValue": {"values": [{"stringValue": "transfer"}]}}},
            {"key": "pd.open.stage_since_unix_nano", "value": {"arrayValue": {"values": [{"intValue": "1"}] * 2}}},
        ]}, "bad_value"),
        (RESOURCE, {"name": "pd.heartbeat", "traceId": TRACE, "spanId": SPAN, "attributes": [
            {"key": "pd.heartbeat.seq", "value": {"intValue": "2"}},
            {"key": "pd.open.total", "value": {"intValue": "1"}},
            {"key": "pd.open.trace_ids", "value": {"arrayValue": {"values": [{"stringValue": "a" * 32}]}}},
            {"key": "pd.open.stages", "value": {"arrayValue": {"values": [{"stringValue": "prefill"}]}}},
            {"key": "pd.open.stage_since_unix_nano", "value": {"arrayValue": {"values": [{"intValue": "1"}]}}},
        ]}, "bad_value"),
    ]
    for resource, span, reason in cases:
        before = dict(tracker.rejected)
        rejected, messages = ingest(tracker, _request_from(resource, [span]))
        assert rejected == 1 and messages, (span["name"], reason)
        assert tracker.rejected[reason] == before[reason] + 1, (span, reason)
    assert tracker.open == {}
    assert tracker.heartbeats_received == 0


def test_spans_that_are_not_pdwatchs_are_counted_apart_never_rejected(tracker):
    """SGLang's own --enable-trace spans may reach the same endpoint: another resource, or other names."""
    foreign_resource = {"service.name": {"stringValue": "sglang"}}
    for resource, name in ((foreign_resource, "Req 1f2e"), (RESOURCE, "GET /generate")):
        assert ingest(tracker, _request_from(resource, [{"name": name, "traceId": TRACE, "spanId": SPAN}])) == (0, [])
    assert tracker.spans_foreign == 2 and tracker.spans_received == 2
    assert sum(tracker.rejected.values()) == 0 and tracker.open == {}


def test_probes_keep_their_own_traces_are_counted_apart_and_never_flow(tracker, engines, clock):
    """SGLang's warm-ups and health checks share room 0: each is its own trace, and never "others flowing"."""
    p = engines("prefill", "prefill-0")
    for i in range(3):
        p.walk(f"HEALTH_CHECK_{i}", 0, PREFILL_TO_TRANSFER, probe=True)
    p.rec.drain()
    hb = p.rec.heartbeat_attributes()
    assert hb[c.H_OPEN_PROBES] == [True, True, True]
    assert len(set(hb[c.H_OPEN_TRACE_IDS])) == 3 and tid(0) not in hb[c.H_OPEN_TRACE_IDS]
    for i in range(3):
        p.rec.finish(f"HEALTH_CHECK_{i}", "ok")
    p.send(tracker)
    assert tracker.probes_finished == {("default", "prefill", "prefill-0", "ok"): 3}
    assert tracker.finished == {}
    assert evaluate(tracker).flowing.get("default", False) is False
    # A real request's ok does flow.
    p.walk("p-1", 1, PREFILL_TO_TRANSFER)
    p.rec.finish("p-1", "ok")
    p.send(tracker)
    assert tracker.finished == {("default", "prefill", "prefill-0", "ok"): 1}
    assert evaluate(tracker).flowing["default"] is True
