"""The recorder: its hot path, its open-leg table, and the OTLP spans it exports (read back from their bytes)."""

from __future__ import annotations

import hashlib
import socket
import time

import pytest
from opentelemetry.trace import SpanKind, StatusCode

from pdwatch import contract as c
from pdwatch.engine_patches.recorder import Recorder, RecorderConfig
from tests.support.otlp_spans import KeptSpans


class FakeClock:
    def __init__(self, start_ns=1_700_000_000_000_000_000):
        self.now = start_ns

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += int(seconds * 1e9)


def make(role="prefill", transport=None, **kw):
    kept = KeptSpans()
    clock = kw.pop("clock", FakeClock())
    cfg = RecorderConfig(role=role, instance=f"{role}-0", heartbeat_s=kw.pop("heartbeat_s", 0.1), **kw)
    return Recorder(cfg, transport=transport or kept.transport, clock=clock, environ={}), kept, clock


def spans_by_name(exporter):
    out = {}
    for s in exporter.get_finished_spans():
        out.setdefault(s.name, []).append(s)
    return out


def test_both_legs_of_a_room_share_the_contract_trace_id():
    room = 8472615
    expected = int.from_bytes(hashlib.sha256(f"pdwatch:{room}".encode()).digest()[:16], "big")
    ids = []
    for role, rid in (("prefill", "p-1"), ("decode", "d-1")):
        rec, exp, clock = make(role)
        rec.arrive(rid, bootstrap_room=room)
        rec.enter(rid, "bootstrap")
        clock.advance(0.5)
        rec.finish(rid, "ok")
        rec.flush()
        (leg,) = spans_by_name(exp)["pd.request"]
        ids.append(leg.context.trace_id)
        assert leg.parent is None
        rec.shutdown()
    assert ids == [expected, expected]


def test_a_room_key_and_a_first_stage_in_one_arrival_give_the_same_spans_as_two_calls():
    """vLLM's hot path: the room hashed from a key on the worker thread, the first stage in the arrival's
    record. Both legs of a key share the trace the contract gives the hashed room."""
    key = "cmpl-4f2a-0"
    room = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") & (2**63 - 1)
    got = []
    for one_record in (True, False):
        rec, exp, clock = make("prefill")
        t0 = clock.now
        if one_record:
            rec.arrive("p-1", room_key=key, prompt_tokens=40, stage="queued")
        else:
            rec.arrive("p-1", bootstrap_room=room, prompt_tokens=40)
            rec.enter("p-1", "queued")
        clock.advance(1)
        rec.finish("p-1", "ok")
        rec.flush()
        spans = spans_by_name(exp)
        (leg,), (queued,) = spans["pd.request"], spans[c.stage_span_name("queued")]
        assert queued.start_time == t0 and queued.parent.span_id == leg.context.span_id
        got.append((leg.context.trace_id, leg.attributes[c.A_ROOM], leg.attributes[c.A_PROMPT_TOKENS],
                    queued.end_time - queued.start_time))
        rec.shutdown()
    assert got[0] == got[1]
    assert got[0][0] == c.room_trace_id(room) and got[0][1] == room


def test_traceparent_wins_and_becomes_the_parent():
    rec, exp, _ = make("decode")
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    rec.arrive("d-7", bootstrap_room=5, traceparent=tp)
    rec.enter("d-7", "bootstrap")
    rec.finish("d-7", "ok")
    rec.flush()
    (leg,) = spans_by_name(exp)["pd.request"]
    assert f"{leg.context.trace_id:032x}" == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert f"{leg.parent.span_id:016x}" == "00f067aa0ba902b7"
    assert leg.kind is SpanKind.SERVER


