"""The judge reads the tracker's facts and never writes them: ticks over a tracker holding every
kind of verdict (stuck on threshold, on a restarted peer, on a peer gone down, on a frozen loop)
leave every fact as it was; only ingest moves them."""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import fields, is_dataclass
from typing import Any

from pdwatch import contract as c
from tests.support.tracking import evaluate, judge_of

PREFILL = ("bootstrap", "queued", "prefill", "transfer")


def plain(value: Any) -> Any:
    """A value's facts as plain data, so two moments compare field by field."""
    if is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__, {f.name: plain(getattr(value, f.name)) for f in fields(value)})
    if isinstance(value, dict):
        return {repr(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, deque)):
        return [plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(repr(plain(v)) for v in value)
    if isinstance(value, array):
        return list(value)
    return value


def facts(tracker) -> dict[str, Any]:
    own = {k: v for k, v in vars(tracker).items() if k not in ("clock", "_judge", "limits")}
    out = {k: plain(v) for k, v in own.items() if k not in ("samples", "durations")}
    out["samples"] = plain(vars(tracker.samples))
    out["durations"] = plain({k: v for k, v in vars(tracker.durations).items() if k != "clock"})
    return out


def beat(tracker, clock, *engines, loops=True):
    clock.advance(1.0)
    for e in engines:
        if loops:
            e.rec.loop_tick()
        e.send(tracker)


def test_ticks_change_no_fact_of_the_tracker(tracker, engines, clock):
    p = engines("prefill", "prefill-0", peer_ids=("agent-p",))
    d0 = engines("decode", "decode-0", peer_ids=("agent-d0-old",))
    d1 = engines("decode", "decode-1", peer_ids=("agent-d1",))
    frozen = engines("prefill", "prefill-1", peer_ids=("agent-p1",))
    p.walk("p-1", 1, PREFILL, peer="agent-d0-old")  # its decode restarts: peer_gone
    p.walk("p-2", 2, PREFILL, peer="agent-d1")  # its decode goes down: peer_gone
    p.walk("p-3", 3, PREFILL)  # no peer: threshold
    frozen.walk("p-4", 4, PREFILL)  # its own loop stops: loop_frozen
    for _ in range(3):
        beat(tracker, clock, p, d0, d1, frozen)
    engines("decode", "decode-0", peer_ids=("agent-d0-new",)).send(tracker)  # restarted alone
    for _ in range(20):  # decode-1 heartbeats no more; prefill-1 heartbeats but its loop stands still
        beat(tracker, clock, p)
        beat(tracker, clock, frozen, loops=False)
        evaluate(tracker)  # as the sidecar's worker does between requests
    ev = evaluate(tracker)
    assert {s.rid: s.reason for s in ev.stuck} == {"p-1": c.REASON_PEER_GONE, "p-2": c.REASON_PEER_GONE,
                                                   "p-3": c.REASON_THRESHOLD, "p-4": c.REASON_LOOP_FROZEN}
    assert judge_of(tracker).verdicts and judge_of(tracker).gone_peers and judge_of(tracker).down

    before = facts(tracker)
    for _ in range(10):  # time passes for the judge alone: the engines fall silent, within the forget time
        clock.advance(7)
        evaluate(tracker)
        assert facts(tracker) == before
    assert {i.state for i in evaluate(tracker).instances} == {c.STATE_DOWN}
    p.rec.finish("p-3")
    p.send(tracker)  # ingest does move them
    assert facts(tracker) != before


def test_ticks_that_find_a_leg_overtaken_change_no_fact(tracker, engines, clock):
    """The overtaken rule reads the passages the tracker keeps and the legs it looks them up by."""
    p = engines("prefill", "prefill-0", schedule_policy="fcfs")
    p.walk("p-1", 1, PREFILL, prompt_tokens=100)  # waits in transfer
    p.walk("p-2", 2, PREFILL[:2], prompt_tokens=100)  # waits in queued
    clock.advance(0.1)
    for room in range(10, 16):  # later and as big: they pass both
        p.walk(f"x-{room}", room, PREFILL, prompt_tokens=100)
        p.rec.finish(f"x-{room}")
    for _ in range(3):
        beat(tracker, clock, p)
        evaluate(tracker)
    assert {s.rid: s.reason for s in evaluate(tracker).stuck} == {"p-1": c.REASON_OVERTAKEN,
                                                                  "p-2": c.REASON_OVERTAKEN}
    before = facts(tracker)
    assert any(inc.passages for inst in tracker.instances.values() for inc in inst.ranks.values())
    for _ in range(5):
        clock.advance(0.5)
        evaluate(tracker)
        assert facts(tracker) == before
