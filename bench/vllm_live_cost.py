"""The adapter's cost per request on a live vLLM PD pair: latency with pdwatch against without, one run.

The design of bench/sglang_live_cost.py, on vLLM: two live stacks side by side
on this CPU, identical but for pdwatch's adapter (PDWATCH_VLLM=1 against 0: the
same connector class, its hooks installed or not), each one prefill and one
decode, vLLM 0.32 from build/vllm. An idle vLLM EngineCore blocks on its input
queue, so the requests alternate between the stacks, one at a time, each
prompt sent to both; a request is the testbed proxy's two calls (the prefill
with max_tokens 1, then the decode with the prefill's kv_transfer_params),
timed end to end. The adapter's stack starts first in odd rounds and second in
even ones, so the slot's share cancels in the mean of the two slots' means.
Goal: under 1 % of the median request latency; "met" only if the whole 95 %
interval lies under it.

The hook cost per transition on the scheduler thread is bench/vllm_hook_cost.py.

    python bench/vllm_live_cost.py [--rounds 2] [--requests 150] [--max-tokens 16] [--sink sidecar|none]
"""

from __future__ import annotations

import argparse
import http.client
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.lib, from the project's root

from bench.lib.live_ab import announce, arguments, report_latency, round_result, summarize, verdict
from bench.lib.live_ab import cpu_s as processes_cpu_s
from pdwatch import contract as c
from pdwatch.testbed.processes import free_port
from pdwatch.testbed.sglang_pd.model import VOCAB
from pdwatch.testbed.sidecar_process import SidecarProcess
from pdwatch.testbed.vllm_pd.stack import VllmStack, post_completion

MAX_FAILED = 3  # failed requests a round survives; more ends the run
HEARTBEAT_S = 2.0  # the adapter's default


def one_request(stack: VllmStack, ids: list[int], max_tokens: int) -> float:
    """The testbed proxy's two calls, timed end to end."""
    prefill, decode = stack.servers["prefill-0"].ports.http, stack.servers["decode-0"].ports.http
    t = time.perf_counter()
    first = post_completion(prefill, {"model": stack.model, "prompt": ids, "max_tokens": 1, "temperature": 0,
                           "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                                  "remote_engine_id": None, "remote_block_ids": None,
                                                  "remote_host": None, "remote_port": None}})
    post_completion(decode, {"model": stack.model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                  "ignore_eos": True, "kv_transfer_params": first["kv_transfer_params"]})
    return time.perf_counter() - t


def cpu_s(stack: VllmStack) -> float:
    """CPU seconds (user + system) of every process of the stack's servers so far."""
    return processes_cpu_s(server.pid for server in stack.servers.values())


def one_round(args: argparse.Namespace, endpoint: str, adapter_first: bool, rng: random.Random, label: str) -> dict:
    stacks: dict[str, VllmStack] = {}
    try:
        # One after the other: two stacks starting at once starve each other's start-up.
        for slot, adapter in ((1, adapter_first), (2, not adapter_first)):
            stacks["with" if adapter else "without"] = VllmStack(
                "healthy", otlp_endpoint=endpoint, decodes=1, plugin=adapter, cluster=f"bench-vllm-{label}-{slot}",
                heartbeat_s=HEARTBEAT_S, load=False).start()
        lat: dict[str, list[float]] = {"with": [], "without": []}
        cpu: dict[str, float] = {}
        failed = {"with": 0, "without": 0}
        for i in range(args.warmup + args.requests):
            if i == args.warmup:
                cpu = {name: cpu_s(s) for name, s in stacks.items()}
            ids = [rng.randrange(3, VOCAB) for _ in range(args.prompt_tokens)]
            order = ("with", "without") if i % 2 == 0 else ("without", "with")
            took = {}
            for name in order:
                try:
                    took[name] = one_request(stacks[name], ids, args.max_tokens)
                except (OSError, RuntimeError, KeyError, http.client.HTTPException) as e:
                    failed[name] += 1
                    print(f"request {i} through the stack {name} the adapter failed: {type(e).__name__}: {e}",
                          flush=True)
                    if sum(failed.values()) > MAX_FAILED:
                        raise RuntimeError(f"more than {MAX_FAILED} failed requests in one round: {failed}") from e
            if i >= args.warmup and len(took) == 2:  # a pair with a failed request is left out of both columns
                for name, t in took.items():
                    lat[name].append(t)
        cpu = {name: (cpu_s(s) - cpu[name]) / args.requests for name, s in stacks.items()}
    finally:
        for s in stacks.values():
            s.stop()
    return round_result(lat, cpu, failed)


def main() -> int:
    args = arguments(__doc__.splitlines()[0], "adapter", requests=150)
    rng, brng = random.Random(7), random.Random(11)
    rounds = []
    with SidecarProcess(env={c.ENV_NVML: "off", c.ENV_LOG_LEVEL: "warning"}) as sidecar:
        endpoint = sidecar.url if args.sink == "sidecar" else f"http://127.0.0.1:{free_port()}"  # nobody listens
        announce(args, "adapter")
        for k in range(1, args.rounds + 1):
            r = one_round(args, endpoint, k % 2 == 1, rng, f"r{k}")
            r["slot"] = "first" if k % 2 == 1 else "second"
            rounds.append(r)
            report_latency(k, r, brng, what="adapter")
        summary = sidecar.get("/api/v1/summary") if args.sink == "sidecar" else None
    lo, hi = summarize(rounds, brng, what="adapter")
    if summary is not None:
        ranks = [(i["pd_instance"], r["engine"].get(c.H_HOOK_ERRORS, 0), i["plugin_state"])
                 for i in summary["instances"] if i["cluster"].startswith("bench-vllm-") for r in i["ranks"]]
        print(f"the adapter's ranks (instance, hook errors, plugin state): {ranks}")
    print(f"goal (< 1 % of the median): {verdict(lo, hi)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
