"""The plugin's cost per request on a live SGLang PD pair: latency with pdwatch against without, one run.

Two live stacks run side by side on this CPU, identical but for pdwatch's
plugin: one has it (exporting to a real `pdwatch serve`), the other does not
(SGLang loads only the testbed's CPU support). Each is one prefill, one
decode and SGLang's router. An idle stack costs nothing here
(`--sleep-on-idle`), so the requests alternate between them, one at a time,
each prompt sent to both, and both see the same machine at the same moments.
Two stacks that are the same differ by a few per cent on this machine (which
started first, where their processes landed), more than the effect sought,
so the run has an even number of rounds (--rounds, default 2) on fresh
stacks, the plugin in the first-started slot in odd rounds and in the second
in even ones: the slot's share cancels in the mean of the two slots' means.
Printed per round: median and p90 end-to-end latency through each router,
and the median of the differences between each request with the plugin and
its twin without, as a share of the median without, with a bootstrap 95 %
interval. Then for all rounds: the mean of the slots' means with a 95 %
interval from the spread of the rounds within each slot (four rounds or
more; with two, from the rounds' own bootstraps, which leaves the slot's
spread out). Goal: under 1 % of the median; "met" only if the whole
interval lies under it, "not shown" if it straddles 1 %.

With --sink none, A's plugin exports to a loopback port where nobody listens:
the difference is then the plugin's own (hooks, recorder, exporter), without
the sidecar's ingest and judge, which on this 2-core machine run on the same
cores as both stacks (on a GPU node they have cores of their own).

The hook cost per transition on the scheduler thread is bench/sglang_hook_cost.py.

    python bench/sglang_live_cost.py [--rounds 2] [--requests 200] [--max-tokens 16] [--sink sidecar|none]
"""

from __future__ import annotations

import http.client
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.lib, from the project's root

from bench.lib.live_ab import announce, arguments, report_latency, round_result, summarize, verdict
from bench.lib.live_ab import cpu_s as processes_cpu_s
from pdwatch import contract as c
from pdwatch.testbed.processes import free_port
from pdwatch.testbed.sglang_pd.stack import SglangStack
from pdwatch.testbed.sidecar_process import SidecarProcess

MAX_FAILED = 3  # failed requests a round survives (each explained); more ends the run
HEARTBEAT_WAIT_S = 2.5  # the plugin's heartbeat interval (1 s) and then some


def one_request(port: int, ids: list[int], max_tokens: int) -> float:
    body = json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True}})
    t = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/generate", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}")
    finally:
        conn.close()
    return time.perf_counter() - t


def cpu_s(stack: SglangStack) -> float:
    """CPU seconds (user + system) of every process of the stack's servers and router so far."""
    return processes_cpu_s(engine.pid for engine in (*stack.servers.values(), stack.sglang_router))


def engine_counts(sidecar: SidecarProcess | None, cluster: str) -> dict[str, tuple[int, float]]:
    """Each plugin instance's scheduler loop turns (pd.loop.iterations) and its recorder thread's CPU
    seconds so far, from the sidecar."""
    if sidecar is None:
        return {}
    return {i["role"]: (i["ranks"][0]["loop_iterations"] or 0,
                        i["ranks"][0]["engine"].get(c.H_WORKER_CPU, 0.0))
            for i in sidecar.get("/api/v1/summary")["instances"] if i["cluster"] == cluster and i["ranks"]}


def explain_failure(name: str, i: int, error: Exception, stack: SglangStack, sidecar: SidecarProcess | None) -> None:
    """What a failed request leaves to read: which stack, what the sidecar holds open or stuck there
    (the plugin's stack only), and the tail of each of its servers' logs."""
    print(f"request {i} through the stack {name} the plugin failed: {type(error).__name__}: {error}", flush=True)
    if name == "with" and sidecar is not None:
        try:
            stuck = [leg for leg in sidecar.get(c.PATH_STUCK) if leg.get("cluster") == stack.cluster]
            print(f"  the sidecar's stuck legs there: {json.dumps(stuck)[:2000]}")
            for inst in sidecar.get("/api/v1/summary")["instances"]:
                if inst["cluster"] == stack.cluster:
                    print(f"  {inst['pd_instance']}: open {json.dumps(inst['open'])}")
        except Exception as e:  # the explanation must not hide the failure
            print(f"  (the sidecar could not be read: {e})")
    for server in (*stack.servers.values(), stack.sglang_router):
        print(f"  --- {server.instance}, last lines:\n" + server.tail(12), flush=True)


