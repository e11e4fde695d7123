"""The live page with 10,000 stuck legs against 100, in one run: time to a full render in Chromium.

A real sidecar (the app with its /ui router, uvicorn on a loopback port) is fed
N prefill legs hung in `transfer` (tests/ui/support.py's feed_stuck_legs, real
recorders and the real OTLP encoder), then headless Debian Chromium loads /ui
`--loads` times; each load is timed from navigation to the page's own marker of
a finished render (stuck table, instance cards, charts, diagnosis). The same is
then done with the small count. Printed: median and p90 per count, the ratio of
the medians, and how long the /ui/api/stuck route and /api/v1/summary took.
Goal: the large page within 2x of the small one (the table shows the oldest 200
rows and counts the rest, so the browser's work must not grow with the legs).

    python bench/ui_render.py [--small 100] [--large 10000] [--loads 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.ui.support, as the tests use it

import httpx

from tests.support.sidecar import FakeClock
from tests.ui.support import chrome, feed_stuck_legs, start_sidecar, wait_rendered

GOAL_RATIO = 2.0


def measure(driver, legs: int, loads: int) -> dict:
    clock = FakeClock(time.time_ns())
    sc = start_sidecar(clock)
    try:
        feed_stuck_legs(sc, clock, legs)
        stuck = httpx.get(f"{sc.url}/ui/api/stuck", timeout=60).json()
        assert stuck["total"] == legs, (stuck["total"], legs)
        api = []
        for _ in range(loads):
            t0 = time.perf_counter()
            httpx.get(f"{sc.url}/ui/api/stuck", timeout=60).raise_for_status()
            httpx.get(f"{sc.url}/api/v1/summary", timeout=60).raise_for_status()
            api.append(time.perf_counter() - t0)
        times = []
        for _ in range(loads):
            driver.get("about:blank")
            t0 = time.perf_counter()
            driver.get(f"{sc.url}/ui")
            wait_rendered(driver, timeout_s=60)
            times.append(time.perf_counter() - t0)
        rows = driver.execute_script("return document.querySelectorAll('tr.leg').length")
    finally:
        sc.__exit__(None, None, None)
    times.sort()
    return {"legs": legs, "rows": rows, "median_s": statistics.median(times),
            "p90_s": times[min(len(times) - 1, int(0.9 * len(times)))], "api_median_s": statistics.median(api)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", type=int, default=100)
    ap.add_argument("--large", type=int, default=10_000)
    ap.add_argument("--loads", type=int, default=7)
    args = ap.parse_args()
    driver = chrome()
    try:
        measure(driver, args.small, 2)  # warm the browser and the imports; not counted
        small = measure(driver, args.small, args.loads)
        large = measure(driver, args.large, args.loads)
    finally:
        driver.quit()
    for r in (small, large):
        print(f"{r['legs']:>6} stuck legs: {r['rows']} rows drawn; page render median {r['median_s'] * 1000:.0f} ms, "
              f"p90 {r['p90_s'] * 1000:.0f} ms; /ui/api/stuck + /api/v1/summary {r['api_median_s'] * 1000:.1f} ms")
    ratio = large["median_s"] / small["median_s"]
    api_ratio = large["api_median_s"] / small["api_median_s"]
    verdict = "met" if ratio <= GOAL_RATIO else "NOT met"
    print(f"render ratio {args.large} / {args.small} legs: {ratio:.2f}x (goal <= {GOAL_RATIO:.0f}x: {verdict}); "
          f"data routes {api_ratio:.2f}x")
    return 0 if ratio <= GOAL_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