def test_stage_spans_are_children_with_recorded_times_and_attributes():
    rec, exp, clock = make("prefill")
    t0 = clock.now
    rec.arrive("p-1", bootstrap_room=77, prompt_tokens=128, peer="decode-0")
    rec.enter("p-1", "bootstrap")
    clock.advance(1)
    rec.enter("p-1", "queued")
    clock.advance(2)
    rec.enter("p-1", "prefill")
    clock.advance(3)
    rec.enter("p-1", "transfer")
    rec.transfer_info("p-1", nbytes=4096, backend="nixl")
    clock.advance(4)
    rec.finish("p-1", "ok")
    rec.flush()
    by = spans_by_name(exp)
    leg = by["pd.request"][0]
    assert leg.start_time == t0 and leg.end_time == t0 + 10 * 10**9
    assert leg.attributes["pd.outcome"] == "ok"
    assert leg.attributes["pd.prompt_tokens"] == 128
    assert leg.attributes["pd.peer"] == "decode-0"
    assert leg.status.status_code is StatusCode.UNSET
    order = ["pd.bootstrap", "pd.queued", "pd.prefill", "pd.transfer"]
    starts = [by[name][0].start_time for name in order]
    ends = [by[name][0].end_time for name in order]
    assert starts == [t0, t0 + 1e9, t0 + 3e9, t0 + 6e9]
    assert ends[:-1] == starts[1:]  # the end of one stage is the start of the next
    for name in order:
        s = by[name][0]
        assert s.parent.span_id == leg.context.span_id
        assert s.context.trace_id == leg.context.trace_id
        assert s.kind is SpanKind.INTERNAL
        assert s.attributes["pd.stage"] == name[3:]
        assert s.attributes["pd.rid"] == "p-1" and s.attributes["pd.bootstrap_room"] == 77
    xfer = by["pd.transfer"][0].attributes
    assert xfer["pd.transfer.bytes"] == 4096 and xfer["pd.transfer.backend"] == "nixl"


def test_the_process_transfer_backend_names_every_transfer_unless_one_says_otherwise():
    # The engine's backend is set once; a transfer that recorded its own detail keeps it.
    rec, exp, clock = make("decode", transfer_backend="nixl")
    for rid, room in (("d-1", 1), ("d-2", 2)):
        rec.arrive(rid, bootstrap_room=room)
        rec.enter(rid, "bootstrap")
        rec.enter(rid, "transfer")
    rec.transfer_info("d-2", backend="mooncake", nbytes=512)
    clock.advance(1.0)
    for rid in ("d-1", "d-2"):
        rec.enter(rid, "queued")
    rec.flush()
    got = {s.attributes["pd.rid"]: dict(s.attributes) for s in spans_by_name(exp)["pd.transfer"]}
    assert got["d-1"]["pd.transfer.backend"] == "nixl" and "pd.transfer.bytes" not in got["d-1"]
    assert got["d-2"]["pd.transfer.backend"] == "mooncake" and got["d-2"]["pd.transfer.bytes"] == 512
    assert not any("pd.transfer.backend" in s.attributes for s in spans_by_name(exp)["pd.bootstrap"])


def test_failure_marks_stage_and_leg_as_errors_with_the_reason():
    rec, exp, clock = make("decode")
    rec.arrive("d-1", bootstrap_room=1)
    rec.enter("d-1", "bootstrap")
    rec.enter("d-1", "transfer")
    clock.advance(1)
    rec.finish("d-1", "failed", reason="KV transfer failed: remote disconnect")
    rec.flush()
    by = spans_by_name(exp)
    leg, xfer, boot = by["pd.request"][0], by["pd.transfer"][0], by["pd.bootstrap"][0]
    assert leg.status.status_code is StatusCode.ERROR
    assert "remote disconnect" in leg.status.description
    assert leg.attributes["pd.outcome"] == "failed"
    assert xfer.status.status_code is StatusCode.ERROR
    assert boot.status.status_code is StatusCode.UNSET


