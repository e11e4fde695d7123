"""Scenarios of the live SGLang stack: the emulated testbed's names where the fault exists here.

Each fault happens in SGLang's own code or at its transport boundary, never in
pdwatch's hooks: a decode process killed and started again, a decode process
stopped with SIGSTOP, or NIXL writes to one decode that never complete.
"""

from __future__ import annotations

import math
import random

from ..scenarios import Params, Scenario


def default_shape(params: Params, rng: random.Random, index: int) -> tuple[int, int]:
    return rng.randint(16, 128), rng.randint(8, 32)


def _in_flight_shape(params: Params, rng: random.Random, index: int) -> tuple[int, int]:
    # Generations of a second or two, so that some are in flight when the fault strikes.
    return rng.randint(16, 128), rng.randint(64, 256)


def _long_decode_shape(params: Params, rng: random.Random, index: int) -> tuple[int, int]:
    prompt, out = default_shape(params, rng, index)
    if index % 5 == 2:
        # About 4x the decode floor at params.token_interval_s per token; the stack's context
        # length must hold it (SglangStack(context_length=...)).
        out = min(7000, math.ceil(4 * params.decode_floor_s / params.token_interval_s))
    return prompt, out


# The long-prompt-wedge's cut: a write of this many tokens or more hangs. Only every
# fifth prompt reaches it (one chunk: the servers' chunked prefill is 512 tokens).
LONG_PROMPT_TOKENS = 200


def _some_long_prompts(params: Params, rng: random.Random, index: int) -> tuple[int, int]:
    prompt, out = default_shape(params, rng, index)
    if index % 5 == 2:
        prompt = rng.randint(LONG_PROMPT_TOKENS + 100, LONG_PROMPT_TOKENS + 200)
    return prompt, out


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("healthy", "steady load through SGLang's router; every request completes", shape=default_shape),
    Scenario(
        "long-decode",
        "like healthy, but every fifth generation runs ~4x the decode stuck floor while producing tokens",
        shape=_long_decode_shape,
    ),
    Scenario(
        "decode-restart",
        "decode-0 is killed at restart_at and started again alone, on the same ports, while the prefill "
        "stays up; the prefill keeps its old NIXL peer entry. The legs in flight at the kill end failed; "
        "requests routed to decode-0 while it is down wait in the prefill's bootstrap until SGLang's "
        "300 s bootstrap timeout; once it is back, new requests complete",
        shape=_in_flight_shape,
        actions=lambda params: [(params.restart_at, "restart", "decode-0")],
    ),
    Scenario(
        "freeze-decode",
        "decode-0 is SIGSTOPped at restart_at (continued when the stack stops): no heartbeats, the prefill "
        "legs routed to it wait in bootstrap or transfer while decode-1 keeps serving",
        shape=default_shape,
        actions=lambda params: [(params.restart_at, "freeze", "decode-0")],
        expects_stuck=True,
        family="engine_silent",
    ),
    Scenario(
        "freeze-loop",
        "from restart_at decode-0's scheduler thread blocks at its next batch, as in a collective that "
        "never completes, while its process lives on and heartbeats; its legs stop, decode-1 keeps serving",
        shape=_in_flight_shape,
        actions=lambda params: [(params.restart_at, "freeze_loop", "decode-0")],
        expects_stuck=True,
        family="collective_desync",
    ),
    Scenario(
        "long-forward",
        "like healthy, but three times decode-0's scheduler stands still for 1.5 s inside a batch, as in a "
        "long forward pass: a loop stall shorter than the loop rule, so nothing is stuck",
        shape=default_shape,
        actions=lambda params: [
            (params.restart_at + 10 * i + dt, action, "decode-0")
            for i in range(3) for dt, action in ((0.0, "freeze_loop"), (1.5, "thaw_loop"))],
    ),
    Scenario(
        "transfer-wedge",
        "from restart_at the prefill's NIXL writes to decode-0 never complete (the transport answers PROC "
        "for ever): SGLang's KV sender keeps polling, the prefill leg stays in its inflight queue and the "
        "decode leg waits for KV, while requests to decode-1 keep completing",
        shape=default_shape,
        actions=lambda params: [(params.restart_at, "wedge", "decode-0")],
        expects_stuck=True,
        family="transfer_wedge",
    ),
    Scenario(
        "long-prompt-wedge",
        f"from restart_at the prefill's NIXL writes of {LONG_PROMPT_TOKENS} tokens or more never complete, "
        "whichever decode they go to: the long prompts (every fifth request) hang in transfer on both legs "
        "while shorter ones keep completing through both decodes",
        shape=_some_long_prompts,
        actions=lambda params: [(params.restart_at, "wedge_long", "prefill-0")],
        expects_stuck=True,
        family="transfer_wedge",
        tags=("contrast",),
    ),
)}


def get(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r} for --engine sglang "
                         f"(choose from {', '.join(sorted(SCENARIOS))})") from None
