"""Scenarios: what load the router sends and what faults happen when.

A scenario is a request shape (prompt and output length per request), extra
engine arguments per instance, and timed actions on the running stack. New
ones (freeze-decode, tp-desync, kv-starvation, burst, total-wedge) register
here without touching the stack: `register(Scenario(...))`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Params:
    """Knobs a scenario may read; the Stack fills them from its arguments."""

    rate: float = 4.0
    restart_at: float = 8.0
    decode_floor_s: float = 30.0
    token_interval_s: float = 0.05
    burst_size: int = 40  # requests the `burst` action sends at once


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
    # (params, instance) -> extra `python -m pdwatch.testbed.engine` arguments
    engine_args: Callable[[Params, str], list[str]] = lambda params, instance: []
    # The router's ground truth should end with requests hung.
    expects_stuck: bool = False
    # The failure family pdwatch's diagnosis should name (None: no family at all).
    family: str | None = None
    # (params) -> {decode instance: TP size}; a size-2 group is two processes with a per-step barrier.
    tp_groups: Callable[[Params], dict[str, int]] = lambda params: {}
    tags: tuple[str, ...] = field(default_factory=tuple)
    # The request rate the CLI uses for this scenario unless told otherwise (None: the engine's default).
    rate: float | None = None


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
    family="transfer_wedge",
))
register(Scenario(
    "freeze-decode",
    "decode-0 is SIGSTOPped at restart_at (continued only when the stack stops): no heartbeats, no progress, "
    "its requests hang while decode-1 keeps serving",
    actions=lambda params: [(params.restart_at, "freeze", "decode-0")],
    expects_stuck=True,
    family="engine_silent",
))
register(Scenario(
    "tp-desync",
    "decode-0 is a TP-2 group with a per-step barrier between its two processes; at restart_at rank 1 stops "
    "joining the step, so rank 0 waits in the collective for good (loop frozen, heartbeats on, its GPU spinning "
    "at ~100 %) while decode-1 keeps serving",
    tp_groups=lambda params: {"decode-0": 2},
    actions=lambda params: [(params.restart_at, "desync", "decode-0")],
    expects_stuck=True,
    family="collective_desync",
))
register(replace(
    get("tp-desync"),
    name="tp-desync-idle",
    description="like tp-desync, at a quiet rate (0.5 req/s by default), and rank 1 stops joining at a moment "
    "decode-0 holds no request: its leader hangs in an idle collective, so no request reaches it and none of its "
    "legs opens again; the prefill legs of the requests routed to it wait in bootstrap while decode-1 keeps serving",
    actions=lambda params: [(params.restart_at, "desync-idle", "decode-0")],
    rate=0.5,
))


def _some_long_shape(params: Params, rng: random.Random, index: int) -> tuple[int, int]:
    prompt, out = default_shape(params, rng, index)
    if index % 10 == 0:
        out = math.ceil(10.0 / params.token_interval_s)  # a ~10 s generation (round robin sends it to decode-0)
    return prompt, out


register(Scenario(
    "kv-starvation",
    "decode-0 has 8 KV slots and from restart_at leaks the slot of every request it finishes: its running "
    "requests (every tenth one a ~10 s generation) keep completing while the pool drains, then new ones wait in "
    "decode bootstrap for KV memory",
    shape=_some_long_shape,
    engine_args=lambda params, instance: ["--slots", "8"] if instance == "decode-0" else [],
    actions=lambda params: [(params.restart_at, "kv_leak", "decode-0")],
    expects_stuck=True,
    family="queue_starvation",
))
register(Scenario(
    "long-prompt-wedge",
    "the prefill's KV writes of prompts over 200 tokens are never posted: those requests (a fifth of them) hang "
    "in transfer on both legs while shorter ones keep completing through both decodes",
    engine_args=lambda params, instance: ["--hang-prompts-over", "200"] if instance == "prefill-0" else [],
    expects_stuck=True,
    family="transfer_wedge",
    tags=("contrast",),
))
register(Scenario(
    "scattered-wedge",
    "one in six of the prefill's KV writes, chosen at random, is never posted: hung requests of every length, "
    "through both decodes, with nothing in common",
    engine_args=lambda params, instance: ["--hang-fraction", "0.17"] if instance == "prefill-0" else [],
    expects_stuck=True,
    family="transfer_wedge",
    tags=("contrast",),
))
register(Scenario(
    "burst",
    "steady load plus burst_size requests at once at restart_at, with 8 running requests per decode at most: "
    "they queue for seconds (far past the usual queueing) but under the stuck floor, then drain",
    engine_args=lambda params, instance: ["--max-running", "8"] if instance.startswith("decode") else [],
    actions=lambda params: [(params.restart_at, "burst", "router")],
))
register(Scenario(
    "total-wedge",
    "every decode is restarted alone at restart_at; the prefill's bootstrap state names their old NIXL agents, "
    "so every later request hangs in transfer and nothing finishes anywhere",
    actions=lambda params: [(params.restart_at, "restart", "decode-0"), (params.restart_at, "restart", "decode-1")],
    expects_stuck=True,
    family="total_wedge",
))
