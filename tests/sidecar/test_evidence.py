"""Stuck on evidence (contract section 5b): real recorders' heartbeats prove a leg cannot progress,
and the judge says so within a heartbeat, without waiting for the threshold; and never of a
healthy leg."""

from __future__ import annotations

from pdwatch import contract as c
from pdwatch.sidecar import views
from pdwatch.sidecar.diagnosis.classify import classify
from pdwatch.sidecar.diagnosis.from_evaluation import gather
from pdwatch.sidecar.metrics import EvaluationCollector
from tests.support.tracking import evaluate, judge_of

PREFILL = ("bootstrap", "queued", "prefill", "transfer")
HB = 1.0  # the test engines' heartbeat interval


def tid(room: int) -> str:
    return f"{c.room_trace_id(room):032x}"


def reasons(tracker, now=None) -> dict[tuple[str, str], str]:
    return {(s.trace_id, s.role): s.reason for s in evaluate(tracker, now).stuck}


def beat(tracker, clock, *engines, seconds=HB, loops=True):
    """One heartbeat interval: every engine's loop turns (unless told not to) and each heartbeats."""
    clock.advance(seconds)
    for e in engines:
        if loops:
            e.rec.loop_tick()
        e.send(tracker)


# ---- peer_gone ----------------------------------------------------------------------------------


def test_a_leg_whose_peer_restarted_is_stuck_at_the_next_inventory(tracker, engines, clock):
    p = engines("prefill", "prefill-0", peer_ids=("agent-p", "127.0.0.1:8998"))
    d0 = engines("decode", "decode-0", peer_ids=("agent-d0-old",))
    d1 = engines("decode", "decode-1", peer_ids=("agent-d1",))
    p.walk("p-1", 1, PREFILL, peer="agent-d0-old")  # writes to decode-0's agent
    p.walk("p-2", 2, PREFILL, peer="agent-d1")  # writes to decode-1's, alive throughout
    beat(tracker, clock, p, d0, d1)
    beat(tracker, clock, p, d0, d1)
    assert reasons(tracker) == {}
    # decode-0 restarts alone: a new process, a new agent; the prefill keeps writing to the old one.
    engines("decode", "decode-0", peer_ids=("agent-d0-new",)).send(tracker)
    assert reasons(tracker) == {}  # no inventory since the end yet
    beat(tracker, clock, p, d1, seconds=0.5)
    assert reasons(tracker) == {}  # listed only half an interval after: could still be ending
    beat(tracker, clock, p, d1, seconds=0.6)
    assert reasons(tracker) == {(tid(1), "prefill"): c.REASON_PEER_GONE}
    (s,) = evaluate(tracker).stuck
    assert s.age_s < 5 < s.threshold_s  # seconds into transfer, far from its 15 s floor
    assert "agent-d0-old" in s.why and "decode-0" in s.why


def test_a_peer_that_stops_heartbeating_has_ended_for_its_legs(tracker, engines, clock):
    p = engines("prefill", "prefill-0")
    d = engines("decode", "decode-0", peer_ids=("agent-d",))
    p.walk("p-1", 1, PREFILL, peer="agent-d")
    p.walk("p-2", 2, PREFILL, peer="agent-d")
    for _ in range(2):
        beat(tracker, clock, p, d)
    # decode-0 freezes: no heartbeat from now on. Down after 3 intervals.
    for _ in range(3):
        beat(tracker, clock, p)
        assert reasons(tracker) == {}
    clock.advance(0.1)
    evaluate(tracker)  # the judge finds it down
    p.rec.finish("p-2", "failed", reason="decode gone")  # one leg ends on its own: never stuck
    beat(tracker, clock, p, seconds=HB + 0.1)
    assert reasons(tracker) == {(tid(1), "prefill"): c.REASON_PEER_GONE}