def test_heartbeat_lists_open_legs_oldest_first_and_counts_all():
    rec, exp, clock = make("decode", inventory_max=2)
    for i in range(3):
        rec.arrive(f"d-{i}", bootstrap_room=100 + i)
        rec.enter(f"d-{i}", "bootstrap")
        clock.advance(1)
    rec.enter("d-0", "transfer")  # now the newest stage entry
    clock.advance(1)
    rec.enter("d-1", "transfer")
    rec.enter("d-1", "queued")
    rec.enter("d-1", "decode")
    rec.token("d-1", 5)
    rec.loop_tick()
    rec.loop_tick()
    rec.drain()
    rec.heartbeat()
    rec.flush()
    (hb,) = spans_by_name(exp)["pd.heartbeat"]
    a = hb.attributes
    assert a["pd.open.total"] == 3  # even though the lists are cut to 2
    assert a["pd.open.count.bootstrap"] == 1 and a["pd.open.count.transfer"] == 1
    assert a["pd.open.count.decode"] == 1 and a["pd.open.count.queued"] == 0
    assert list(a["pd.open.rids"]) == ["d-2", "d-0"]
    assert list(a["pd.open.stages"]) == ["bootstrap", "transfer"]
    since = list(a["pd.open.stage_since_unix_nano"])
    assert since == sorted(since)
    assert all(len(t) == 32 for t in a["pd.open.trace_ids"])
    assert all(len(s) == 16 for s in a["pd.open.span_ids"])
    assert a["pd.loop.iterations"] == 2 and a["pd.tokens.generated"] == 5
    assert a["pd.heartbeat.seq"] == 1 and a["pd.heartbeat.interval_s"] == 0.1
    assert hb.parent is None


def test_heartbeat_says_when_each_listed_leg_last_produced_a_token():
    rec, exp, clock = make("decode")
    for rid in ("d-0", "d-1"):
        rec.arrive(rid, bootstrap_room=int(rid[-1]))
        rec.enter(rid, "decode")
    rec.token("d-1", 3)
    rec.drain()  # tokens take the drain's time: no clock read on the hottest hook
    drained_at = clock()
    clock.advance(5)
    rec.heartbeat()
    rec.flush()
    (hb,) = spans_by_name(exp)["pd.heartbeat"]
    a = hb.attributes
    last = dict(zip(a["pd.open.rids"], a["pd.open.last_token_unix_nano"]))
    assert last == {"d-0": 0, "d-1": drained_at}
    assert dict(zip(a["pd.open.rids"], a["pd.open.tokens"])) == {"d-0": 0, "d-1": 3}


def test_inventory_span_ids_name_the_leg_span_that_ends_later():
    rec, exp, _ = make("prefill")
    rec.arrive("p-1", bootstrap_room=9)
    rec.enter("p-1", "bootstrap")
    rec.drain()
    rec.heartbeat()
    rec.finish("p-1", "ok")
    rec.flush()
    by = spans_by_name(exp)
    assert by["pd.heartbeat"][0].attributes["pd.open.span_ids"][0] == f"{by['pd.request'][0].context.span_id:016x}"


def test_non_owner_rank_sends_heartbeats_only():
    rec, exp, _ = make("decode", tp_rank=1, tp_size=2)
    rec.arrive("d-1", bootstrap_room=3)
    rec.enter("d-1", "bootstrap")
    rec.finish("d-1", "ok")
    rec.drain()
    rec.heartbeat()
    rec.flush()
    by = spans_by_name(exp)
    assert set(by) == {"pd.heartbeat"}
    assert "pd.open.total" not in by["pd.heartbeat"][0].attributes
    assert by["pd.heartbeat"][0].resource.attributes["pd.tp_rank"] == 1


def test_resource_carries_the_contract_attributes():
    rec, exp, _ = make("decode", cluster="c1", gpu_uuids=("GPU-1",), peer_ids=("agent-7f", "10.0.0.5:8998"))
    rec.heartbeat()
    rec.flush()
    res = exp.get_finished_spans()[0].resource.attributes
    assert res["pd.cluster"] == "c1" and res["pd.role"] == "decode" and res["pd.instance"] == "decode-0"
    assert res["service.instance.id"] == rec.instance_id and res["process.pid"] > 0
    assert res["pd.start_time_unix_nano"] == rec.start_ns
    assert list(res["pd.gpu.uuids"]) == ["GPU-1"]
    assert list(res["pd.peer_ids"]) == ["agent-7f", "10.0.0.5:8998"]
    rec.shutdown()


