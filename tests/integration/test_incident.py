"""The founding claim end to end: a real `pdwatch serve` process watching the
testbed (prefill and two decodes moving KV over real NIXL).

healthy and long-decode: nothing is ever stuck. decode-restart (the brief's
incident): exactly the hung legs are reported, stuck in transfer, within the
floor plus two heartbeats, while other requests keep completing.
"""

from __future__ import annotations

import time

import pytest

from pdwatch.testbed.sidecar_process import SidecarProcess

pytestmark = pytest.mark.integration

HEARTBEAT_S = 0.5
FLOOR_TRANSFER_S = 3.0
EVALUATE_S = 0.2


def sidecar(**floors) -> SidecarProcess:
    env = {"PDWATCH_EVALUATE_INTERVAL_S": str(EVALUATE_S), "PDWATCH_LOG_LEVEL": "warning", "PDWATCH_NVML": "off"}
    env.update({f"PDWATCH_FLOOR_{stage.upper()}_S": str(v) for stage, v in floors.items()})
    return SidecarProcess(env=env)


def ok_legs(sc) -> int:
    summary = sc.get("/api/v1/summary")
    return sum(v.get("ok", 0) for cl in summary["clusters"].values() for v in cl["finished"].values())


def watch(sc, seconds: float) -> tuple[list, int]:
    """Poll the stuck list for `seconds`; returns (every stuck report seen, legs finished ok at the end)."""
    seen = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen.extend(sc.get("/api/v1/stuck"))
        time.sleep(0.5)
    return seen, ok_legs(sc)


@pytest.mark.parametrize("scenario, floors", [
    ("healthy", {"transfer": FLOOR_TRANSFER_S}),
    # Generations run 4x the decode floor while producing tokens.
    ("long-decode", {"transfer": FLOOR_TRANSFER_S, "decode": 2.0}),
])
def test_healthy_traffic_is_never_stuck(scenario, floors):
    from pdwatch.testbed.stack import Stack

    with sidecar(**floors) as sc:
        stack = Stack(scenario, otlp_endpoint=sc.url, heartbeat_s=HEARTBEAT_S, rate=4.0,
                      decode_floor_s=floors.get("decode", 30.0), duration_s=14.0)
        try:
            stack.start()
            seen, ok = watch(sc, 14.0)
            truth = stack.truth()
        finally:
            stack.stop()
    assert seen == []
    assert ok >= 20, "the testbed should have completed requests"
    if scenario == "long-decode":
        longest = max(r.done_at - r.sent_at for r in truth.requests if r.done_at and r.outcome == "ok")
        assert longest > 4 * 2.0, f"some generation should outlast the decode floor by 4x (longest {longest:.1f} s)"


def test_decode_restart_names_exactly_the_hung_legs_while_others_flow():
    from pdwatch.testbed.stack import Stack

    restart_at = 3.0
    with sidecar(transfer=FLOOR_TRANSFER_S) as sc:
        stack = Stack("decode-restart", otlp_endpoint=sc.url, heartbeat_s=HEARTBEAT_S, rate=4.0,
                      restart_at=restart_at, duration_s=30.0)
        try:
            stack.start()
            deadline = time.monotonic() + 40
            stuck: list = []
            while time.monotonic() < deadline and not stuck:
                time.sleep(0.5)
                stuck = sc.get("/api/v1/stuck")
            assert stuck, "no leg was reported stuck"
            ok_at_detection = ok_legs(sc)
            time.sleep(FLOOR_TRANSFER_S + 4 * HEARTBEAT_S)
            stuck = sc.get("/api/v1/stuck")
            ok_later = ok_legs(sc)
            now = time.time()
            truth = stack.truth()
            details = {s["trace_id"]: sc.get(f"/api/v1/requests/{s['trace_id']}") for s in stuck}
        finally:
            stack.stop()

    hung = {r.trace_id: r for r in truth.outstanding_after_restart()}
    assert hung, "the restart should have hung some requests"
    by_trace: dict = {}
    for s in stuck:
        by_trace.setdefault(s["trace_id"], set()).add(s["role"])
        assert s["stage"] == "transfer", s
        assert s["others_flowing"] is True
        # Detected within the floor plus two heartbeats (and one evaluation tick).
        delay = s["stuck_since_unix_s"] - s["stage_since_unix_s"]
        assert delay <= FLOOR_TRANSFER_S + 2 * HEARTBEAT_S + EVALUATE_S + 0.5, s
    # Exactly the hung ones: nothing else reported, and both legs of every hung
    # request old enough to be past the floor by two heartbeats.
    assert set(by_trace) <= set(hung)
    margin = FLOOR_TRANSFER_S + 2 * HEARTBEAT_S + 1.0
    due = {t for t, r in hung.items() if now - r.sent_at > margin}
    assert due, "some hung request should be past the floor by now"
    assert due <= set(by_trace)
    for t in due:
        assert by_trace[t] == {"prefill", "decode"}
        assert hung[t].decode == "decode-0"
    # Both legs joined under one trace id, with the router's room.
    for t, detail in details.items():
        legs = {leg["role"]: leg for leg in detail["legs"]}
        assert legs.keys() == {"prefill", "decode"}
        assert legs["prefill"]["bootstrap_room"] == legs["decode"]["bootstrap_room"] == hung[t].room
    # Others keep flowing: requests routed to decode-1 finished after the detection.
    assert ok_later > ok_at_detection
    assert any(r.decode == "decode-1" and r.done_at and r.done_at > now - 3 for r in truth.requests)
