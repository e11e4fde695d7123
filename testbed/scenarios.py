"""Scenarios: what load the router sends and what faults happen when.

A scenario is a request shape (prompt and output length per request), extra
engine arguments per instance, and timed actions on the running stack. New
ones (freeze-decode, tp-desync, kv-starvation, burst, total-wedge) register
here without touching the stack: `register(Scenario(...))`. The live SGLang
stack keeps its own `Catalogue` of the same `Scenario`s (`sglang_pd/scenarios.py`).
Scenarios tagged `ordinary` are an ordinary day of a PD cluster (scale-down,
scale-up, rolling restart, an idle decode killed, overload, an idle spell):
none of them may page or leave a stuck leg.
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
    overload_s: float = 90.0  # how long the `overload` action sends above capacity
    overload_factor: float = 8.0  # times the rate it sends at meanwhile
    idle_s: float = 120.0  # how long the `idle` action sends nothing


# (seconds after the load starts, action name, instance): the Stack calls `_action_<name>(instance)`.
Action = tuple[float, str, str]
Shape = Callable[[Params, random.Random, int], tuple[int, int]]
Actions = Callable[[Params], list[Action]]
EngineArgs = Callable[[Params, str], list[str]]


def default_shape(params: Params, rng: random.Random, index: int) -> tuple[int, int]:
    return rng.randint(32, 256), rng.randint(8, 32)


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str  # may be wrapped over lines: kept as one line
    # (params, rng, request index) -> (prompt_tokens, max_tokens)
    shape: Shape = default_shape
    # (params) -> [(seconds after start, action name, instance)]; the Stack runs the actions.
    actions: Actions = lambda params: []
    # (params, instance) -> extra engine arguments (emulated: `python -m pdwatch.testbed.engine`'s)
    engine_args: EngineArgs = lambda params, instance: []
    # The failure family pdwatch's diagnosis should name (None: no family at all).
    family: str | None = None
    # (params) -> {decode instance: TP size}; a size-2 group is two processes with a per-step barrier.
    tp_groups: Callable[[Params], dict[str, int]] = lambda params: {}
    tags: tuple[str, ...] = field(default_factory=tuple)
    # The request rate the CLI uses for this scenario unless told otherwise (None: the engine's default).
    rate: float | None = None
    # (params) -> the most times `rate` its actions send at (the stack's request bound is sized for it).
    peak_factor: Callable[[Params], float] = lambda params: 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "description", " ".join(self.description.split()))  # frozen: set once, here

    @property
    def expects_stuck(self) -> bool:
        """The router's ground truth should end with requests hung: every family pdwatch names is of stuck legs."""
        return self.family is not None


def at_fault(action: str, *instances: str) -> Actions:
    """Actions: `action` on each of `instances`, all at `restart_at`."""

    def actions(params: Params) -> list[Action]:
        return [(params.restart_at, action, instance) for instance in instances]

    return actions


def args_on(target: str, *args: str) -> EngineArgs:
    """Engine arguments: `args` for one instance (`decode-0`) or every instance of a role (`decode`)."""

    def engine_args(params: Params, instance: str) -> list[str]:
        return list(args) if instance == target or instance.startswith(f"{target}-") else []

    return engine_args


class Catalogue:
    """The scenarios of one engine, by name."""

    def __init__(self, engine: str | None = None) -> None:
        self.by_name: dict[str, Scenario] = {}
        self._for = f" for --engine {engine}" if engine else ""

    def register(self, scenario: Scenario) -> Scenario:
        if scenario.name in self.by_name:
            raise ValueError(f"scenario {scenario.name!r} is already registered")
        self.by_name[scenario.name] = scenario
        return scenario

    def get(self, name: str) -> Scenario:
        try:
            return self.by_name[name]
        except KeyError:
            raise ValueError(f"unknown scenario {name!r}{self._for} "
                             f"(choose from {', '.join(sorted(self.by_name))})") from None


CATALOGUE = Catalogue()
SCENARIOS = CATALOGUE.by_name
register = CATALOGUE.register
get = CATALOGUE.get


def long_decodes(base: Shape, cap: int | None = None) -> Shape:
    """`base`, but every fifth generation runs about 4x the decode stuck floor, at most `cap` tokens."""

    def shape(params: Params, rng: random.Random, index: int) -> tuple[int, int]:
        prompt, out = base(params, rng, index)
        if index % 5 == 2:
            # About 4x the decode stuck floor, producing a token every step all along.
            out = math.ceil(4 * params.decode_floor_s / params.token_interval_s)
            out = out if cap is None else min(cap, out)
        return prompt, out

    return shape


# One scenario a call: its name and mechanics on the first line, what happens in prose below.
register(Scenario("healthy", "steady load; every request completes"))
register(Scenario("long-decode", shape=long_decodes(default_shape), description="""
    like healthy, but every fifth generation runs ~4x the decode stuck floor while producing tokens steadily"""))
register(Scenario("decode-restart", actions=at_fault("restart", "decode-0"), family="transfer_wedge", description="""
    decode-0 is restarted alone at restart_at; the prefill's bootstrap state still names its old NIXL agent,
    so every later request routed to decode-0 hangs in transfer on both legs while decode-1 keeps serving"""))
register(Scenario("freeze-decode", actions=at_fault("freeze", "decode-0"), family="engine_silent", description="""
    decode-0 is SIGSTOPped at restart_at (continued only when the stack stops): no heartbeats, no progress,
    its requests hang while decode-1 keeps serving"""))
