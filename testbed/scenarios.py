"""Scenarios: what load the router sends and what faults happen when.

A scenario is a request shape (prompt and output length per request), extra
engine arguments per instance, and timed actions on the running stack. New
ones (freeze-decode, tp-desync, kv-starvation, burst, total-wedge) register
here without touching the stack: `register(Scenario(...))`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Params:
    """Knobs a scenario may read; the Stack fills them from its arguments."""

    rate: float = 4.0
    restart_at: float = 8.0
    decode_floor_s: float = 30.0
    token_interval_s: float = 0.05


def default_shape(params: Params, rng: random.Random, index: int) -> tuple[int, int]:
    return rng.randint(32, 256), rng.randint(8, 32)


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    # (params, rng, request index) -> (prompt_tokens, max_tokens)
    shape: Callable[[Params, random.Random, int], tuple[int, int]] = default_shape
    # (params) -> [(seconds after start, action name, instance)]; the Stack runs the actions.
    actions: Callable[[Params], list[tuple[float, str, str]]] = lambda params: []
    # (params, instance) -> extra `python -m testbed.engine` arguments
    engine_args: Callable[[Params, str], list[str]] = lambda params, instance: []
    # The router's ground truth should end with requests hung.
    expects_stuck: bool = False
    tags: tuple[str, ...] = field(default_factory=tuple)


SCENARIOS: dict[str, Scenario] = {}


def register(scenario: Scenario) -> Scenario:
    if scenario.name in SCENARIOS:
        raise ValueError(f"scenario {scenario.name!r} is already registered")
    SCENARIOS[scenario.name] = scenario
    return scenario


def get(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r} (choose from {', '.join(sorted(SCENARIOS))})") from None


def _long_decode_shape(params: Params, rng: random.Random, index: int) -> tuple[int, int]:
    prompt, out = default_shape(params, rng, index)
    if index % 5 == 2:
        # About 4x the decode stuck floor, producing a token every step all along.
        out = math.ceil(4 * params.decode_floor_s / params.token_interval_s)
    return prompt, out


register(Scenario("healthy", "steady load; every request completes"))
register(Scenario(
    "long-decode",
    "like healthy, but every fifth generation runs ~4x the decode stuck floor while producing tokens steadily",
    shape=_long_decode_shape,
))
register(Scenario(
    "decode-restart",
    "decode-0 is restarted alone at restart_at; the prefill's bootstrap state still names its old NIXL agent, "
    "so every later request routed to decode-0 hangs in transfer on both legs while decode-1 keeps serving",
    actions=lambda params: [(params.restart_at, "restart", "decode-0")],
    expects_stuck=True,
))
