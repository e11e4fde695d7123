"""The rules about time, as pure functions of the tracker's facts and `now`.

Only the judge calls these (tests/test_layout.py holds it so): the tracker
records what arrived and when, and everything that depends on how long ago
that was — is a rank up, is a loop frozen, how old is a leg, is an instance
past its TTL — is decided here, once, on the judge's tick. None of them
changes what it reads.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterable
from typing import NamedTuple

from pdwatch import contract as c

from .model import LOOP_STALL_WINDOW_NS, Incarnation, Instance, Leg, Passage


def rank_up(inc: Incarnation, now: int) -> bool:
    """The rank heartbeated within 3 of its intervals (contract section 5)."""
    return bool(inc.last_heartbeat_ns) and \
        now - inc.last_heartbeat_ns <= c.DOWN_AFTER_INTERVALS * inc.interval_s * 1e9


def instance_up(inst: Instance, now: int) -> bool:
    """Every rank is up."""
    return bool(inst.ranks) and all(rank_up(inc, now) for inc in inst.ranks.values())


def rank_state(inc: Incarnation, now: int) -> str:
    """departed once its last heartbeat was final; else up while it heartbeats; else down."""
    if inc.final_ns:
        return c.STATE_DEPARTED
    return c.STATE_UP if rank_up(inc, now) else c.STATE_DOWN


def instance_state(inst: Instance, now: int) -> str:
    """Contract section 5 (v1.2): departed when every rank left in order; down when a rank went silent
    without a final heartbeat (dead or frozen: nobody can tell); else up. A rank that left while its
    peers still heartbeat (a shutdown under way) leaves the instance up until they leave or fall silent."""
    states = {rank_state(inc, now) for inc in inst.ranks.values()}
    if states == {c.STATE_DEPARTED}:
        return c.STATE_DEPARTED
    return c.STATE_DOWN if c.STATE_DOWN in states or not states else c.STATE_UP


def ended(inc: Incarnation, now: int) -> bool:
    """The rank's process has ended as far as its KV peers know: it left in order, or fell silent."""
    return bool(inc.final_ns) or (bool(inc.last_heartbeat_ns) and not rank_up(inc, now))


def expired(inst: Instance, now: int, ttl_ns: int) -> bool:
    """No rank of the instance sent anything for the TTL: it was scaled away or renamed."""
    return bool(inst.ranks) and max(inc.last_seen_ns for inc in inst.ranks.values()) < now - ttl_ns


def loop_still_s(inc: Incarnation) -> float:
    """Seconds the rank's loop counter was seen not to advance, up to its latest heartbeat."""
    if inc.loop_iterations is None or not inc.loop_since_ns:
        return 0.0
    return (inc.loop_seen_ns - inc.loop_since_ns) / 1e9


def _longest(stalls: Iterable[tuple[int, float]], now: int) -> float:
    return max((s for at, s in stalls if at >= now - LOOP_STALL_WINDOW_NS), default=0.0)


def _loop_rule(inc: Incarnation, longest_s: float) -> float:
    """max(2 heartbeats, 3 x the longest stall in the window): contract section 5b's loop rule."""
    return max(c.LOOP_FROZEN_INTERVALS * inc.interval_s, c.LOOP_STALL_FACTOR * longest_s)


def loop_rule_s(inc: Incarnation, now: int) -> float:
    """How long a loop may stand still with open legs before it is frozen (contract section 5b)."""
    return _loop_rule(inc, _longest(inc.stalls, now))


def idle_loop_rule_s(inc: Incarnation, now: int) -> float:
    """The same rule for an idle loop: its pauses busy or idle, and its engine's own word on them."""
    return _loop_rule(inc, max(_longest((*inc.stalls, *inc.idle_stalls), now), inc.idle_turn_s or 0.0))


def judged_idle(inc: Incarnation) -> bool:
    """Whether the rank's loop is known to turn while idle (seen, or said by its engine): only such a
    loop is judged when its instance holds no leg."""
    return inc.turns_idle or inc.idle_turn_s is not None