def test_resource_declares_the_schedule_policy_only_when_the_engine_says_it():
    said, exp, _ = make("prefill", schedule_policy="fcfs")
    silent, exp_silent, _ = make("prefill")
    for rec in (said, silent):
        rec.heartbeat()
        rec.flush()
    assert exp.get_finished_spans()[0].resource.attributes["pd.schedule_policy"] == "fcfs"
    assert "pd.schedule_policy" not in exp_silent.get_finished_spans()[0].resource.attributes
    for rec in (said, silent):
        rec.shutdown()


def test_an_error_that_does_not_end_a_leg_is_listed_until_the_leg_ends():
    rec, exp, clock = make("prefill")
    for rid in ("p-1", "p-2"):
        rec.arrive(rid, bootstrap_room=int(rid[-1]))
        rec.enter(rid, "transfer")
    rec.leg_error("p-1", "NIXL_ERR_NOT_FOUND writing to agent a1")
    rec.leg_error("p-9", "a leg it never saw")  # nothing to attach it to: ignored, not raised
    rec.drain()
    hb = rec.heartbeat_attributes()
    errors = dict(zip(hb["pd.open.rids"], hb["pd.open.errors"]))
    assert errors == {"p-1": "NIXL_ERR_NOT_FOUND writing to agent a1", "p-2": ""}
    rec.finish("p-1", "failed", reason="kv transfer failed")
    rec.drain()
    assert rec.heartbeat_attributes()["pd.open.errors"] == [""]
    assert rec.stats()["worker_errors"] == 0 and rec.hook_errors == 0
    rec.shutdown()


def test_an_error_on_a_leg_that_ends_ok_stays_on_its_leg_span():
    """vLLM's read after the lease: the decode records the error and the request still ends ok."""
    rec, exp, _clock = make("decode")
    rec.arrive("d-1", bootstrap_room=1, stage="bootstrap")
    rec.leg_error("d-1", "read after the lease")
    rec.arrive("d-2", bootstrap_room=2, stage="bootstrap")
    for rid in ("d-1", "d-2"):
        rec.finish(rid, "ok")
    rec.flush()
    legs = {s.attributes[c.A_RID]: s for s in spans_by_name(exp)["pd.request"]}
    assert legs["d-1"].attributes[c.A_LEG_ERROR] == "read after the lease"
    assert legs["d-1"].status.status_code is StatusCode.UNSET  # it ended ok: the error is said, not the outcome
    assert c.A_LEG_ERROR not in legs["d-2"].attributes
    rec.shutdown()


def test_hot_path_never_raises_and_counts_errors():
    calls = []

    def broken_clock():  # works once, for the recorder's start time
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("clock gone")
        return 1

    rec, _, _ = make("prefill", clock=broken_clock)
    rec.arrive("p-1")
    rec.enter("p-1", "queued")
    rec.finish("p-1")
    assert rec.hook_errors == 3


def test_bad_records_are_counted_by_the_worker_not_raised():
    rec, exp, _ = make("prefill")
    rec.enter(["unhashable"], "queued")
    rec.enter("p-1", "no-such-stage")
    rec.arrive("p-2", bootstrap_room=1)
    rec.enter("p-2", "bootstrap")
    rec.finish("p-2", "ok")
    rec.flush()
    assert rec.worker_errors == 1
    assert rec.legs.unknown_stage == 1
    assert len(spans_by_name(exp)["pd.request"]) == 1


def test_full_buffer_drops_new_records_and_counts_them():
    rec, _, _ = make("prefill", buffer_max=10)
    for i in range(25):
        rec.enter(f"p-{i}", "queued")
    assert rec.dropped == 15
    assert rec.drain() == 10


class CountingTransport:
    def __init__(self):
        self.posted = 0

    def post(self, body):
        self.posted += 1

    def close(self):
        pass


def test_export_queue_is_bounded_and_overflow_counted():
    counting = CountingTransport()
    rec, _, _ = make("prefill", transport=counting, max_export_queue=8)
    for i in range(50):
        rec.arrive(f"p-{i}", bootstrap_room=i)
        rec.enter(f"p-{i}", "queued")
        rec.finish(f"p-{i}", "ok")
    rec.drain()  # nothing posted yet: the queue fills, then refuses
    assert (rec.export.waiting, rec.export.dropped) == (8, 100 - 8)  # 50 legs of two spans each
    assert rec.heartbeat_attributes()[c.H_QUEUE_DROPPED] == 92  # the queue alone
    assert rec.heartbeat_attributes()["pd.recorder.spans_dropped"] == 92  # nothing dropped on the hot path
    assert rec.flush(timeout_s=5)
    assert counting.posted == 1 and rec.export.sent == rec.export.taken == 8 and rec.export.waiting == 0
    rec.heartbeat()  # room again
    assert rec.flush(timeout_s=5) and rec.export.sent == 9
    rec.shutdown()


