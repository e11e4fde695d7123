"""What distinguishes the stuck legs from the ones that flow.

A pure function over facts about legs: for every attribute the sidecar knows
of a leg (its instance, its role, its peer or that it has none, whether the
peer's process is the current one, its prompt length, whether it arrived after
the latest restart of an instance, whether its engine recorded an error for
it), the share of stuck legs that have it against the share of legs that finished ok
in the flow window. An attribute separates them when the difference is large;
the best few are reported, best first. Scattered stuck legs with no common
cause separate on nothing, and nothing is reported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

# Below this difference of shares an attribute says nothing worth reading.
CLEAR_SEPARATION = 0.5
TOP = 5


@dataclass(frozen=True, slots=True)
class LegFacts:
    role: str
    pd_instance: str
    peer: str | None
    peer_owner: str | None  # the instance whose process the peer id names, when known
    peer_ended: bool  # that process has ended (restarted or down) since
    prompt_tokens: int | None
    arrived_s: float | None  # sidecar clock, Unix seconds
    error: bool  # the engine recorded an error for the leg without ending it


@dataclass(frozen=True, slots=True)
class Contrast:
    attribute: str
    value: str
    stuck: float  # share of stuck legs that have it
    flowing: float  # share of legs that finished ok in the flow window that have it
    stuck_n: int
    stuck_of: int
    flowing_n: int
    flowing_of: int
    sentence: str
    role: str | None = None  # set when the shares are among one role's legs only

    @property
    def separation(self) -> float:
        return self.stuck - self.flowing

    def as_dict(self) -> dict[str, Any]:
        return {"attribute": self.attribute, "value": self.value, "stuck": round(self.stuck, 3),
                "flowing": round(self.flowing, 3), "stuck_legs": [self.stuck_n, self.stuck_of],
                "flowing_legs": [self.flowing_n, self.flowing_of], "separation": round(self.separation, 3),
                "role": self.role, "sentence": self.sentence}


Predicate = Callable[[LegFacts], bool]
T = TypeVar("T")


def _bound(test: Callable[[LegFacts, T], bool], value: T) -> Predicate:
    """`test` with `value` bound now, not when called (a lambda in a loop sees the loop's last value)."""
    return lambda leg: test(leg, value)


def _candidates(stuck: list[LegFacts], flowing: list[LegFacts],
                restarts: dict[str, float]) -> Iterable[tuple[str, str, Predicate, str]]:
    """(attribute, value, predicate, what the legs that have it do) for everything worth testing."""
    for name in sorted({leg.pd_instance for leg in stuck}):
        yield "pd_instance", name, _bound(lambda leg, n: leg.pd_instance == n, name), f"are on {name}"
    # A fault of one instance shows on both legs of its requests: its own, and its peers' legs talking to it.
    for name in sorted({leg.pd_instance for leg in stuck} | {leg.peer_owner for leg in stuck if leg.peer_owner}):
        yield ("involves", name, _bound(lambda leg, n: leg.pd_instance == n or leg.peer_owner == n, name),
               f"are on {name} or talk to it")
    for role in sorted({leg.role for leg in stuck}):
        yield "role", role, _bound(lambda leg, r: leg.role == r, role), f"are {role} legs"
    for peer in sorted({leg.peer for leg in stuck if leg.peer}):
        owner = next((leg.peer_owner for leg in stuck if leg.peer == peer and leg.peer_owner), None)
        named = f"{owner}'s {peer}" if owner else peer
        yield "peer", peer, _bound(lambda leg, p: leg.peer == p, peer), f"talk to {named}"
    # A leg that never got a peer: the other side never came for it (a prefill leg whose decode half the
    # router sent to a dead decode waits in bootstrap with none, and only the router knows where it went).
    if any(not leg.peer for leg in stuck):
        yield "peer", "none", (lambda leg: not leg.peer), "have no KV peer: no other side ever joined them"
    ended = sorted({leg.peer_owner or "?" for leg in stuck if leg.peer_ended})
    if ended:
        yield ("peer_process", "ended", lambda leg: leg.peer_ended,
               f"talk to a process of {', '.join(ended)} that has since ended (an agent from before a restart)")
    for name, at in sorted(restarts.items()):
        yield from _both_sides("arrived", lambda leg: leg.arrived_s, at,
                               (f"after {name} restarted", f"arrived after {name}'s latest restart"),
                               (f"before {name} restarted", f"arrived before {name}'s latest restart"))
    if any(leg.error for leg in stuck):
        yield "engine_error", "recorded", (lambda leg: leg.error), "carry an error their engine recorded"
    for cut in _prompt_cuts(stuck, flowing):
        yield from _both_sides("prompt_tokens", lambda leg: leg.prompt_tokens, cut,
                               (f">= {cut}", f"have prompts of {cut} tokens or more"),
                               (f"< {cut}", f"have prompts under {cut} tokens"))


def _both_sides(attribute: str, value: Callable[[LegFacts], float | None], cut: float, at_or_above: tuple[str, str],
                below: tuple[str, str]) -> Iterable[tuple[str, str, Predicate, str]]:
    """A cut on a number, as two candidates: the legs at or above it, and those below (neither: unknown)."""
    def side(above: bool) -> Predicate:
        return lambda leg: (v := value(leg)) is not None and (v >= cut) == above
    yield attribute, at_or_above[0], side(True), at_or_above[1]
    yield attribute, below[0], side(False), below[1]


def _prompt_cuts(stuck: list[LegFacts], flowing: list[LegFacts], n: int = 20) -> list[int]:
    """A few cut points worth testing: the stuck legs' shortest and longest prompts, and quantiles."""
    lengths = sorted(leg.prompt_tokens for leg in (*stuck, *flowing) if leg.prompt_tokens is not None)
    if len(set(lengths)) < 2:
        return []
    ends = [leg.prompt_tokens for leg in stuck if leg.prompt_tokens is not None]
    cuts = {lengths[len(lengths) * i // n] for i in range(1, n)}
    if ends:
        cuts |= {min(ends), max(ends) + 1}
    return sorted(c for c in cuts if lengths[0] < c <= lengths[-1])


def contrast(stuck: list[LegFacts], flowing: list[LegFacts], restarts: dict[str, float] | None = None,
             *, top: int = TOP, clear: float = CLEAR_SEPARATION) -> list[Contrast]:
    """The attributes that separate stuck from flowing legs best, best first; empty when none does clearly.

    `restarts`: instance -> its latest restart (sidecar clock, Unix seconds)."""
    if not stuck or not flowing:
        return []  # nothing flows (or nothing is stuck): there is no contrast to draw
    found: dict[tuple[str, str], Contrast] = {}
    # All legs, and each role's apart: a fault of one side shows clearest among that side's legs.
    scopes: list[str | None] = [None, *sorted({leg.role for leg in stuck})]
    for role in scopes:
        s_legs = [leg for leg in stuck if role is None or leg.role == role]
        f_legs = [leg for leg in flowing if role is None or leg.role == role]
        if not s_legs or not f_legs:
            continue
        legs = f"{role} legs" if role else "legs"
        for attribute, value, has, doing in _candidates(s_legs, f_legs, restarts or {}):
            if role is not None and attribute == "role":
                continue
            s = sum(1 for leg in s_legs if has(leg))
            f = sum(1 for leg in f_legs if has(leg))
            item = Contrast(attribute, value, s / len(s_legs), f / len(f_legs), s, len(s_legs), f, len(f_legs),
                            f"{s} of {len(s_legs)} stuck {legs} {doing}; {f} of {len(f_legs)} flowing {legs} do", role)
            old = found.get((attribute, value))
            if item.separation >= clear and (old is None or item.separation > old.separation):
                found[(attribute, value)] = item
    # Of the prompt cuts keep the best one: the rest say the same less well.
    best = sorted(found.values(), key=lambda x: (-x.separation, x.attribute, x.value))
    out, cut_seen = [], False
    for item in best:
        if item.attribute == "prompt_tokens":
            if cut_seen:
                continue
            cut_seen = True
        out.append(item)
    return out[:top]
