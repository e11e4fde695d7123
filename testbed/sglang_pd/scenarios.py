"""Scenarios of the live SGLang stack: the emulated testbed's names where the fault exists here.

Each fault happens in SGLang's own code or at its transport boundary, never in
pdwatch's hooks: a decode process killed and started again, a decode process
stopped with SIGSTOP, or NIXL writes to one decode that never complete. The
ordinary day's scenarios are an operator's steps, through SGLang's router's
worker API and signals as Kubernetes sends them; none of them is an incident.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from ..scenarios import ORDINARY, Action, Catalogue, Params, Scenario, at_fault, long_decodes


def default_shape(params: Params, rng: random.Random, index: int) -> tuple[int, int]:
    return rng.randint(16, 128), rng.randint(8, 32)


def overload_shape(params: Params, rng: random.Random, index: int) -> tuple[int, int]:
    """The overload's requests: generations of a second or two, as _in_flight_shape's."""
    return _in_flight_shape(params, rng, index)


def _in_flight_shape(params: Params, rng: random.Random, index: int) -> tuple[int, int]:
    # Generations of a second or two, so that some are in flight when the fault strikes.
    return rng.randint(16, 128), rng.randint(64, 256)


# The long-prompt-wedge's cut: a write of this many tokens or more hangs. Only every
# fifth prompt reaches it (one chunk: the servers' chunked prefill is 512 tokens).
LONG_PROMPT_TOKENS = 200


def _some_long_prompts(params: Params, rng: random.Random, index: int) -> tuple[int, int]:
    prompt, out = default_shape(params, rng, index)
    if index % 5 == 2:
        prompt = rng.randint(LONG_PROMPT_TOKENS + 100, LONG_PROMPT_TOKENS + 200)
    return prompt, out


# One scenario a call, as in the emulated table; every live one names its shape (the defaults here are shorter).
CATALOGUE = Catalogue("sglang")
SCENARIOS = CATALOGUE.by_name
register = CATALOGUE.register
get = CATALOGUE.get
register(Scenario("healthy", shape=default_shape, description="""
    steady load through SGLang's router; every request completes"""))
# long-decode: the stack's context length must hold those generations (SglangStack(context_length=...)).
register(Scenario("long-decode", shape=long_decodes(default_shape, cap=7000), description="""
    like healthy, but every fifth generation runs ~4x the decode stuck floor while producing tokens"""))
register(Scenario("decode-restart", shape=_in_flight_shape, actions=at_fault("restart", "decode-0"),
                  description="""
    decode-0 is killed at restart_at and started again alone, on the same ports, while the prefill stays up;
    the prefill keeps its old NIXL peer entry. The legs in flight at the kill end failed; requests routed to
    decode-0 while it is down wait in the prefill's bootstrap until SGLang's 300 s bootstrap timeout; once it
    is back, new requests complete"""))
register(Scenario("freeze-decode", shape=default_shape, actions=at_fault("freeze", "decode-0"),
                  family="engine_silent", description="""
    decode-0 is SIGSTOPped at restart_at (continued when the stack stops): no heartbeats, the prefill legs
    routed to it wait in bootstrap or transfer while decode-1 keeps serving"""))
register(Scenario("freeze-loop", shape=_in_flight_shape, actions=at_fault("freeze_loop", "decode-0"),
                  family="collective_desync", description="""
    from restart_at decode-0's scheduler thread blocks at its next batch, as in a collective that never
    completes, while its process lives on and heartbeats; its legs stop, decode-1 keeps serving"""))


def _long_forwards(params: Params) -> list[Action]:
    """Three stalls of decode-0's scheduler, 1.5 s each, 10 s apart from restart_at."""
    return [(params.restart_at + 10 * i + dt, action, "decode-0")
            for i in range(3) for dt, action in ((0.0, "freeze_loop"), (1.5, "thaw_loop"))]


register(Scenario("long-forward", shape=default_shape, actions=_long_forwards, description="""
    like healthy, but three times decode-0's scheduler stands still for 1.5 s inside a batch, as in a long
    forward pass: a loop stall shorter than the loop rule, so nothing is stuck"""))
register(Scenario("transfer-wedge", shape=default_shape, actions=at_fault("wedge", "decode-0"),
                  family="transfer_wedge", description="""
    from restart_at the prefill's NIXL writes to decode-0 never complete (the transport answers PROC for
    ever): SGLang's KV sender keeps polling, the prefill leg stays in its inflight queue and the decode leg
    waits for KV, while requests to decode-1 keep completing"""))
register(Scenario("long-prompt-wedge", shape=_some_long_prompts, actions=at_fault("wedge_long", "prefill-0"),
                  family="transfer_wedge", tags=("contrast",), description=f"""
    from restart_at the prefill's NIXL writes of {LONG_PROMPT_TOKENS} tokens or more never complete, whichever
    decode they go to: the long prompts (every fifth request) hang in transfer on both legs while shorter ones
    keep completing through both decodes"""))


# ---- the ordinary day: an operator's steps, none an incident (SglangStack's _action_<name>) -------------
# Each takes as long as it takes (a decode starts in 25-60 s here); the actions run one after another, each
# no sooner than its time. The decodes a stack starts with are decode-0 and decode-1.


def _steps(*steps: tuple[str, str]) -> Callable[[Params], list[Action]]:
    def actions(params: Params) -> list[Action]:
        return [(params.restart_at + i, action, instance) for i, (action, instance) in enumerate(steps)]

    return actions


register(Scenario("scale-down", shape=default_shape, tags=(ORDINARY,), actions=_steps(("scale_down", "decode-1")), description="""
    decode-1 is taken out of SGLang's router, drained, then its server's parent process gets SIGTERM: it
    leaves in order (departed) while decode-0 serves"""))
register(Scenario("scale-up", shape=default_shape, tags=(ORDINARY,), actions=_steps(("scale_up", "decode-2")), description="""
    a new decode, decode-2, is started and added to SGLang's router while traffic flows"""))
register(Scenario("rolling-restart", shape=default_shape, tags=(ORDINARY,), actions=_steps(("rolling_restart", "decode")),
                  description="""
    every decode, one at a time: out of the router, drained, SIGTERM, started again (fresh ports, as a new
    pod), back in"""))
register(Scenario("kill-idle", shape=default_shape, tags=(ORDINARY,), actions=_steps(("sigkill_idle", "decode-1")),
                  description="""
    the load pauses, decode-1 holding nothing is SIGKILLed and taken out of the router, then the load
    resumes on decode-0: a silent engine that held nothing (a warning, never a page)"""))
register(Scenario("overload", shape=default_shape, tags=(ORDINARY,), actions=_steps(("overload", "router")), description="""
    for 90 s, arrivals at 4 x the rate with generations of a second or two beside the usual load, well
    above what the pair serves here; then back: queues that drain in order are slow, not stuck"""))
register(Scenario("idle", shape=default_shape, tags=(ORDINARY,), actions=_steps(("idle", "router")), description="""
    no traffic for 20 s (an idle hour compressed), then traffic again"""))
register(Scenario("ordinary-day", shape=default_shape, tags=(ORDINARY,), actions=_steps(
    ("scale_down", "decode-1"), ("scale_up", "decode-2"), ("rolling_restart", "decode"), ("idle", "router"),
    ("sigkill_idle", "decode-2"), ("overload", "router")), description="""
    scale-down, scale-up, rolling-restart, idle, kill-idle (decode-2) and overload, one after
    another in one stack: an ordinary day of a PD cluster, which must page nothing and leave no stuck leg"""))