def closed_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens here now
    return port


def test_sidecar_down_counts_failures_and_shutdown_is_bounded():
    cfg = RecorderConfig(
        role="decode",
        instance="decode-0",
        heartbeat_s=0.05,
        endpoint=f"http://127.0.0.1:{closed_port()}",
        export_timeout_s=0.5,
    )
    rec = Recorder(cfg, environ={}).start()
    for i in range(20):
        rec.arrive(f"d-{i}", bootstrap_room=i)
        rec.enter(f"d-{i}", "bootstrap")
        rec.finish(f"d-{i}", "ok")
    deadline = time.monotonic() + 10
    while rec.export.failed_spans == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rec.export.failed_spans > 0
    t = time.monotonic()
    rec.shutdown(timeout_s=1)
    assert time.monotonic() - t < 8


def test_config_from_environment_and_validation():
    cfg = RecorderConfig(role="decode").resolved(
        {"PDWATCH_CLUSTER": "blue", "PDWATCH_INSTANCE": "decode-3", "PDWATCH_HEARTBEAT_S": "0.5",
         "PDWATCH_INVENTORY_MAX": "10", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9/"}
    )
    assert (cfg.cluster, cfg.instance, cfg.heartbeat_s, cfg.inventory_max) == ("blue", "decode-3", 0.5, 10)
    assert cfg.endpoint == "http://127.0.0.1:9"
    # The stable default name: the server's address, never a PID (a restart keeps it).
    served = RecorderConfig(role="decode", server_address="10.0.0.7:30001", pid=4242).resolved({})
    assert served.instance == "10.0.0.7:30001"
    unnamed = RecorderConfig(role="decode", pid=4242, host="node-3").resolved({})
    assert unnamed.instance == "node-3:decode" and "4242" not in unnamed.instance
    with pytest.raises(ValueError, match="PDWATCH_HEARTBEAT_S"):
        RecorderConfig(role="decode").resolved({"PDWATCH_HEARTBEAT_S": "soon"})
    with pytest.raises(ValueError, match="role"):
        RecorderConfig(role="router").resolved({})


def test_heartbeats_say_how_much_cpu_the_recorder_thread_used_and_only_its_own():
    kept = KeptSpans()
    cfg = RecorderConfig(role="prefill", instance="prefill-0", heartbeat_s=0.05, drain_interval_s=0.05)
    rec = Recorder(cfg, transport=kept.transport, environ={}).start()
    try:
        def beats():
            return [s.attributes["pdwatch.recorder.worker_cpu_s"] for s in spans_by_name(kept).get("pd.heartbeat", [])]

        # CPU burnt on this (the engine's) thread is not the worker's.
        spin_until = time.thread_time() + 0.4
        while time.thread_time() < spin_until:
            pass
        time.sleep(0.2)
        idle = rec.worker_cpu_s
        assert 0 < idle < 0.2
        # Spans to build: the worker's figure grows, and heartbeats carry it.
        for i in range(3000):
            rec.arrive(f"p-{i}", bootstrap_room=i)
            rec.enter(f"p-{i}", "queued")
            rec.finish(f"p-{i}", "ok")
        deadline = time.monotonic() + 10
        while rec.legs.completed < 3000 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert rec.worker_cpu_s > idle
        seen = beats()
        assert seen == sorted(seen) and seen[-1] > idle
        assert seen[-1] <= time.process_time()
    finally:
        rec.shutdown()


def test_heartbeats_carry_the_engines_gauges_and_a_failing_gauge_costs_only_its_field():
    readings = iter([{"pd.engine.kv_used_ratio": 0.25}, RuntimeError("pool gone"), {"pd.engine.kv_used_ratio": 1}])

    def gauges():
        value = next(readings)
        if isinstance(value, Exception):
            raise value
        return value

    rec, exp, _ = make("decode", gauges=gauges)
    for _ in range(3):
        rec.heartbeat()
    rec.flush()
    beats = [dict(s.attributes) for s in spans_by_name(exp)["pd.heartbeat"]]
    assert [b.get("pd.engine.kv_used_ratio") for b in beats] == [0.25, None, 1.0]
    # The beat is still sent, and counts the error (the gauges are read before the heartbeat is built).
    assert [b["pdwatch.recorder.worker_errors"] for b in beats] == [0, 1, 1]
    assert all(isinstance(b["pd.engine.kv_used_ratio"], float) for b in beats if "pd.engine.kv_used_ratio" in b)


class RefusingTransport:
    """A sidecar that answers every export with an error: each post fails."""

    def post(self, body):
        raise OSError("connection refused")

    def close(self):
        pass


def test_heartbeats_carry_the_engine_sides_health_under_the_contracts_names():
    """v1.2: pd.recorder.spans_dropped counts the export queue's drops and the hot-path buffer's,
    pd.recorder.exports_failed the spans of undelivered exports, pd.recorder.hook_errors the hooks'."""
    rec, _, _ = make("prefill", transport=RefusingTransport(), max_export_queue=4, buffer_max=40)
    for i in range(20):  # 60 records into a buffer of 40: 20 dropped on the hot path
        rec.arrive(f"p-{i}", bootstrap_room=i)
        rec.enter(f"p-{i}", "queued")
        rec.finish(f"p-{i}", "ok")
    rec.drain()  # the records left make 26 spans (13 legs, 2 each), into a queue of 4
    hb = rec.heartbeat_attributes()
    assert rec.dropped == 20 and rec.export.dropped == 26 - 4
    assert hb["pd.recorder.spans_dropped"] == 20 + 22
    assert hb["pdwatch.recorder.dropped"] == 20 and hb[c.H_QUEUE_DROPPED] == 22
    assert hb["pd.recorder.exports_failed"] == 0
    rec.flush(timeout_s=1)  # the export fails: its 4 spans are counted, not retried forever
    assert rec.heartbeat_attributes()["pd.recorder.exports_failed"] == rec.export.failed_spans == 4
    rec.hook_errors += 2  # what a hook's except clause does
    assert rec.heartbeat_attributes()["pd.recorder.hook_errors"] == 2
    rec.shutdown(timeout_s=0.5)


def test_heartbeats_say_the_plugin_state_and_what_it_refused():
    default, _, _ = make("decode")
    partial, _, _ = make("decode", plugin_state="partial",
                         plugin_refused=("DecodeTransferQueue.pop_transferred: parameter 'rids_to_check' missing",))
    hb = default.heartbeat_attributes()
    assert hb["pd.plugin.state"] == "active" and "pd.plugin.refused" not in hb
    hb = partial.heartbeat_attributes()
    assert hb["pd.plugin.state"] == "partial"
    assert hb["pd.plugin.refused"] == ["DecodeTransferQueue.pop_transferred: parameter 'rids_to_check' missing"]
    with pytest.raises(ValueError, match="plugin_state"):
        RecorderConfig(role="decode", plugin_state="half").resolved({})
    for rec in (default, partial):
        rec.shutdown()


def test_idle_turn_is_sent_under_the_contracts_name_only():
    rec, _, _ = make("decode", loop_idle_turn_s=0.5)
    hb = rec.heartbeat_attributes()
    assert hb["pd.loop.idle_turn_s"] == 0.5 and "pdwatch.loop.idle_turn_s" not in hb
    rec.shutdown()


def test_resource_names_the_pdwatch_distribution_and_its_version():
    from pdwatch import contract

    rec, exp, _ = make("decode")
    rec.heartbeat()
    rec.flush()
    res = exp.get_finished_spans()[0].resource.attributes
    assert res["telemetry.distro.name"] == "pdwatch"
    assert res["telemetry.distro.version"] == contract.package_version() != ""
    rec.shutdown()
