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

import argparse
import http.client
import json
import random
import statistics
import time

import psutil

from pdwatch import contract as c
from pdwatch.testbed.processes import free_port
from pdwatch.testbed.sglang_pd.stack import SglangStack
from pdwatch.testbed.sidecar_process import SidecarProcess

MAX_FAILED = 3  # failed requests a round survives (each explained); more ends the run
HEARTBEAT_WAIT_S = 2.5  # the plugin's heartbeat interval (1 s) and then some
GOAL = 0.01  # of the median request latency
# Student's t, two-sided 95 %, by degrees of freedom (a fact of the distribution); beyond the table
# the normal 1.96 would be within 2 %.
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
        10: 2.228, 12: 2.179, 14: 2.145, 16: 2.120, 18: 2.101, 20: 2.086, 30: 2.042}


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


def boot_median(xs: list[float], rng: random.Random, n: int = 2000) -> tuple[float, float]:
    """Bootstrap 95 % interval of the median of xs."""
    meds = sorted(statistics.median([rng.choice(xs) for _ in xs]) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n)]


def t975(df: int) -> float:
    """The table's value at df, or at the largest df below it (a wider, safe interval)."""
    return T975[max(k for k in T975 if k <= df)]


def slot_balanced(first: list[float], second: list[float]) -> tuple[float, float, float] | None:
    """The mean of the two slots' mean shares and its 95 % interval, from the spread of rounds within
    each slot; None with fewer than two rounds in either slot."""
    if len(first) < 2 or len(second) < 2:
        return None
    est = (statistics.mean(first) + statistics.mean(second)) / 2
    se = 0.5 * (statistics.variance(first) / len(first) + statistics.variance(second) / len(second)) ** 0.5
    half = t975(len(first) + len(second) - 2) * se
    return est, est - half, est + half


def pooled_bootstrap(rounds: list[dict], rng: random.Random, n: int = 1000) -> tuple[float, float]:
    """95 % interval of the mean of the rounds' median shares, each round resampled on its own."""
    boots = [[statistics.median([rng.choice(r["pairs"]) for _ in r["pairs"]]) / r["base"] for _ in range(n)]
             for r in rounds]
    means = sorted(statistics.mean(column) for column in zip(*boots))
    return means[int(0.025 * n)], means[int(0.975 * n)]


def verdict(lo: float, hi: float) -> str:
    if hi < GOAL:
        return "met (the whole 95 % interval lies under 1 %)"
    if lo >= GOAL:
        return "NOT met (the whole 95 % interval lies at or above 1 %)"
    return "not shown (the 95 % interval straddles 1 %: more rounds, or a quieter machine)"


