"""The testbed end to end: three engine processes, real NIXL DRAM transfers,
telemetry received by a tiny OTLP/HTTP receiver started here."""

from __future__ import annotations

import os

import pytest

from pdwatch import contract as c
from pdwatch.testbed.engine import BYTES_PER_TOKEN
from pdwatch.testbed.processes import EngineStartError
from pdwatch.testbed.stack import Stack
from tests.support.otlp_receiver import OtlpReceiver
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration


def assert_no_process_left(pids):
    for pid in pids.values():
        assert pid is not None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped: no such process
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)  # nothing left in its process group either


def legs_by_trace(sink: OtlpReceiver) -> dict[str, dict[str, object]]:
    out: dict[str, dict] = {}
    for s in sink.named(c.SPAN_LEG):
        out.setdefault(s.trace_id, {})[s.attrs[c.A_ROLE]] = s
    return out


def inventory(sink: OtlpReceiver, instance: str) -> dict[str, str]:
    hb = sink.last_heartbeat(instance)
    if hb is None:
        return {}
    return dict(zip(hb.attrs.get(c.H_OPEN_TRACE_IDS, []), hb.attrs.get(c.H_OPEN_STAGES, [])))


def test_healthy_moves_and_checks_kv_bytes_and_joins_both_legs_by_traceparent():
    with OtlpReceiver() as sink:
        stack = Stack("healthy", otlp_endpoint=sink.url, heartbeat_s=0.5, rate=4.0, duration_s=3.0, seed=3,
                      traceparent=True)
        try:
            stack.start()
            wait_for(lambda: stack.load_done and not stack.truth().open, 30, "every request to finish")
            reqs = stack.truth().requests
            assert len(reqs) >= 4
            assert {r.decode for r in reqs} == {"decode-0", "decode-1"}  # round robin
            for r in reqs:
                assert (r.outcome, r.reason) == ("ok", None)
                assert r.tokens == r.max_tokens
                # kv_bytes is reported only after the decode compared them with the prefill's pattern
                assert r.kv_bytes == r.prompt_tokens * BYTES_PER_TOKEN
            total = sum(r.kv_bytes for r in reqs)

            def checked():
                beats = [sink.last_heartbeat(d) for d in ("decode-0", "decode-1")]
                return all(beats) and sum(b.attrs.get("pd.engine.kv_bytes_checked", 0) for b in beats) == total

            wait_for(checked, 10, f"decode heartbeats to report {total} KV bytes checked")
            wait_for(lambda: sum(len(v) for t, v in legs_by_trace(sink).items()
                                 if t in {r.trace_id for r in reqs}) == 2 * len(reqs), 10, "both leg spans")
            legs = legs_by_trace(sink)
            transfers = {(s.trace_id, s.attrs[c.A_ROLE]): s for s in sink.named(c.stage_span_name("transfer"))}
            for r in reqs:
                assert r.trace_id == r.traceparent.split("-")[1]
                pair = legs[r.trace_id]
                assert set(pair) == {"prefill", "decode"}
                for role, span in pair.items():
                    assert span.attrs[c.A_OUTCOME] == "ok"
                    assert span.attrs[c.A_ROOM] == r.room
                    assert span.parent_span_id == r.traceparent.split("-")[2]
                    xfer = transfers[(r.trace_id, role)]
                    assert xfer.attrs[c.A_XFER_BYTES] == r.kv_bytes
                    assert xfer.attrs[c.A_XFER_BACKEND] == "nixl"
                assert pair["prefill"].resource[c.R_INSTANCE] == "prefill-0"
                assert pair["decode"].resource[c.R_INSTANCE] == r.decode
        finally:
            stack.stop()
        assert_no_process_left(stack.pids())