def test_a_leg_that_began_after_its_peer_restarted_talks_to_the_new_process(tracker, engines, clock):
    old = engines("prefill", "prefill-0", peer_ids=("agent-p1", "127.0.0.1:8998"))
    d = engines("decode", "decode-0")
    beat(tracker, clock, old, d)
    engines("prefill", "prefill-0", peer_ids=("agent-p2", "127.0.0.1:8998")).send(tracker)  # same address
    clock.advance(0.1)
    d.walk("d-1", 1, ("bootstrap", "transfer"), peer="127.0.0.1:8998")
    for _ in range(3):
        beat(tracker, clock, d)
    assert reasons(tracker) == {}


def test_a_co_restart_with_no_legs_in_flight_names_nothing(tracker, engines, clock):
    p = engines("prefill", "prefill-0", peer_ids=("agent-p1", "127.0.0.1:8998"))
    d = engines("decode", "decode-0", peer_ids=("agent-d1",))
    beat(tracker, clock, p, d)
    p2 = engines("prefill", "prefill-0", peer_ids=("agent-p2", "127.0.0.1:8998"))
    d2 = engines("decode", "decode-0", peer_ids=("agent-d2",))
    beat(tracker, clock, p2, d2)
    p2.walk("p-1", 1, PREFILL, peer="agent-d2")
    d2.walk("d-1", 1, ("bootstrap", "transfer"), peer="127.0.0.1:8998")
    for _ in range(4):
        beat(tracker, clock, p2, d2)
    assert reasons(tracker) == {}


# ---- loop_frozen ----------------------------------------------------------------------------------


def test_a_loop_that_stops_with_legs_open_while_heartbeats_go_on(tracker, engines, clock):
    d = engines("decode", "decode-0")
    d.walk("d-1", 1, ("bootstrap", "transfer", "queued", "decode"))
    for _ in range(3):
        d.rec.token("d-1", 4)
        beat(tracker, clock, d)
    # The scheduler thread hangs (a collective that never completes); the recorder's thread still beats.
    for _ in range(2):
        beat(tracker, clock, d, loops=False)
        assert reasons(tracker) == {}  # 2 intervals: the rule is "longer than 2 intervals"
    beat(tracker, clock, d, loops=False)
    assert reasons(tracker) == {(tid(1), "decode"): c.REASON_LOOP_FROZEN}
    (inst,) = evaluate(tracker).instances
    assert inst.loop_frozen and inst.up


def test_an_idle_engine_whose_loop_sleeps_is_never_frozen(tracker, engines, clock):
    d = engines("decode", "decode-0")
    d.walk("d-1", 1, ("bootstrap", "transfer", "queued", "decode"))
    beat(tracker, clock, d)
    d.rec.finish("d-1")
    beat(tracker, clock, d)
    for _ in range(10):  # idle: the loop sleeps, nothing is open
        beat(tracker, clock, d, loops=False)
    ev = evaluate(tracker)
    assert ev.stuck == () and not ev.instances[0].loop_frozen


def test_a_loop_known_to_turn_while_idle_that_stops_names_its_instance_not_a_leg(tracker, engines, clock):
    """tp-desync caught idle: the rank hangs in a collective with no leg open, so none ever opens on it."""
    p = engines("prefill", "prefill-0")
    d = engines("decode", "decode-0")
    p.walk("p-1", 1, ("bootstrap",))  # its decode half went to decode-0, which never takes it
    for _ in range(4):  # idle, and the scheduler spins (SGLang's loop turns while idle)
        beat(tracker, clock, p, d)
    for _ in range(2):
        beat(tracker, clock, p)
        beat(tracker, clock, d, seconds=0, loops=False)
        assert not evaluate(tracker).instances[1].loop_frozen  # 2 intervals: the rule is "longer than"
    beat(tracker, clock, p)
    beat(tracker, clock, d, seconds=0, loops=False)
    ev = evaluate(tracker)
    frozen = {i.name: i.loop_frozen for i in ev.instances}
    assert frozen == {"prefill-0": False, "decode-0": True}
    assert ev.stuck == ()  # the prefill's leg waits on the threshold path: nothing ties it to decode-0
    fams = {f.name: f for f in EvaluationCollector(lambda: ev).collect()}
    assert {s.labels["pd_instance"]: s.value for s in fams["pdwatch_engine_loop_frozen"].samples} == \
        {"prefill-0": 0, "decode-0": 1}
    (facts,) = gather(ev)
    findings = classify(facts)
    assert findings[0].family == "collective_desync", [(f.family, f.confidence) for f in findings]
    assert any("frozen while idle" in e for e in findings[0].evidence), findings[0].evidence
    # The loop turns again: no longer frozen.
    beat(tracker, clock, p, d)
    assert not evaluate(tracker).instances[1].loop_frozen


