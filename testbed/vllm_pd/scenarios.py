"""Scenarios of the live vLLM stack: the other stacks' names where the fault exists in vLLM.

Each fault happens in vLLM's own code or at its transport boundary, never in
pdwatch's hooks: a decode killed and started again, a decode stopped with
SIGSTOP, a decode's NIXL READs that never complete, a proxy that holds the
decode call past the prefill's KV lease. The ordinary day's scenarios are an
operator's steps; none of them is an incident. Where a name means something
else here than on SGLang, the description says what vLLM does.
"""

from __future__ import annotations

import random

from ..scenarios import ORDINARY, Action, Actions, Catalogue, Params, Scenario, at_fault, long_decodes


def default_shape(params: Params, rng: random.Random, index: int) -> tuple[int, int]:
    return rng.randint(16, 128), rng.randint(8, 32)


def _in_flight_shape(params: Params, rng: random.Random, index: int) -> tuple[int, int]:
    # Generations of a second or two, so that some are in flight when the fault strikes.
    return rng.randint(16, 128), rng.randint(64, 192)


# lease-expiry: every LATE_EVERY-th request's decode call waits this long past the prefill's answer.
LATE_EVERY = 4
LATE_BY_S = 14.0  # past the testbed's 10 s lease (servers.LEASE_S) by more than a heartbeat


CATALOGUE = Catalogue("vllm")
SCENARIOS = CATALOGUE.by_name
register = CATALOGUE.register
get = CATALOGUE.get
register(Scenario("healthy", shape=default_shape, description="""
    steady load through the testbed's PD proxy; every request completes"""))
# long-decode: the prompt (at most 128) and the longest generation fit the stack's max_model_len (1024).
register(Scenario("long-decode", shape=long_decodes(default_shape, cap=880), description="""
    like healthy, but every fifth generation runs ~4x the decode stuck floor while producing tokens"""))
register(Scenario("decode-restart", shape=_in_flight_shape, actions=at_fault("restart", "decode-0"),
                  description="""
    decode-0 is killed at restart_at and started again alone, on the same ports, while the prefill stays up.
    Unlike SGLang, vLLM's decode pulls and handshakes afresh: the requests in flight on decode-0 fail, the
    prefill frees their blocks when their lease runs out (named), and requests after the restart complete"""))
register(Scenario("freeze-decode", shape=default_shape, actions=at_fault("freeze", "decode-0"),
                  family="engine_silent", description="""
    decode-0 is SIGSTOPped at restart_at (continued when the stack stops): no heartbeats, its legs stop,
    the prefill's blocks for it are freed when their leases run out, while decode-1 keeps serving"""))
register(Scenario("transfer-wedge", shape=default_shape, actions=at_fault("wedge", "decode-0"),
                  family="transfer_wedge", description="""
    from restart_at decode-0's NIXL READs never complete (the transport answers PROC for ever): vLLM keeps
    the request in WAITING_FOR_REMOTE_KVS and keeps the prefill's lease alive with heartbeats, so both legs
    wait in transfer, while requests to decode-1 keep completing"""))
register(Scenario("lease-expiry", shape=default_shape, actions=at_fault("late_decodes", "router"), description=f"""
    from restart_at the proxy holds every {LATE_EVERY}th request {LATE_BY_S:g} s between the prefill's answer
    and the decode call, past the prefill's KV lease: the prefill frees the blocks unread (its leg ends
    timeout, named) and the decode then reads freed blocks; vLLM answers 200 all the same"""))


def _steps(*steps: tuple[str, str]) -> Actions:
    """The steps one after another from restart_at (each action takes as long as it takes)."""
    def actions(params: Params) -> list[Action]:
        return [(params.restart_at + i, action, instance) for i, (action, instance) in enumerate(steps)]

    return actions


register(Scenario("scale-down", shape=default_shape, actions=_steps(("scale_down", "decode-1")), tags=(ORDINARY,),
                  description="""
    decode-1 is taken out of the proxy, drained, then its API server gets SIGTERM: vLLM stops its engine in
    order (--shutdown-timeout), the connector's shutdown sends pdwatch's final heartbeat, it departs"""))
register(Scenario("kill-idle", shape=default_shape, actions=_steps(("sigkill_idle", "decode-1")), tags=(ORDINARY,),
                  description="""
    the load pauses, decode-1 holding nothing is SIGKILLed and taken out of the proxy, then the load resumes
    on decode-0: a silent engine that held nothing (a warning, never a page)"""))
register(Scenario("idle", shape=default_shape, actions=_steps(("idle", "router")), tags=(ORDINARY,), description="""
    no traffic for 20 s (an idle hour compressed), then traffic again"""))
register(Scenario("ordinary-day", shape=default_shape, actions=_steps(
    ("idle", "router"), ("scale_down", "decode-1"), ("sigkill_idle", "decode-0")), tags=(ORDINARY,), description="""
    idle, scale-down (decode-1) and kill-idle (decode-0, the last decode: the load finds none after it), one
    after another in one stack: must page nothing and leave no stuck leg. No scale-up here: a vLLM server
    starting beside a serving stack takes this two-core machine for a minute and stalled the running decode's
    loop for 4-14 s, niced or not, pinned or not, past the loop rule: a limit of the machine, not of a cluster"""))