register(Scenario("tp-desync", actions=at_fault("desync", "decode-0"), family="collective_desync",
                  tp_groups=lambda params: {"decode-0": 2}, description="""
    decode-0 is a TP-2 group with a per-step barrier between its two processes; at restart_at rank 1 stops
    joining the step, so rank 0 waits in the collective for good (loop frozen, heartbeats on, its GPU spinning
    at ~100 %) while decode-1 keeps serving"""))
register(replace(get("tp-desync"), name="tp-desync-idle", actions=at_fault("desync-idle", "decode-0"), rate=0.5,
                 description="""
    like tp-desync, at a quiet rate (0.5 req/s by default), and rank 1 stops joining at a moment decode-0 holds
    no request: its leader hangs in an idle collective, so no request reaches it and none of its legs opens
    again; the prefill legs of the requests routed to it wait in bootstrap while decode-1 keeps serving"""))


def _some_long_shape(params: Params, rng: random.Random, index: int) -> tuple[int, int]:
    prompt, out = default_shape(params, rng, index)
    if index % 10 == 0:
        out = math.ceil(10.0 / params.token_interval_s)  # a ~10 s generation (round robin sends it to decode-0)
    return prompt, out


register(Scenario("kv-starvation", shape=_some_long_shape, engine_args=args_on("decode-0", "--slots", "8"),
                  actions=at_fault("kv_leak", "decode-0"), family="queue_starvation", description="""
    decode-0 has 8 KV slots and from restart_at leaks the slot of every request it finishes: its running
    requests (every tenth one a ~10 s generation) keep completing while the pool drains, then new ones wait in
    decode bootstrap for KV memory"""))
register(Scenario("long-prompt-wedge", engine_args=args_on("prefill-0", "--hang-prompts-over", "200"),
                  family="transfer_wedge", tags=("contrast",), description="""
    the prefill's KV writes of prompts over 200 tokens are never posted: those requests (a fifth of them) hang
    in transfer on both legs while shorter ones keep completing through both decodes"""))
register(Scenario("scattered-wedge", engine_args=args_on("prefill-0", "--hang-fraction", "0.17"),
                  family="transfer_wedge", tags=("contrast",), description="""
    one in six of the prefill's KV writes, chosen at random, is never posted: hung requests of every length,
    through both decodes, with nothing in common"""))
register(Scenario("burst", engine_args=args_on("decode", "--max-running", "8"), actions=at_fault("burst", "router"),
                  description="""
    steady load plus burst_size requests at once at restart_at, with 8 running requests per decode at most:
    they queue for seconds (far past the usual queueing) but under the stuck floor, then drain"""))
register(Scenario("total-wedge", actions=at_fault("restart", "decode-0", "decode-1"), family="total_wedge",
                  description="""
    every decode is restarted alone at restart_at; the prefill's bootstrap state names their old NIXL agents,
    so every later request hangs in transfer and nothing finishes anywhere"""))


# An ordinary day: what operators and autoscalers do to a healthy cluster. Nothing here may page.
ORDINARY = "ordinary"
register(Scenario("scale-down", actions=at_fault("scale_down", "decode-0"), tags=(ORDINARY,), description="""
    at restart_at decode-0 is taken out of the router, drained (its requests finish; bounded wait), then sent
    SIGTERM: its clean exit sends the recorder's final heartbeat, so it departs, while decode-1 serves on"""))
register(Scenario("scale-up", actions=at_fault("scale_up", "decode-2"), tags=(ORDINARY,), description="""
    at restart_at a new decode, decode-2, starts and joins the router while the load flows; it serves its share
    from then on"""))
register(Scenario("rolling-restart", actions=at_fault("rolling_restart", "decode"), tags=(ORDINARY,),
                  description="""
    from restart_at every decode in turn is taken out of the router, drained, sent SIGTERM (it deregisters from
    the prefill's bootstrap server and departs), started again and put back once ready; the next waits until a
    request to the restarted one completed"""))
register(Scenario("kill-idle", actions=at_fault("kill_idle", "decode-0"), rate=1.0, tags=(ORDINARY,),
                  description="""
    from restart_at, at the first moment decode-0 holds nothing and its recorder has sent two heartbeats
    saying so (bounded wait), it is SIGKILLed and taken out of the router, as a Service drops a dead pod: down
    with nothing open, a warning"""))
register(Scenario("overload", engine_args=args_on("decode", "--max-running", "1"), rate=0.5,
                  actions=at_fault("overload", "router"), peak_factor=lambda params: params.overload_factor,
                  tags=(ORDINARY,), description="""
    decodes run one request at a time (about 2 req/s together, at 0.5 req/s by default); at restart_at
    arrivals go to overload_factor (8) times the rate for overload_s (90 s), about twice what the decodes
    serve, then back: the queues grow for a minute and more, in arrival order, and drain"""))
register(Scenario("idle", actions=at_fault("idle", "router"), tags=(ORDINARY,), description="""
    at restart_at arrivals stop for idle_s (120 s), longer than every window the sidecar and the rules keep
    (flow window, the rules' ranges), then resume: the engines heartbeat idle, then serve again"""))


def ordinary() -> list[str]:
    """The ordinary-day scenarios' names, in catalogue order."""
    return [name for name, sc in SCENARIOS.items() if ORDINARY in sc.tags]