def test_a_loop_that_turns_after_its_last_leg_then_blocks_while_idle_is_never_frozen(tracker, engines, clock):
    """An engine that waits on its input queue when idle: a few turns after the last leg, then none."""
    d = engines("decode", "decode-0")
    d.walk("d-1", 1, ("bootstrap", "transfer", "queued", "decode"))
    beat(tracker, clock, d)
    d.rec.finish("d-1")
    for _ in range(2):  # winding down: the loop turns twice more with nothing open
        beat(tracker, clock, d)
    for _ in range(10):
        beat(tracker, clock, d, loops=False)
    # Woken by a request now and then, it turns once and blocks again: never three idle turns in a row.
    for _ in range(3):
        beat(tracker, clock, d)
        for _ in range(4):
            beat(tracker, clock, d, loops=False)
    ev = evaluate(tracker)
    assert not ev.instances[0].loop_frozen and ev.stuck == ()


def test_a_loop_that_turns_only_for_legs_that_come_and_go_between_heartbeats_is_never_frozen_idle(
        tracker, engines, clock):
    """vLLM's decode under light load (seen live): each leg arrives and ends within one heartbeat interval,
    so no inventory lists it and every heartbeat finds the loop advanced with nothing open. Those turns
    served legs (the engine's completed counter moved): they are not idle turns, and the idle spell that
    follows, the loop blocked on its input, is neither frozen nor stalled."""
    d = engines("decode", "decode-0")
    for i in range(6):
        clock.advance(HB / 2)
        d.walk(f"d-{i}", i, ("bootstrap", "transfer", "queued", "decode"))
        d.rec.loop_tick()
        d.rec.finish(f"d-{i}")
        beat(tracker, clock, d, seconds=HB / 2)
    (rank,) = evaluate(tracker).instances[0].ranks
    assert rank.completed == 6 and rank.open_total == 0
    for _ in range(12):
        beat(tracker, clock, d, loops=False)
        ev = evaluate(tracker)
        assert not ev.instances[0].loop_frozen and not ev.instances[0].loop_stalled and ev.stuck == ()


def test_an_engine_that_says_how_its_idle_loop_turns_is_judged_without_the_wait(tracker, engines, clock):
    """pdwatch.loop.idle_turn_s: a busy decode that hangs idle at once, and one whose idle loop sleeps 1 s."""
    d = engines("decode", "decode-0", loop_idle_turn_s=0.0)  # it spins while idle (SGLang without a sleeper)
    s = engines("decode", "decode-1", loop_idle_turn_s=1.0)  # it polls its sockets up to 1 s per idle turn
    for e in (d, s):
        e.walk(f"{e.rec.config.instance}-1", hash(e.rec.config.instance) % 1000, ("bootstrap", "transfer"))
    beat(tracker, clock, d, s)
    beat(tracker, clock, d, s)
    for e in (d, s):
        e.rec.finish(f"{e.rec.config.instance}-1")
    beat(tracker, clock, d, s)  # idle from here on: no heartbeat has yet seen the loop turn while idle
    for _ in range(2):
        beat(tracker, clock, d, s, loops=False)
    assert not any(i.loop_frozen for i in evaluate(tracker).instances)  # 2 intervals, both rules say wait
    beat(tracker, clock, d, s, loops=False)
    frozen = {i.name: i.loop_frozen for i in evaluate(tracker).instances}
    assert frozen == {"decode-0": True, "decode-1": False}  # decode-1's rule: 3 x its 1 s idle turn
    beat(tracker, clock, d, s, loops=False)
    assert {i.name: i.loop_frozen for i in evaluate(tracker).instances} == {"decode-0": True, "decode-1": True}
    assert evaluate(tracker).stuck == ()