def cpu_s(stack: SglangStack) -> float:
    """CPU seconds (user + system) of every process of the stack's servers and router so far."""
    total = 0.0
    for engine in (*stack.servers.values(), stack.sglang_router):
        try:
            root = psutil.Process(engine.pid)
            for p in (root, *root.children(recursive=True)):
                t = p.cpu_times()
                total += t.user + t.system
        except psutil.Error:
            pass  # a process that ended between listing and reading
    return total


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
    # Each request with the plugin has a twin without, sent right before or after it with the same
    # prompt: their difference leaves out what the machine was doing at that moment.
    pairs = [a - b for a, b in zip(lat["with"], lat["without"])]
    return {"with": lat["with"], "without": lat["without"], "pairs": pairs, "cpu": cpu, "failed": failed,
            "base": statistics.median(lat["without"]), "diff": statistics.median(pairs), "turns": turns,
            "recorder_cpu": recorder_cpu}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds on fresh stacks, an even number: the plugin's slot alternates (default 2; "
                         "each takes about 4 minutes here)")
    ap.add_argument("--requests", type=int, default=200, help="requests per stack and round (default 200)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--sink", choices=("sidecar", "none"), default="sidecar",
                    help="where the plugin exports: a real pdwatch serve on this machine (default), or a closed "
                         "loopback port, so that the sidecar's own CPU, which shares these two cores with both "
                         "stacks, is left out of the difference")
    args = ap.parse_args()
    if args.rounds < 2 or args.rounds % 2:
        ap.error(f"--rounds must be an even number of at least 2 (each slot the same count), got {args.rounds}")
    for name in ("requests", "prompt_tokens", "max_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        ap.error("--warmup must not be negative")
    rng, brng = random.Random(7), random.Random(11)
    rounds = []
    with SidecarProcess(env={c.ENV_NVML: "off", c.ENV_LOG_LEVEL: "warning"}) as sidecar:
        endpoint = sidecar.url if args.sink == "sidecar" else f"http://127.0.0.1:{free_port()}"  # nobody listens
        print(f"requests per stack and round: {args.requests} (prompt {args.prompt_tokens}, {args.max_tokens} new "
              f"tokens), alternating, one at a time; the plugin exports to "
              f"{'a live sidecar' if args.sink == 'sidecar' else 'nowhere'}; {args.rounds} rounds", flush=True)
        for k in range(1, args.rounds + 1):
            r = one_round(args, endpoint, k % 2 == 1, rng, f"r{k}", sidecar if args.sink == "sidecar" else None)
            r["slot"] = "first" if k % 2 == 1 else "second"
            rounds.append(r)
            report_round(k, r, brng)
        summary = sidecar.get("/api/v1/summary") if args.sink == "sidecar" else None
    shares = {slot: [r["diff"] / r["base"] for r in rounds if r["slot"] == slot] for slot in ("first", "second")}
    cpu = statistics.mean(r["cpu"]["with"] - r["cpu"]["without"] for r in rounds)
    print(f"plugin's share by slot: first-started {statistics.mean(shares['first']) * 100:+.2f} %, "
          f"second-started {statistics.mean(shares['second']) * 100:+.2f} %; CPU per request {cpu * 1e3:+.2f} ms")
    lo_b, hi_b = pooled_bootstrap(rounds, brng)
    balanced = slot_balanced(shares["first"], shares["second"])
    if balanced is None:
        share, lo, hi = statistics.mean(shares["first"] + shares["second"]), lo_b, hi_b
        how = "from the rounds' own bootstraps"
    else:
        share, lo, hi = balanced
        how = f"from the spread of rounds within each slot; the rounds' own bootstraps: {lo_b * 100:+.2f} .. " \
              f"{hi_b * 100:+.2f} %"
    print(f"all {args.rounds} rounds (the slot cancels): the plugin adds {share * 100:+.2f} % of the median request "
          f"latency (95 %: {lo * 100:+.2f} .. {hi * 100:+.2f} %, {how})")
    if summary is not None:
        errors = [r["engine"].get(c.H_HOOK_ERRORS, 0) for i in summary["instances"]
                  if i["cluster"].startswith("bench-") for r in i["ranks"]]
        print(f"hook errors on the plugin's ranks: {errors}")
    print(f"goal (< 1 % of the median): {verdict(lo, hi)}")
    return 0


def report_round(k: int, r: dict, brng: random.Random) -> None:
    lo, hi = boot_median(r["pairs"], brng)
    print(f"round {k} (plugin in the {r['slot']}-started stack): with median {statistics.median(r['with']) * 1e3:6.2f}"
          f" ms p90 {p90(r['with']) * 1e3:6.2f}; without median {r['base'] * 1e3:6.2f} ms p90 "
          f"{p90(r['without']) * 1e3:6.2f}; paired difference {r['diff'] * 1e3:+.3f} ms = "
          f"{r['diff'] / r['base'] * 100:+.2f} % (95 %: {lo / r['base'] * 100:+.2f} .. {hi / r['base'] * 100:+.2f} %)")
    if any(r["failed"].values()):
        print(f"  failed requests (their pairs left out): with the plugin {r['failed']['with']}, "
              f"without {r['failed']['without']}")
    print(f"  CPU per request, all of the stack's processes: with {r['cpu']['with'] * 1e3:.2f} ms, without "
          f"{r['cpu']['without'] * 1e3:.2f} ms ({(r['cpu']['with'] - r['cpu']['without']) * 1e3:+.2f} ms)")
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
