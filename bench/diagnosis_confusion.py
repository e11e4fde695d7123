"""Confusion matrix of the failure family each testbed scenario should get against the one diagnosed.

Every registered scenario runs `--runs` times (different seeds) against one
real `pdwatch serve` reading emulated GPUs through the NVML stub
(`pdwatch.testbed.diagnosis_run`). A run's diagnosed family is the leading family of
`/api/v1/diagnosis` at the end of its watch; for the no-fault scenarios
(healthy, long-decode, burst) any family named at any poll counts against
them. Also printed: per scenario, the detection latency from the fault to the
first verdict naming the expected family. Goal: everything on the diagonal,
and no family ever on the healthy ones.

    python bench/diagnosis_confusion.py [--runs 2] [--scenarios a,b,...]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

from pdwatch.testbed import scenarios
from pdwatch.testbed.diagnosis_run import run_scenario, sidecar_env
from pdwatch.testbed.gpu_emulation import GpuEmulator
from pdwatch.testbed.sidecar_process import SidecarProcess

NONE = "-"


def diagnosed(run) -> str:
    if run.expected is None:
        # Healthy shapes: the worst thing said at any poll.
        named = [f for f in run.families if f is not None]
        return named[0] if named else NONE
    return run.final_family or NONE


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths)))
                     for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2, help="runs per scenario (default 2)")
    ap.add_argument("--scenarios", default="",
                    help="comma-separated subset (default: all registered but the ordinary day's, which "
                         "bench/ordinary_day.py runs)")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    names = [n for n in args.scenarios.split(",") if n] or [n for n in scenarios.SCENARIOS
                                                             if n not in scenarios.ordinary()]
    for n in names:
        scenarios.get(n)  # unknown names fail before anything starts
    logging.basicConfig(level=logging.WARNING)

    gpus = GpuEmulator.for_demo(count=8)
    results: dict[str, list] = {n: [] for n in names}
    t_start = time.monotonic()
    with SidecarProcess(env=sidecar_env(gpus)) as sc:
        for rep in range(args.runs):
            for name in names:
                run = run_scenario(name, sc, gpus, cluster=f"{name}-{rep}", seed=rep + 1)
                results[name].append(run)
                lat = run.latency_s
                print(f"run {rep + 1}/{args.runs} {name:<15} expected {run.expected or NONE:<18} "
                      f"diagnosed {diagnosed(run):<18} latency {'-' if lat is None else f'{lat:.1f} s'}",
                      flush=True)

    expected_cols = sorted({s.family for s in scenarios.SCENARIOS.values() if s.family})
    seen = sorted({diagnosed(r) for runs in results.values() for r in runs} - {NONE} - set(expected_cols))
    cols = expected_cols + seen + [NONE]
    print()
    print(f"Confusion matrix ({args.runs} run(s) per scenario; rows: scenario (expected family), "
          f"columns: diagnosed family, '{NONE}' = none)")
    rows = [["scenario (expected)", *cols]]
    for name in names:
        exp = scenarios.get(name).family or NONE
        counts = [sum(1 for r in results[name] if diagnosed(r) == col) for col in cols]
        rows.append([f"{name} ({exp})", *[str(n) if n else "." for n in counts]])
    print(table(rows))

    print()
    print("Detection latency, fault -> first verdict naming the expected family (seconds):")
    lat_rows = [["scenario", "runs", "detected", "min", "median", "max"]]
    for name in names:
        runs = results[name]
        if scenarios.get(name).family is None:
            continue
        lats = [r.latency_s for r in runs if r.latency_s is not None]
        fmt = lambda x: f"{x:.1f}"  # noqa: E731
        lat_rows.append([name, str(len(runs)), str(len(lats)), *(map(fmt, (min(lats), statistics.median(lats),
                                                                            max(lats))) if lats else ["-"] * 3)])
    print(table(lat_rows))

    total = sum(len(v) for v in results.values())
    right = sum(1 for name, runs in results.items() for r in runs
                if diagnosed(r) == (scenarios.get(name).family or NONE))
    healthy_named = sum(1 for name, runs in results.items() if scenarios.get(name).family is None
                        for r in runs if diagnosed(r) != NONE)
    ok = right == total and healthy_named == 0
    print()
    print(f"{right}/{total} runs on the diagonal; {healthy_named} family named on a no-fault run; "
          f"{time.monotonic() - t_start:.0f} s in all")
    print(f"goal (every run on the diagonal, no family on the no-fault scenarios): {'MET' if ok else 'NOT MET'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