def frozen_ranks(inst: Instance, now: int) -> list[Incarnation]:
    """Ranks that heartbeat while their loop stands still with the instance's legs open, past the rule."""
    owner = inst.owner
    if owner is None or not owner.busy_since_ns or not owner.open_total:
        return []
    out = []
    for inc in inst.ranks.values():
        # A counter never seen to move says nothing: that engine does not count its loop.
        if not rank_up(inc, now) or not inc.loop_moves:
            continue
        still = (inc.loop_seen_ns - max(inc.loop_since_ns, owner.busy_since_ns)) / 1e9
        if still > loop_rule_s(inc, now):
            out.append(inc)
    return out


def idle_frozen_ranks(inst: Instance, now: int) -> list[Incarnation]:
    """Ranks that heartbeat while their loop stands still with no legs open, past the idle rule.

    pdwatch's addition beside contract section 5b, which judges a loop only while its instance has
    legs open: a TP rank that hangs in a collective while idle never opens another leg, and its
    peers' legs wait for it with nothing to tie them to it. A loop known to turn while idle
    (turns_idle) that stops is frozen after max(2 heartbeats, 3 x its longest pause, busy or idle,
    in the window). An engine that says how long its idle loop may stand still (idle_turn_s) is
    judged without first watching it turn while idle, against 3 x that as well. It names the
    instance (pdwatch_engine_loop_frozen, collective_desync), never a leg: the legs stay on the
    threshold path."""
    owner = inst.owner
    if owner is None or owner.open_total != 0 or owner.busy_since_ns:
        return []
    out = []
    for inc in inst.ranks.values():
        # A counter never seen to move yet says nothing: the loop may not have started.
        if not rank_up(inc, now) or not inc.loop_moves or not judged_idle(inc):
            continue
        if loop_still_s(inc) > idle_loop_rule_s(inc, now):
            out.append(inc)
    return out


def loop_stalled(inst: Instance, now: int) -> bool:
    """A rank still heartbeats but its scheduler loop counter has not moved for 3 intervals while the
    loop should turn: its instance holds legs (counted from when it took them), or its loop is known
    to turn while idle. An idle loop that blocks on its input (vLLM's EngineCore; no
    pd.loop.idle_turn_s, never seen turning idle) stands still by design: contract section 5b never
    judges it, and a gauge read as "stalled" through every idle spell would page collective_desync."""
    owner = inst.owner
    busy_since = owner.busy_since_ns if owner is not None and owner.open_total else 0
    for inc in inst.ranks.values():
        if inc.loop_iterations is None or not rank_up(inc, now):
            continue
        if busy_since:
            since = max(inc.loop_since_ns, busy_since)
        elif owner is None or judged_idle(inc):
            since = inc.loop_since_ns
        else:
            continue
        if now - since > c.DOWN_AFTER_INTERVALS * inc.interval_s * 1e9:
            return True
    return False


def age_from_ns(leg: Leg) -> int:
    """The engine-clock instant a leg's age counts from: its stage entry, or in decode its last new token."""
    return max(leg.stage_since_ns, leg.progress_ns) if leg.stage == "decode" else leg.stage_since_ns


def leg_age_s(leg: Leg, now: int) -> float:
    """Seconds in the current stage, on the sidecar's clock; in decode, since the last new token."""
    offset = leg.inc.offset_ns() if leg.inc is not None else 0
    return (now - offset - age_from_ns(leg)) / 1e9


def flowing(last_ok_ns: int, now: int, window_ns: int) -> bool:
    """Another leg of the cluster finished ok within the flow window."""
    return last_ok_ns > 0 and now - last_ok_ns <= window_ns


def finished_ok_since(inst: Instance, since_ns: int) -> int:
    """The instance's ok finishes since `since_ns`, counted without dropping the older ones (the tracker does)."""
    times = inst.ok_times_ns
    old = 0
    for at in times:  # oldest first; the tracker keeps only about a flow window of them
        if at >= since_ns:
            break
        old += 1
    return len(times) - old


