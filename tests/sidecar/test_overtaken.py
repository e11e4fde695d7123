"""Stuck on evidence, overtaken (contract section 5b, v1.2): at least K later legs of the leg's instance,
with at least its prompt tokens, went through its stage while it waited longer than max(2 heartbeat
intervals, M x the longest of those K passages). Real recorders' spans and heartbeats through the real
OTLP encoder, one fake clock; both sides of every condition, and the healthy queues it must never name."""

from __future__ import annotations

import random
from types import SimpleNamespace

from pdwatch import contract as c
from pdwatch.sidecar import rules, views
from pdwatch.sidecar.diagnosis.classify import classify
from pdwatch.sidecar.diagnosis.from_evaluation import gather
from pdwatch.sidecar.forward import StuckEvent, stuck_resource_spans
from pdwatch.sidecar.metrics import EvaluationCollector
from pdwatch.sidecar.model import Passage
from tests.support.tracking import evaluate, new_tracker

HB = 1.0  # the test engines' heartbeat interval: the rule is never under 2 s
FLOORS = {"bootstrap": 30, "queued": 60, "prefill": 60, "transfer": 15, "decode": 30}


def reasons(tracker, now=None) -> dict[str, str]:
    return {s.rid: s.reason for s in evaluate(tracker, now).stuck}


def wait(e, rid, room, stage, prompt, **arrive):
    """A leg that walks to `stage` now and stays there."""
    stages = c.STAGES[e.rec.config.role]
    e.walk(rid, room, stages[:stages.index(stage) + 1], prompt_tokens=prompt, **arrive)


def pass_through(e, clock, stage, rooms, *, prompt, seconds, peer=None):
    """Legs that enter `stage` together now, leave it `seconds` later and then end at once."""
    stages = c.STAGES[e.rec.config.role]
    i = stages.index(stage)
    for room in rooms:
        e.walk(f"x-{room}", room, stages[:i + 1], prompt_tokens=prompt, peer=peer)
    clock.advance(seconds)
    for room in rooms:
        for later in stages[i + 1:]:
            e.rec.enter(f"x-{room}", later)
        e.rec.finish(f"x-{room}")


def settle(tracker, clock, *engines, seconds=0.0):
    clock.advance(seconds)
    for e in engines:
        e.rec.loop_tick()
        e.send(tracker)


def at(clock, since, waited):
    """The sidecar's clock once the leg that entered its stage at `since` has waited `waited` s."""
    return since + int(waited * 1e9)


# ---- the rule ------------------------------------------------------------------------------------------


def test_a_transfer_leg_passed_by_k_later_legs_as_big_is_stuck_past_m_times_their_passage(tracker, engines, clock):
    p = engines("prefill", "prefill-0")
    wait(p, "p-1", 1, "transfer", prompt=100)
    since = clock.now
    clock.advance(0.5)
    pass_through(p, clock, "transfer", range(10, 15), prompt=100, seconds=0.3)  # as big: "at least as many"
    settle(tracker, clock, p)
    # max(2 heartbeats = 2 s, 10 x 0.3 s) = 3 s.
    assert reasons(tracker, at(clock, since, 2.95)) == {}
    assert reasons(tracker, at(clock, since, 3.05)) == {"p-1": c.REASON_OVERTAKEN}
    (s,) = evaluate(tracker, at(clock, since, 3.05)).stuck
    assert s.age_s < s.threshold_s  # well before the transfer floor
    assert "5 prefill legs" in s.why and "100 prompt tokens" in s.why and "3.0 s" in s.why, s.why


def test_k_minus_one_overtakers_are_not_enough(tracker, engines, clock):
    p = engines("prefill", "prefill-0")
    wait(p, "p-1", 1, "transfer", prompt=100)
    since = clock.now
    clock.advance(0.1)
    pass_through(p, clock, "transfer", range(10, 14), prompt=200, seconds=0.1)
    for _ in range(10):
        settle(tracker, clock, p, seconds=HB)
        assert reasons(tracker) == {}
    pass_through(p, clock, "transfer", [14], prompt=200, seconds=0.1)  # the fifth
    settle(tracker, clock, p)
    assert reasons(tracker) == {"p-1": c.REASON_OVERTAKEN}
    assert (clock.now - since) / 1e9 < 15  # still far from the threshold


