"""What the live A/B benches share (bench/sglang_live_cost.py, bench/vllm_live_cost.py): the statistics
of paired latencies, with the plugin and without, over rounds whose stacks swap start-up slots, and the
printed verdict against the goal (under 1 % of the median request latency).

A round is a dict: "with" and "without" (latencies, s), "pairs" (with - without, twin by twin), "base"
(the median without), "diff" (the median pair), "slot" ("first" or "second": where the plugin's stack
started), "cpu" ({"with", "without"}: CPU s per request), "failed" ({"with", "without"}: counts).
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Iterable

import psutil

GOAL = 0.01  # of the median request latency
# Student's t, two-sided 95 %, by degrees of freedom (a fact of the distribution); beyond the table
# the normal 1.96 would be within 2 %.
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
        10: 2.228, 12: 2.179, 14: 2.145, 16: 2.120, 18: 2.101, 20: 2.086, 30: 2.042}


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


def report_latency(k: int, r: dict, brng: random.Random, what: str = "plugin") -> None:
    """One round's latencies, paired difference and CPU, as printed lines."""
    lo, hi = boot_median(r["pairs"], brng)
    print(f"round {k} ({what} in the {r['slot']}-started stack): with median {statistics.median(r['with']) * 1e3:6.2f}"
          f" ms p90 {p90(r['with']) * 1e3:6.2f}; without median {r['base'] * 1e3:6.2f} ms p90 "
          f"{p90(r['without']) * 1e3:6.2f}; paired difference {r['diff'] * 1e3:+.3f} ms = "
          f"{r['diff'] / r['base'] * 100:+.2f} % (95 %: {lo / r['base'] * 100:+.2f} .. {hi / r['base'] * 100:+.2f} %)")
    if any(r["failed"].values()):
        print(f"  failed requests (their pairs left out): with the {what} {r['failed']['with']}, "
              f"without {r['failed']['without']}")
    print(f"  CPU per request, all of the stack's processes: with {r['cpu']['with'] * 1e3:.2f} ms, without "
          f"{r['cpu']['without'] * 1e3:.2f} ms ({(r['cpu']['with'] - r['cpu']['without']) * 1e3:+.2f} ms)")


def summarize(rounds: list[dict], brng: random.Random, what: str = "plugin") -> tuple[float, float]:
    """All rounds: each slot's share, the CPU added, the slot-balanced share with its 95 % interval;
    returns the interval's ends."""
    shares = {slot: [r["diff"] / r["base"] for r in rounds if r["slot"] == slot] for slot in ("first", "second")}
    cpu = statistics.mean(r["cpu"]["with"] - r["cpu"]["without"] for r in rounds)
    print(f"{what}'s share by slot: first-started {statistics.mean(shares['first']) * 100:+.2f} %, "
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
    print(f"all {len(rounds)} rounds (the slot cancels): the {what} adds {share * 100:+.2f} % of the median request "
          f"latency (95 %: {lo * 100:+.2f} .. {hi * 100:+.2f} %, {how})")
    return lo, hi


def arguments(description: str, what: str, requests: int) -> argparse.Namespace:
    """The live A/B benches' command line, checked."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--rounds", type=int, default=2,
                    help=f"rounds on fresh stacks, an even number: the {what}'s slot alternates (default 2; "
                         "each takes about 4 minutes here)")
    ap.add_argument("--requests", type=int, default=requests,
                    help=f"requests per stack and round (default {requests})")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--sink", choices=("sidecar", "none"), default="sidecar",
                    help=f"where the {what} exports: a real pdwatch serve on this machine (default), or a closed "
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
    return args


def announce(args: argparse.Namespace, what: str) -> None:
    print(f"requests per stack and round: {args.requests} (prompt {args.prompt_tokens}, {args.max_tokens} new "
          f"tokens), alternating, one at a time; the {what} exports to "
          f"{'a live sidecar' if args.sink == 'sidecar' else 'nowhere'}; {args.rounds} rounds", flush=True)


def cpu_s(pids: Iterable[int | None]) -> float:
    """CPU seconds (user + system) so far of these processes and all their children."""
    total = 0.0
    for pid in pids:
        if pid is None:  # not started (psutil would read None as this process)
            continue
        try:
            root = psutil.Process(pid)
            for p in (root, *root.children(recursive=True)):
                t = p.cpu_times()
                total += t.user + t.system
        except psutil.Error:
            pass  # a process that ended between listing and reading
    return total


def round_result(lat: dict[str, list[float]], cpu: dict[str, float], failed: dict[str, int],
                 **extra: object) -> dict:
    """One round as the functions above read it: each request with the plugin against its twin without, sent
    right before or after it with the same prompt, so that what the machine was doing then cancels."""
    pairs = [a - b for a, b in zip(lat["with"], lat["without"])]
    return {"with": lat["with"], "without": lat["without"], "pairs": pairs, "cpu": cpu, "failed": failed,
            "base": statistics.median(lat["without"]), "diff": statistics.median(pairs), **extra}