def one_round(args, endpoint: str, plugin_first: bool, rng: random.Random, label: str,
              sidecar: SidecarProcess | None) -> dict:
    """Stacks in slots 1 and 2 (started in that order), the plugin in one of them; paired latencies."""
    stacks = {}
    try:
        # One after the other: two stacks starting at once starve each other's start-up.
        for slot, plugin in ((1, plugin_first), (2, not plugin_first)):
            stacks["with" if plugin else "without"] = SglangStack(
                "healthy", otlp_endpoint=endpoint, decodes=1, plugin=plugin, cluster=f"bench-{label}-{slot}",
                load=False).start()
        ports = {name: s.sglang_router.port for name, s in stacks.items()}
        lat: dict[str, list[float]] = {"with": [], "without": []}
        cpu: dict[str, float] = {}
        counts: dict[str, tuple[int, float]] = {}
        failed = {"with": 0, "without": 0}
        for i in range(args.warmup + args.requests):
            if i == args.warmup:
                cpu = {name: cpu_s(s) for name, s in stacks.items()}
                time.sleep(HEARTBEAT_WAIT_S)  # the warm-up's last heartbeat
                counts = engine_counts(sidecar, stacks["with"].cluster)
            ids = [rng.randrange(3, 1000) for _ in range(args.prompt_tokens)]
            order = ("with", "without") if i % 2 == 0 else ("without", "with")
            took = {}
            for name in order:
                try:
                    took[name] = one_request(ports[name], ids, args.max_tokens)
                except (OSError, RuntimeError, http.client.HTTPException) as e:
                    failed[name] += 1
                    explain_failure(name, i, e, stacks[name], sidecar)
                    if sum(failed.values()) > MAX_FAILED:
                        raise RuntimeError(f"more than {MAX_FAILED} failed requests in one round: {failed}") from e
            # A pair with a failed request is left out of both columns, so the twins stay twins.
            if i >= args.warmup and len(took) == 2:
                for name, t in took.items():
                    lat[name].append(t)
        cpu = {name: (cpu_s(s) - cpu[name]) / args.requests for name, s in stacks.items()}
        time.sleep(HEARTBEAT_WAIT_S)
        turns, recorder_cpu = {}, {}
        for role, (n, cpu_now) in engine_counts(sidecar, stacks["with"].cluster).items():
            n0, cpu0 = counts.get(role, (0, 0.0))
            turns[role] = (n - n0) / args.requests
            recorder_cpu[role] = (cpu_now - cpu0) / args.requests
    finally:
        for s in stacks.values():
            s.stop()
    return round_result(lat, cpu, failed, turns=turns, recorder_cpu=recorder_cpu)


def main() -> int:
    args = arguments(__doc__.splitlines()[0], "plugin", requests=200)
    rng, brng = random.Random(7), random.Random(11)
    rounds = []
    with SidecarProcess(env={c.ENV_NVML: "off", c.ENV_LOG_LEVEL: "warning"}) as sidecar:
        endpoint = sidecar.url if args.sink == "sidecar" else f"http://127.0.0.1:{free_port()}"  # nobody listens
        announce(args, "plugin")
        for k in range(1, args.rounds + 1):
            r = one_round(args, endpoint, k % 2 == 1, rng, f"r{k}", sidecar if args.sink == "sidecar" else None)
            r["slot"] = "first" if k % 2 == 1 else "second"
            rounds.append(r)
            report_round(k, r, brng)
        summary = sidecar.get("/api/v1/summary") if args.sink == "sidecar" else None
    lo, hi = summarize(rounds, brng)
    if summary is not None:
        errors = [r["engine"].get(c.H_HOOK_ERRORS, 0) for i in summary["instances"]
                  if i["cluster"].startswith("bench-") for r in i["ranks"]]
        print(f"hook errors on the plugin's ranks: {errors}")
    print(f"goal (< 1 % of the median): {verdict(lo, hi)}")
    return 0


def report_round(k: int, r: dict, brng: random.Random) -> None:
    report_latency(k, r, brng)
    if r["turns"]:
        # Wrapped calls every turn: decode 1 (loop tick), prefill 3 (loop tick, bootstrap pop,
        # batch pick); the cost per call is sglang_hook_cost.py's.
        print("  scheduler loop turns per request: " + ", ".join(
            f"{role} {n:.1f}" for role, n in sorted(r["turns"].items())))
        # The recorder thread's share of the CPU added: span building, heartbeats, posting.
        print("  recorder thread CPU per request (of the added CPU above): " + ", ".join(
            f"{role} {s * 1e3:.3f} ms" for role, s in sorted(r["recorder_cpu"].items())), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