def test_smaller_legs_that_pass_do_not_count_nor_set_the_rule(tracker, engines, clock):
    p = engines("prefill", "prefill-0")
    wait(p, "p-1", 1, "transfer", prompt=100)
    since = clock.now
    clock.advance(0.1)
    pass_through(p, clock, "transfer", range(10, 20), prompt=99, seconds=0.05)
    for _ in range(3):
        settle(tracker, clock, p, seconds=HB)
        assert reasons(tracker) == {}
    pass_through(p, clock, "transfer", range(20, 25), prompt=101, seconds=0.6)
    settle(tracker, clock, p, seconds=1.0)
    # The bigger ones' 0.6 s sets the rule, 10 x 0.6 s, not the smaller ones' 0.05 s.
    assert reasons(tracker, at(clock, since, 5.95)) == {}
    assert reasons(tracker, at(clock, since, 6.05)) == {"p-1": c.REASON_OVERTAKEN}


def test_two_heartbeat_intervals_bound_the_rule_from_below(tracker, engines, clock):
    p = engines("prefill", "prefill-0")
    wait(p, "p-1", 1, "transfer", prompt=100)
    since = clock.now
    clock.advance(0.1)
    pass_through(p, clock, "transfer", range(10, 15), prompt=100, seconds=0.05)  # 10 x 0.05 s = 0.5 s < 2 s
    settle(tracker, clock, p)
    assert reasons(tracker, at(clock, since, 1.95)) == {}
    assert reasons(tracker, at(clock, since, 2.05)) == {"p-1": c.REASON_OVERTAKEN}


def test_the_k_quickest_overtakers_set_the_rule(tracker, engines, clock):
    """Five quick ones prove the stage serves others; slow ones besides them do not hold the rule up."""
    p = engines("prefill", "prefill-0")
    wait(p, "p-1", 1, "transfer", prompt=100)
    since = clock.now
    clock.advance(0.1)
    pass_through(p, clock, "transfer", range(10, 13), prompt=100, seconds=2.0)
    pass_through(p, clock, "transfer", range(20, 25), prompt=100, seconds=0.4)
    settle(tracker, clock, p)
    assert reasons(tracker, at(clock, since, 3.95)) == {}  # 10 x 0.4 s
    assert reasons(tracker, at(clock, since, 4.05)) == {"p-1": c.REASON_OVERTAKEN}


def test_k_and_m_are_settings(clock, engines):
    tracker = new_tracker(FLOORS, clock=clock, overtaken_k=2, overtaken_m=20.0)
    p = engines("prefill", "prefill-0")
    wait(p, "p-1", 1, "transfer", prompt=100)
    since = clock.now
    clock.advance(0.1)
    pass_through(p, clock, "transfer", range(10, 12), prompt=100, seconds=0.2)
    settle(tracker, clock, p, seconds=2.0)  # a heartbeat late enough that the instance is up at 4 s
    assert reasons(tracker, at(clock, since, 3.95)) == {}  # 20 x 0.2 s
    assert reasons(tracker, at(clock, since, 4.05)) == {"p-1": c.REASON_OVERTAKEN}


def test_legs_that_entered_before_it_or_failed_are_no_overtakers(tracker, engines, clock):
    p = engines("prefill", "prefill-0")
    for room in range(10, 20):  # entered transfer before p-1: they pass it, as in any queue
        p.walk(f"x-{room}", room, ("bootstrap", "queued", "prefill", "transfer"), prompt_tokens=100)
    clock.advance(0.1)
    wait(p, "p-1", 1, "transfer", prompt=100)
    clock.advance(0.1)
    for room in range(10, 20):
        p.rec.finish(f"x-{room}")
    for room in range(20, 30):  # entered after it, but left transfer failing: they did not pass
        wait(p, f"y-{room}", room, "transfer", prompt=100)
    clock.advance(0.1)
    for room in range(20, 30):
        p.rec.finish(f"y-{room}", "failed", reason="KV transfer failed")
    for _ in range(8):
        settle(tracker, clock, p, seconds=HB)
        assert reasons(tracker) == {}