def test_a_loop_that_never_turned_is_not_judged_idle_even_when_the_engine_speaks(tracker, engines, clock):
    """A recorder that starts before its scheduler loop: nothing to judge until the loop first turns."""
    d = engines("decode", "decode-0", loop_idle_turn_s=0.0)
    for _ in range(6):
        beat(tracker, clock, d, loops=False)
    assert not evaluate(tracker).instances[0].loop_frozen


def test_a_stall_shorter_than_the_rule_and_the_rule_learns_long_stalls(tracker, engines, clock):
    p = engines("prefill", "prefill-0")
    p.walk("p-1", 1, ("bootstrap", "queued", "prefill"))
    beat(tracker, clock, p)
    beat(tracker, clock, p)
    # One long forward pass: the loop stands still for 2 intervals, then turns again.
    beat(tracker, clock, p, loops=False)
    beat(tracker, clock, p, loops=False)
    assert reasons(tracker) == {}
    beat(tracker, clock, p)
    # That stall (2 s seen) raises the rule to 3 x 2 s: a 4 s stall now is no evidence either.
    (rank,) = evaluate(tracker).instances[0].ranks
    assert rank.loop_rule_s == 6.0
    for _ in range(5):
        beat(tracker, clock, p, loops=False)
    assert reasons(tracker) == {}
    for _ in range(3):
        beat(tracker, clock, p, loops=False)
    assert reasons(tracker) == {(tid(1), "prefill"): c.REASON_LOOP_FROZEN}


def test_evidence_sticks_until_the_leg_leaves_its_stage(tracker, engines, clock):
    d = engines("decode", "decode-0")
    d.walk("d-1", 1, ("bootstrap", "transfer", "queued"))
    for _ in range(2):
        beat(tracker, clock, d)
    for _ in range(3):
        beat(tracker, clock, d, loops=False)
    assert reasons(tracker) == {(tid(1), "decode"): c.REASON_LOOP_FROZEN}
    beat(tracker, clock, d)  # the loop turns again, the leg still waits in queued
    assert reasons(tracker) == {(tid(1), "decode"): c.REASON_LOOP_FROZEN}
    d.rec.enter("d-1", "decode")
    beat(tracker, clock, d)
    assert reasons(tracker) == {}


# ---- engine_error -----------------------------------------------------------------------------------


def test_an_error_the_engine_only_logged_is_evidence_at_the_next_inventory(tracker, engines, clock):
    p = engines("prefill", "prefill-0")
    p.walk("p-1", 1, PREFILL)
    p.walk("p-2", 2, PREFILL)
    beat(tracker, clock, p)
    p.rec.leg_error("p-1", "KV write failed at transfer: NIXL_ERR_NOT_FOUND")
    p.rec.leg_error("p-2", "KV write failed at transfer: NIXL_ERR_REMOTE_DISCONNECT")
    beat(tracker, clock, p)
    assert reasons(tracker) == {}  # one inventory carries the errors: the engine may still end the legs
    p.rec.finish("p-2", "failed", reason="kv transfer failed")  # as SGLang does: it ends, never stuck
    beat(tracker, clock, p)
    assert reasons(tracker) == {(tid(1), "prefill"): c.REASON_ENGINE_ERROR}
    (s,) = evaluate(tracker).stuck
    assert "NIXL_ERR_NOT_FOUND" in s.why and s.error.endswith("NIXL_ERR_NOT_FOUND")


