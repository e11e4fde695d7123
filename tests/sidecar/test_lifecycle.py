"""The instance lifecycle (contract section 5, v1.2): an instance that leaves in order (its final
heartbeat) departs, its open legs end lost and nothing is raised; one that falls silent is down, its
own legs are no longer judged, what it held is counted, and it is forgotten after
PDWATCH_DOWN_FORGET_S with its legs lost. Real recorders, the real judge, the real metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from pdwatch import contract as c
from pdwatch.sidecar.diagnosis.classify import classify
from pdwatch.sidecar.diagnosis.from_evaluation import gather
from pdwatch.sidecar.metrics import EvaluationCollector
from tests.support.tracking import evaluate, new_tracker

PREFILL = ("bootstrap", "queued", "prefill", "transfer")


def tid(room: int) -> str:
    return f"{c.room_trace_id(room):032x}"


def exposition(ev) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EvaluationCollector(lambda: ev))
    return generate_latest(registry).decode()


def states(ev) -> dict[str, str]:
    return {i.name: i.state for i in ev.instances}


def test_a_final_heartbeat_departs_the_instance_its_legs_lost_never_stuck_nothing_raised(engines, clock):
    tracker = new_tracker(clock=clock)
    p, d = engines("prefill", "prefill-0"), engines("decode", "decode-0")
    p.walk("p-1", 1, PREFILL)
    d.walk("d-1", 1, ("bootstrap", "transfer"))
    p.send(tracker)
    d.send(tracker)
    assert states(evaluate(tracker)) == {"prefill-0": c.STATE_UP, "decode-0": c.STATE_UP}
    # decode-0 is scaled down: SIGTERM, the recorder's last heartbeat is final and lists what is open.
    d.rec.shutdown(timeout_s=1)
    d.send(tracker, heartbeat=False)
    ev = evaluate(tracker)
    assert states(ev)["decode-0"] == c.STATE_DEPARTED
    assert tracker.closed[(tid(1), "decode")].outcome == c.OUTCOME_LOST
    assert (tid(1), "decode") not in tracker.open
    for _ in range(40):  # long past every floor and the down rule: nothing about decode-0 is stuck or silent
        clock.advance(1)
        p.send(tracker)
    ev = evaluate(tracker)
    assert states(ev)["decode-0"] == c.STATE_DEPARTED
    assert not [s for s in ev.stuck if s.pd_instance == "decode-0"]
    assert "engine_silent" not in [f.family for f in classify(gather(ev)[0])]
    text = exposition(ev)
    assert 'pdwatch_instance_state{pd_cluster="default",pd_instance="decode-0",role="decode",state="departed"} 1.0' in text
    assert 'pdwatch_instance_state{pd_cluster="default",pd_instance="decode-0",role="decode",state="down"} 0.0' in text
    assert 'pdwatch_instance_open_at_silence{pd_cluster="default",pd_instance="decode-0",role="decode"} 0.0' in text
    # The prefill leg that talked to it is its own business: it still waits, on the threshold here (no peer).
    assert [(s.role, s.reason) for s in ev.stuck] == [("prefill", c.REASON_THRESHOLD)]


def test_a_restart_after_departing_raises_nothing_while_the_new_process_loads(engines, clock):
    tracker = new_tracker(clock=clock)
    d = engines("decode", "decode-0")
    d.send(tracker)
    d.rec.shutdown(timeout_s=1)
    d.send(tracker, heartbeat=False)
    clock.advance(180)  # minutes of loading weights
    assert states(evaluate(tracker)) == {"decode-0": c.STATE_DEPARTED}
    engines("decode", "decode-0").send(tracker)  # the new process under the same name
    ev = evaluate(tracker)
    assert states(ev) == {"decode-0": c.STATE_UP} and ev.instances[0].restarts == 1


def test_a_silent_instance_is_down_its_legs_unjudged_counted_then_forgotten_as_lost(engines, clock):
    tracker = new_tracker(clock=clock, down_forget_s=600)
    p, d = engines("prefill", "prefill-0"), engines("decode", "decode-0")
    for room in (1, 2, 3):
        d.walk(f"d-{room}", room, ("bootstrap", "transfer"))
    p.send(tracker)
    d.send(tracker)
    for _ in range(20):  # decode-0 is killed (no final heartbeat); the prefill heartbeats on
        clock.advance(1)
        p.send(tracker)
    ev = evaluate(tracker)
    (down,) = [i for i in ev.instances if i.name == "decode-0"]
    assert (down.state, down.up, down.open_at_silence) == (c.STATE_DOWN, False, 3)
    assert not ev.stuck  # 20 s in transfer, past the 15 s floor: not judged, the silent engine is the page
    assert [f.family for f in classify(gather(ev)[0])][:1] == ["engine_silent"]
    assert 'pdwatch_instance_open_at_silence{pd_cluster="default",pd_instance="decode-0",role="decode"} 3.0' \
        in exposition(ev)
    clock.advance(590)  # both sides of the forget time, from when it was found down
    p.send(tracker)
    assert "decode-0" in states(evaluate(tracker))
    clock.advance(15)
    p.send(tracker)
    ev = evaluate(tracker)
    assert "decode-0" not in states(ev)
    assert {tracker.closed[(tid(r), "decode")].outcome for r in (1, 2, 3)} == {c.OUTCOME_LOST}
    assert not tracker.open


def test_an_engine_that_never_heartbeats_keeps_the_threshold_for_its_legs(engines, clock):
    tracker = new_tracker(clock=clock)
    d = engines("decode", "decode-0")
    d.walk("d-1", 1, ("bootstrap", "transfer"))
    d.send(tracker, heartbeat=False)  # stage spans only: it never fell silent, it never spoke
    clock.advance(16)
    assert [(s.role, s.reason) for s in evaluate(tracker).stuck] == [("decode", c.REASON_THRESHOLD)]