def test_the_rule_s_shortcuts_never_change_its_answer():
    """rules.overtaken turns most legs away on figures read once per stage; against the rule as written,
    over random passages and legs, it answers the same."""
    rng = random.Random(7)
    checked = fired = 0
    for _ in range(300):
        k, m, hb = rng.randint(1, 6), rng.choice((1.0, 4.0, 10.0)), rng.choice((0.5, 2.0))
        rows = [(rng.randint(0, 20) * 10**9, rng.randint(0, 3000) * 10**6, rng.choice((-1, 50, 100, 200, 400)),
                 rng.choice(("", "a", "b"))) for _ in range(rng.randint(0, 20))]
        # What the tracker knows of each passage's leg: its prompt length and peer, maybe neither.
        known = {f"t{i}": SimpleNamespace(prompt_tokens=None if tokens < 0 else tokens, peer=peer or None)
                 for i, (_s, _d, tokens, peer) in enumerate(rows)}
        passages = [Passage(start, start + d, f"t{i}") for i, (start, d, _t, _p) in enumerate(rows)]
        p = rules.passed(passages, known.get, k=k, m=m, interval_s=hb)
        for _ in range(10):
            since, prompt = rng.randint(0, 20) * 10**9, rng.choice((50, 100, 200, 400))
            peer, waited = rng.choice((None, "a", "b")), rng.uniform(0, 40)
            took = sorted(d for start, d, tokens, by in rows
                          if start > since and tokens >= prompt and (peer is None or by == peer))
            expected = len(took) >= k and waited > max(2 * hb, m * took[k - 1] / 1e9)
            got = p is not None and rules.overtaken(p, since, prompt, peer, waited, k=k, m=m, interval_s=hb) is not None
            assert got == expected, (rows, k, m, hb, since, prompt, peer, waited)
            checked, fired = checked + 1, fired + expected
    assert fired > 50 and checked - fired > 50  # both answers were put to the test


# ---- where it applies ------------------------------------------------------------------------------------


def test_in_bootstrap_only_legs_of_the_same_peer_overtake(tracker, engines, clock):
    d = engines("decode", "decode-0")
    wait(d, "d-1", 1, "bootstrap", prompt=100, peer="10.0.0.1:8998")
    wait(d, "d-2", 2, "bootstrap", prompt=100)  # no peer known: whose legs would count is unknown
    clock.advance(0.1)
    pass_through(d, clock, "bootstrap", range(10, 20), prompt=100, seconds=0.1, peer="10.0.0.2:8998")
    for _ in range(5):
        settle(tracker, clock, d, seconds=HB)
        assert reasons(tracker) == {}  # another prefill's legs: its own may wait for a reason
    pass_through(d, clock, "bootstrap", range(20, 25), prompt=100, seconds=0.1, peer="10.0.0.1:8998")
    settle(tracker, clock, d)
    assert reasons(tracker) == {"d-1": c.REASON_OVERTAKEN}
    (s,) = evaluate(tracker).stuck
    assert "of its peer 10.0.0.1:8998" in s.why


def test_queued_and_prefill_only_on_an_instance_that_declares_fcfs(tracker, engines, clock):
    fcfs = engines("prefill", "prefill-fcfs", schedule_policy="fcfs")
    lpm = engines("prefill", "prefill-lpm", schedule_policy="lpm")  # a longest-prefix match may pass anyone
    mute = engines("prefill", "prefill-mute")  # says nothing of its order
    engines_ = (fcfs, lpm, mute)
    for n, e in enumerate(engines_):  # rooms apart: a room names a request, and its trace
        name = e.rec.config.instance
        wait(e, f"{name}-q", 1000 * n + 1, "queued", prompt=100)
        wait(e, f"{name}-p", 1000 * n + 2, "prefill", prompt=100)
    clock.advance(0.1)
    for n, e in enumerate(engines_):
        pass_through(e, clock, "queued", range(1000 * n + 10, 1000 * n + 15), prompt=100, seconds=0.1)
        pass_through(e, clock, "prefill", range(1000 * n + 20, 1000 * n + 25), prompt=100, seconds=0.1)
    for _ in range(10):
        settle(tracker, clock, *engines_, seconds=HB)
    assert reasons(tracker) == {"prefill-fcfs-q": c.REASON_OVERTAKEN, "prefill-fcfs-p": c.REASON_OVERTAKEN}


def test_the_decode_stage_is_never_judged_by_it(tracker, engines, clock):
    """A long generation is overtaken by every short one, and keeps producing."""
    d = engines("decode", "decode-0", schedule_policy="fcfs")
    wait(d, "d-long", 1, "decode", prompt=100)
    clock.advance(0.1)
    for i in range(10):
        pass_through(d, clock, "decode", range(100 + 10 * i, 110 + 10 * i), prompt=100, seconds=0.1)
        d.rec.token("d-long", 20)
        settle(tracker, clock, d, seconds=HB)
        assert reasons(tracker) == {}


# ---- the healthy queues it must never name -----------------------------------------------------------------