# ---- overtaken (contract section 5b, v1.2) -----------------------------------------------------------

_ALWAYS_OVERTAKEN = frozenset(("transfer", "bootstrap"))
_FCFS_OVERTAKEN = frozenset(("queued", "prefill"))


def overtaken_applies(stage: str, schedule_policy: str) -> bool:
    """The stages the rule judges: transfer; bootstrap (with overtakers of the leg's own peer only);
    queued and prefill only on an instance that declares it takes its queue first come, first served."""
    return stage in _ALWAYS_OVERTAKEN or (stage in _FCFS_OVERTAKEN and schedule_policy == c.SCHEDULE_FCFS)


class Passed(NamedTuple):
    """One process's latest passages through one stage, as of one tick, in order of entry; each with
    the prompt tokens (-1: unknown) and peer ("": unknown) its leg is known by. What the rule needs of
    them to turn most legs away at once rides along: fewer than K entered after `kth_start`, fewer than
    K are bigger than `kth_prompt`, and no K of them make a rule shorter than `least_rule_s`."""

    starts: list[int]  # engine clock, ascending
    ways: list[tuple[int, int, str]]  # (duration ns, prompt tokens, peer), parallel to starts
    kth_start: int
    kth_prompt: int
    least_rule_s: float


def passed(passages: Iterable[Passage], leg_of: Callable[[str], Leg | None], *, k: int, m: float,
           interval_s: float) -> Passed | None:
    """The passages as the rule reads them, or None when fewer than k: nothing can be overtaken by k."""
    rows = []
    for p in passages:
        leg = leg_of(p.trace_id)
        tokens = leg.prompt_tokens if leg is not None and leg.prompt_tokens is not None else -1
        rows.append((p.start_ns, p.end_ns - p.start_ns, tokens, (leg.peer or "") if leg is not None else ""))
    if len(rows) < k:
        return None
    rows.sort()
    kth_shortest = sorted(r[1] for r in rows)[k - 1]
    return Passed([r[0] for r in rows], [r[1:] for r in rows], rows[-k][0], sorted(r[2] for r in rows)[-k],
                  max(c.OVERTAKEN_INTERVALS * interval_s, m * kth_shortest / 1e9))


class Overtaking(NamedTuple):
    overtakers: int  # later legs, at least as big (and of its peer, in bootstrap), that passed the stage
    longest_s: float  # the longest of the k quickest of them
    rule_s: float  # max(2 heartbeat intervals, M x longest_s): how long the leg may wait


def overtaken(p: Passed, since_ns: int, prompt_tokens: int, peer: str | None, waited_s: float, *, k: int,
              m: float, interval_s: float) -> Overtaking | None:
    """Contract section 5b's overtaken: at least k legs entered the stage after the leg (`since_ns`, the
    same engine clock), carried at least its prompt tokens (and, given a peer, talked to that peer), and
    have left the stage, while the leg waited longer than max(2 heartbeat intervals, m x the longest of
    k of those passages). The k quickest are the ones taken: any k that overtook it prove the stage
    served others. A queue that drains in order has nobody who entered after a waiting leg leave before
    it; a long prompt passed by short ones is passed by none as big."""
    if since_ns >= p.kth_start or prompt_tokens > p.kth_prompt or waited_s <= p.least_rule_s:
        return None
    ways = sorted(d for d, tokens, by in p.ways[bisect_right(p.starts, since_ns):]
                  if tokens >= prompt_tokens and (peer is None or by == peer))
    if len(ways) < k:
        return None
    longest_s = ways[k - 1] / 1e9
    rule_s = max(c.OVERTAKEN_INTERVALS * interval_s, m * longest_s)
    return Overtaking(len(ways), longest_s, rule_s) if waited_s > rule_s else None
