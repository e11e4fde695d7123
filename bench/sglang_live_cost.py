"""The plugin's cost per request on a live SGLang PD pair: latency with pdwatch against without, one run.

Two live stacks run side by side on this CPU, identical but for pdwatch's
plugin: A has it (exporting to a real `pdwatch serve`), B does not (SGLang
loads only the testbed's CPU support). Each is one prefill, one decode and
SGLang's router. An idle stack costs nothing here (`--sleep-on-idle`), so the
requests alternate A, B, A, B, one at a time, and both see the same machine
at the same moments. Printed: median and p90 end-to-end latency through each
router, their difference and its share of B's median, with a bootstrap 95 %
interval of the difference of medians. Goal: under 1 % of the median.

With --sink none, A's plugin exports to a loopback port where nobody listens:
the difference is then the plugin's own (hooks, recorder, exporter), without
the sidecar's ingest and judge, which on this 2-core machine run on the same
cores as both stacks (on a GPU node they have cores of their own).

The hook cost per transition on the scheduler thread is bench/sglang_hook_cost.py.

    python bench/sglang_live_cost.py [--requests 200] [--max-tokens 16] [--sink sidecar|none]
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import time

from pdwatch.testbed.processes import free_port
from pdwatch.testbed.sglang_pd.stack import SglangStack
from pdwatch.testbed.sidecar_process import SidecarProcess


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


def p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200, help="requests per stack (default 200)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--sink", choices=("sidecar", "none"), default="sidecar",
                    help="where A's plugin exports: a real pdwatch serve on this machine (default), or a closed "
                         "loopback port, so that the sidecar's own CPU, which shares these two cores with both "
                         "stacks, is left out of the difference")
    args = ap.parse_args()
    rng = random.Random(7)
    with SidecarProcess(env={"PDWATCH_NVML": "off", "PDWATCH_LOG_LEVEL": "warning"}) as sidecar:
        stacks = {}
        endpoint = sidecar.url if args.sink == "sidecar" else f"http://127.0.0.1:{free_port()}"  # nobody listens
        try:
            # One after the other: two stacks starting at once starve each other's start-up.
            for name, plugin in (("A", True), ("B", False)):
                stacks[name] = SglangStack("healthy", otlp_endpoint=endpoint, decodes=1, plugin=plugin,
                                           cluster=f"bench-{name}", load=False).start()
            ports = {name: s.sglang_router.port for name, s in stacks.items()}
            lat: dict[str, list[float]] = {"A": [], "B": []}
            for i in range(args.warmup + args.requests):
                ids = [rng.randrange(3, 1000) for _ in range(args.prompt_tokens)]
                order = ("A", "B") if i % 2 == 0 else ("B", "A")
                for name in order:
                    t = one_request(ports[name], ids, args.max_tokens)
                    if i >= args.warmup:
                        lat[name].append(t)
            summary = sidecar.get("/api/v1/summary")
        finally:
            for s in stacks.values():
                s.stop()
    med = {k: statistics.median(v) for k, v in lat.items()}
    diff = med["A"] - med["B"]
    boot = []
    brng = random.Random(11)
    for _ in range(2000):
        a = [brng.choice(lat["A"]) for _ in lat["A"]]
        b = [brng.choice(lat["B"]) for _ in lat["B"]]
        boot.append(statistics.median(a) - statistics.median(b))
    boot.sort()
    lo, hi = boot[int(0.025 * len(boot))], boot[int(0.975 * len(boot))]
    errors = [r["engine"].get("pdwatch.recorder.hook_errors", 0) for i in summary["instances"]
              if i["cluster"] == "bench-A" for r in i["ranks"]] if args.sink == "sidecar" else "not read (no sidecar)"
    print(f"requests per stack: {args.requests} (prompt {args.prompt_tokens}, {args.max_tokens} new tokens), "
          f"alternating, one at a time; A exports to {'a live sidecar' if args.sink == 'sidecar' else 'nowhere'}")
    print(f"A, pdwatch plugin:  median {med['A'] * 1e3:7.2f} ms   p90 {p90(lat['A']) * 1e3:7.2f} ms")
    print(f"B, without it:      median {med['B'] * 1e3:7.2f} ms   p90 {p90(lat['B']) * 1e3:7.2f} ms")
    print(f"difference of medians: {diff * 1e3:+.3f} ms = {diff / med['B'] * 100:+.2f} % of B's median "
          f"(bootstrap 95 %: {lo * 1e3:+.3f} .. {hi * 1e3:+.3f} ms, {lo / med['B'] * 100:+.2f} .. "
          f"{hi / med['B'] * 100:+.2f} %)")
    print(f"ratio A/B: {med['A'] / med['B']:.3f}; hook errors on A's ranks: {errors}")
    met = diff / med["B"] < 0.01
    print(f"goal (< 1 % of the median): {'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