def test_a_queue_that_drains_in_order_under_overload_never_fires(tracker, engines, clock):
    """60 legs of every size arrive within 3 s at an fcfs prefill that serves four every 1.5 s: the last
    waits 20 s in queued, and its decode half as long in transfer, each served in order behind the ones
    before it. (The threshold may name some: it is the overtaken rule that must not.)"""
    p = engines("prefill", "prefill-0", schedule_policy="fcfs")
    d = engines("decode", "decode-0", schedule_policy="fcfs")
    rooms = list(range(1, 61))
    for room in rooms:
        p.walk(f"p-{room}", room, ("bootstrap", "queued"), prompt_tokens=50 + (room * 37) % 400)
        d.walk(f"d-{room}", room, ("bootstrap", "transfer"), prompt_tokens=50 + (room * 37) % 400)
        clock.advance(0.05)
    while rooms:
        batch, rooms = rooms[:4], rooms[4:]
        for room in batch:
            p.rec.enter(f"p-{room}", "prefill")
        clock.advance(1.0)
        for room in batch:
            p.rec.enter(f"p-{room}", "transfer")
        clock.advance(0.5)
        for room in batch:
            p.rec.finish(f"p-{room}")
            d.rec.enter(f"d-{room}", "queued")
            d.rec.enter(f"d-{room}", "decode")
            d.rec.finish(f"d-{room}")
        settle(tracker, clock, p, d)
        assert c.REASON_OVERTAKEN not in reasons(tracker).values()
    assert len(evaluate(tracker).counters.finished) == 2  # every leg of both sides went through, in order


def test_a_long_prompt_passed_by_short_ones_never_fires(tracker, engines, clock):
    """A long prompt's KV takes seconds to send while short ones go through in a tenth of one."""
    p = engines("prefill", "prefill-0", schedule_policy="fcfs")
    wait(p, "p-long", 1, "transfer", prompt=4000)
    for i in range(8):
        pass_through(p, clock, "transfer", range(100 + 10 * i, 110 + 10 * i), prompt=500, seconds=0.1)
        settle(tracker, clock, p, seconds=HB)
        assert reasons(tracker) == {}
    p.rec.finish("p-long")
    settle(tracker, clock, p)
    assert reasons(tracker) == {}


def test_a_leg_of_unknown_size_is_never_judged(tracker, engines, clock):
    p = engines("prefill", "prefill-0")
    p.walk("p-1", 1, ("bootstrap", "queued", "prefill", "transfer"))  # the engine does not say its prompt
    clock.advance(0.1)
    pass_through(p, clock, "transfer", range(10, 20), prompt=1, seconds=0.1)
    for _ in range(8):
        settle(tracker, clock, p, seconds=HB)
        assert reasons(tracker) == {}


# ---- what readers see ------------------------------------------------------------------------------------------


def test_overtaken_in_the_api_the_metrics_the_stuck_span_and_the_diagnosis(tracker, engines, clock):
    p = engines("prefill", "prefill-0")
    d = engines("decode", "decode-0")
    wait(p, "p-1", 1, "transfer", prompt=100)
    wait(d, "d-1", 1, "transfer", prompt=100)
    clock.advance(0.1)
    pass_through(p, clock, "transfer", range(10, 15), prompt=120, seconds=0.1)
    pass_through(d, clock, "transfer", range(10, 15), prompt=120, seconds=0.1)
    for _ in range(3):
        settle(tracker, clock, p, d, seconds=HB)
    ev = evaluate(tracker)
    assert {s["rid"]: s["reason"] for s in views.stuck_list(ev)} == {"p-1": c.REASON_OVERTAKEN,
                                                                      "d-1": c.REASON_OVERTAKEN}
    fams = {f.name: f for f in EvaluationCollector(lambda: ev).collect()}
    evidence = {(s.labels["pd_instance"], s.labels["stage"], s.labels["reason"]): s.value
                for s in fams[c.STUCK_EVIDENCE.name].samples if s.value}
    assert evidence == {("prefill-0", "transfer", c.REASON_OVERTAKEN): 1.0,
                        ("decode-0", "transfer", c.REASON_OVERTAKEN): 1.0}
    assert {s.labels["reason"] for s in fams[c.STUCK_INFO.name].samples} == {c.REASON_OVERTAKEN}
    (rs,) = stuck_resource_spans([StuckEvent(s, "transfer_wedge") for s in ev.stuck])
    spans = rs.scope_spans[0].spans
    assert {a.value.string_value for sp in spans for a in sp.attributes if a.key == c.A_REASON} == \
        {c.REASON_OVERTAKEN}
    (facts,) = gather(ev)
    found = {f.family: f for f in classify(facts)}
    assert "transfer_wedge" in found
    assert any(c.REASON_OVERTAKEN in e for e in found["transfer_wedge"].evidence), found["transfer_wedge"].evidence