def test_decode_restart_hangs_exactly_the_restarted_decodes_new_requests():
    with OtlpReceiver() as sink:
        stack = Stack("decode-restart", otlp_endpoint=sink.url, heartbeat_s=0.5, rate=5.0, restart_at=2.0,
                      duration_s=25.0, seed=5)
        try:
            stack.start()
            seen: list[dict] = []

            def restarted():
                seen.extend(stack.poll_events())
                return next((e for e in seen if e["event"] == "restart"), None)

            restart = wait_for(restarted, 30, "the restart")
            assert restart["instance"] == "decode-0" and restart["new_agent"] != restart["old_agent"]
            ready_at = restart["t"] + restart["ready_after_s"]

            def enough_traffic():
                truth = stack.truth()
                late = [r for r in truth.requests if r.sent_at > ready_at + 0.5]
                return (sum(r.decode == "decode-0" for r in late) >= 3
                        and sum(r.decode == "decode-1" and r.outcome == "ok" for r in late) >= 3)

            wait_for(enough_traffic, 30, "requests to both decodes after the restart")
            stack.stop_load()

            def settled():
                truth = stack.truth()
                return {r.index for r in truth.open} == {r.index for r in truth.outstanding_after_restart()}

            wait_for(settled, 15, "everything but the hung requests to finish")
            truth = stack.truth()
            hung = truth.outstanding_after_restart()
            assert len(hung) >= 2
            assert all(r.decode == "decode-0" and r.sent_at >= restart["t"] for r in hung)
            later_d0 = [r for r in truth.requests if r.decode == "decode-0" and r.sent_at > ready_at + 0.5]
            assert later_d0 and all(r.outcome is None for r in later_d0)  # every one of them hangs
            later_d1 = [r for r in truth.requests if r.decode == "decode-1" and r.sent_at > restart["t"]]
            assert len(later_d1) >= 2 and all(r.outcome == "ok" for r in later_d1)  # while the others flow

            # Both legs of each hung request sit in `transfer` in the last heartbeat inventories.
            want = {r.trace_id: "transfer" for r in hung}
            wait_for(lambda: (inventory(sink, "prefill-0") == want and inventory(sink, "decode-0") == want
                              and inventory(sink, "decode-1") == {}), 10,
                     "heartbeat inventories listing exactly the hung requests")
            for r in hung:
                assert r.trace_id == f"{c.room_trace_id(r.room):032x}"  # no traceparent: joined by the room
            incarnations = {s.resource[c.R_INSTANCE_ID] for s in sink.heartbeats("decode-0")}
            assert len(incarnations) == 2  # same pd.instance, new service.instance.id
            prefill_hb = sink.last_heartbeat("prefill-0")
            assert prefill_hb.attrs.get("pd.engine.kv_transfer_errors", 0) >= len(hung)
            assert prefill_hb.attrs[c.H_LOOP] > 0
            assert any("KV transfer of room" in line for line in stack.logs("prefill-0", 400))
        finally:
            stack.stop()
        assert_no_process_left(stack.pids())


def test_long_decode_keeps_producing_tokens_past_four_floors():
    floor = 0.5
    with OtlpReceiver() as sink:
        stack = Stack("long-decode", otlp_endpoint=sink.url, heartbeat_s=0.25, rate=4.0, duration_s=2.0, seed=2,
                      decode_floor_s=floor)
        try:
            stack.start()
            wait_for(lambda: stack.load_done and not stack.truth().open, 30, "every request to finish")
            reqs = stack.truth().requests
            long = [r for r in reqs if r.max_tokens * stack.params.token_interval_s >= 4 * floor]
            assert long and all(r.outcome == "ok" for r in reqs)
            for r in long:
                assert r.tokens == r.max_tokens
                # A token per step, never faster: the first comes out on entering the batch, the
                # last max_tokens - 1 steps later.
                assert r.done_at - r.sent_at >= (r.max_tokens - 1) * stack.params.token_interval_s
                seen = [dict(zip(hb.attrs.get(c.H_OPEN_TRACE_IDS, []), hb.attrs.get(c.H_OPEN_TOKENS, [])))
                        .get(r.trace_id) for hb in sorted(sink.heartbeats(r.decode), key=lambda s: s.end_ns)]
                counts = [n for n in seen if n]
                assert len(counts) >= 3 and counts == sorted(counts) and len(set(counts)) == len(counts)
        finally:
            stack.stop()
        assert_no_process_left(stack.pids())


def test_start_failure_raises_clearly_and_leaves_no_process():
    stack = Stack("healthy", otlp_endpoint="http://127.0.0.1:9", ready_timeout_s=0.05, stop_timeout_s=2.0)
    with pytest.raises(EngineStartError, match="not ready"):
        stack.start()
    assert_no_process_left(stack.pids())


def test_cli_runs_a_bounded_scenario_and_reports_what_the_router_saw(capsys):
    from pdwatch.testbed import cli

    with OtlpReceiver() as sink:
        rc = cli.main(["--scenario", "healthy", "--otlp-endpoint", sink.url, "--rate", "4", "--duration-s", "2",
                       "--heartbeat-s", "0.5", "--drain-s", "10"])
    out = capsys.readouterr().out
    assert rc == 0
    done = [line for line in out.splitlines() if line.startswith("done: ")]
    assert done, out
    sent, ok = int(done[0].split()[1]), int(done[0].split()[3])
    assert sent >= 2 and ok == sent and "0 still open" in done[0]
    assert "--- ready:" in out
    assert {s.resource[c.R_INSTANCE] for s in sink.named(c.SPAN_HEARTBEAT)} == {"prefill-0", "decode-0", "decode-1"}