def test_an_error_on_a_leg_no_inventory_listed_reaches_the_request_view_from_its_leg_span(tracker, engines, clock):
    """A decode leg shorter than a heartbeat that read after the prefill's lease (vLLM): it ends ok, and only
    its leg span (pdwatch.error) says what it met; the request view shows it, no leg is stuck."""
    d = engines("decode", "decode-0")
    d.rec.arrive("d-1", bootstrap_room=1, stage="bootstrap")
    d.rec.leg_error("d-1", "the prefill's KV lease had expired")
    d.walk("d-2", 2, ("bootstrap", "transfer"))
    for rid in ("d-1", "d-2"):
        d.rec.finish(rid)
    beat(tracker, clock, d)
    judge = judge_of(tracker)
    views = {rid: judge.request_view(tid(n)) for rid, n in (("d-1", 1), ("d-2", 2))}
    (leg,) = views["d-1"].legs
    assert leg.outcome == "ok" and leg.error == "the prefill's KV lease had expired"
    assert views["d-2"].legs[0].error is None
    assert evaluate(tracker).stuck == ()


# ---- what readers see ----------------------------------------------------------------------------------


def test_reason_in_the_api_the_metrics_and_the_diagnosis(tracker, engines, clock):
    p = engines("prefill", "prefill-0")
    d0 = engines("decode", "decode-0", peer_ids=("agent-old",))
    d1 = engines("decode", "decode-1", peer_ids=("agent-d1",))
    p.walk("p-1", 1, PREFILL, peer="agent-old")
    p.walk("p-ok", 9, ("bootstrap", "queued", "prefill"))
    clock.advance(30)  # decode-0 was started long after the prefill
    beat(tracker, clock, p, d0, d1)
    beat(tracker, clock, p, d0, d1)
    engines("decode", "decode-0", peer_ids=("agent-new",)).send(tracker)  # restarted alone
    p.rec.enter("p-ok", "transfer")
    p.rec.finish("p-ok")  # others flow
    beat(tracker, clock, p, d1, seconds=1.2)
    ev = evaluate(tracker)
    (stuck,) = views.stuck_list(ev)
    assert set(c.STUCK_FIELDS) <= set(stuck) and stuck["reason"] == c.REASON_PEER_GONE
    fams = {f.name: f for f in EvaluationCollector(lambda: ev).collect()}
    evidence = {(s.labels["pd_instance"], s.labels["stage"], s.labels["reason"]): s.value
                for s in fams[c.STUCK_EVIDENCE.name].samples if s.value}
    assert evidence == {("prefill-0", "transfer", c.REASON_PEER_GONE): 1.0}
    (info,) = fams[c.STUCK_INFO.name].samples
    assert info.labels["reason"] == c.REASON_PEER_GONE and info.labels["trace_id"] == tid(1)
    (facts,) = gather(ev)
    found = {f.family: f for f in classify(facts)}
    assert {"transfer_wedge", "restart_skew"} <= set(found)
    assert any("peer_gone" in e for e in found["transfer_wedge"].evidence)


def test_a_frozen_decode_leads_the_diagnosis_without_gpu_telemetry(tracker, engines, clock):
    """tp-desync as the issue saw it: the frozen decode loop, not the prefill's bootstrap waits."""
    p = engines("prefill", "prefill-0")
    d = engines("decode", "decode-0")
    p.walk("p-1", 1, ("bootstrap",))
    d.walk("d-1", 1, ("bootstrap", "transfer", "queued", "decode"))
    p.walk("p-ok", 2, PREFILL)
    for _ in range(2):
        beat(tracker, clock, p, d)
    p.rec.finish("p-ok")
    for _ in range(3):
        beat(tracker, clock, p)
        beat(tracker, clock, d, seconds=0, loops=False)
    clock.advance(40)  # the prefill's bootstrap wait passes its floor too
    beat(tracker, clock, p)
    beat(tracker, clock, d, seconds=0, loops=False)
    (facts,) = gather(evaluate(tracker))
    findings = classify(facts)
    assert findings[0].family == "collective_desync", [(f.family, f.confidence) for f in findings]
    assert 0.5 <= findings[0].confidence < 0.85
    assert any("would confirm" in e for e in findings[0].evidence)
