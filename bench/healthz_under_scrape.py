"""/healthz latency while a sidecar holding 100,000 open legs is scraped in a loop, against idle, one run.

A real `pdwatch serve` (its own process) gets 100,000 open legs from 50
engine instances' heartbeat inventories (2,000 each, re-sent every 2 s so the
legs stay open), and its judge walks them all on every tick. Then /healthz is
timed, one request after another, in three phases of the same run:
  empty      a fresh sidecar with no legs at all (the baseline);
  holding    the 100,000 legs, nobody scraping;
  scraped    the same, while another client scrapes /metrics in a loop.
Goal: scraped p99 within 20 ms of the empty sidecar's p99. Loopback only; every
loop is bounded in count and time.

    python bench/healthz_under_scrape.py [--legs 100000] [--probes 400]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import httpx

from pdwatch import contract as c
from pdwatch.engine_patches.otlp_http import MemoryTransport
from pdwatch.engine_patches.recorder import Recorder, RecorderConfig
from pdwatch.testbed.sidecar_process import SidecarProcess

PER_INSTANCE = 2000
PB = {"Content-Type": "application/x-protobuf"}


def engines(legs: int) -> list[tuple[Recorder, MemoryTransport]]:
    out = []
    for i in range((legs + PER_INSTANCE - 1) // PER_INSTANCE):
        kept = MemoryTransport()
        rec = Recorder(RecorderConfig(role="decode", instance=f"bench-decode-{i}", heartbeat_s=2.0,
                                      inventory_max=PER_INSTANCE, max_export_queue=1 << 16),
                       transport=kept, environ={})
        for j in range(min(PER_INSTANCE, legs - i * PER_INSTANCE)):
            rid = f"d-{i}-{j}"
            rec.arrive(rid, bootstrap_room=i * PER_INSTANCE + j)
            rec.enter(rid, "bootstrap")
        rec.drain()
        out.append((rec, kept))
    return out


def heartbeats(made: list[tuple[Recorder, MemoryTransport]]) -> list[bytes]:
    bodies = []
    for rec, kept in made:
        rec.heartbeat()
        rec.flush()
        bodies.append(b"".join(kept.take()))
    return bodies


def probe(url: str, n: int) -> list[float]:
    out = []
    with httpx.Client(base_url=url, timeout=10) as client:
        for _ in range(n):
            t = time.perf_counter()
            client.get("/healthz").raise_for_status()
            out.append(time.perf_counter() - t)
            time.sleep(0.005)
    return out


def p(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--legs", type=int, default=100_000)
    ap.add_argument("--probes", type=int, default=400, help="/healthz requests per phase")
    args = ap.parse_args()
    env = {c.ENV_NVML: "off", c.ENV_LOG_LEVEL: "warning"}
    with SidecarProcess(env=env) as empty:
        probe(empty.url, 20)
        base = probe(empty.url, args.probes)
    made = engines(args.legs)
    stop = threading.Event()
    scrapes = []
    with SidecarProcess(env=env) as sc:
        with httpx.Client(base_url=sc.url, timeout=60) as client:
            def keep_open() -> None:  # heartbeats every 2 s, as the engines would send them
                while not stop.wait(2.0):
                    for body in heartbeats(made):
                        client.post("/v1/traces", content=body, headers=PB)

            for body in heartbeats(made):
                client.post("/v1/traces", content=body, headers=PB).raise_for_status()
            deadline = time.monotonic() + 60
            while client.get("/healthz").json()["tracked_legs"] < args.legs and time.monotonic() < deadline:
                time.sleep(0.2)
            held = client.get("/healthz").json()["tracked_legs"]
            beats = threading.Thread(target=keep_open, daemon=True)
            beats.start()
            holding = probe(sc.url, args.probes)

            def scrape() -> None:
                with httpx.Client(base_url=sc.url, timeout=60) as scraper:
                    end = time.monotonic() + 120
                    while not stop.is_set() and time.monotonic() < end:
                        t = time.perf_counter()
                        scraper.get("/metrics").raise_for_status()
                        scrapes.append(time.perf_counter() - t)

            scraper = threading.Thread(target=scrape, daemon=True)
            scraper.start()
            time.sleep(1.0)
            scraped = probe(sc.url, args.probes)
            stop.set()
            scraper.join(10)
            beats.join(10)
            tick = [line for line in client.get("/metrics").text.splitlines()
                    if line.startswith(c.JUDGE_TICK_SECONDS.series + " ")]
    for rec, _ in made:
        rec.shutdown(timeout_s=1)
    print(f"sidecar held {held} open legs; the judge's tick over them took {tick[0].split()[1][:6]} s")
    print(f"{len(scrapes)} scrapes of /metrics meanwhile, median {statistics.median(scrapes) * 1e3:.1f} ms")
    for name, xs in (("empty", base), ("holding", holding), ("scraped", scraped)):
        print(f"/healthz {name:8s} p50 {p(xs, 0.5) * 1e3:6.2f} ms   p99 {p(xs, 0.99) * 1e3:6.2f} ms   "
              f"max {max(xs) * 1e3:6.2f} ms   ({len(xs)} requests)")
    gap = (p(scraped, 0.99) - p(base, 0.99)) * 1e3
    print(f"scraped p99 - empty p99 = {gap:+.2f} ms; goal (within 20 ms): {'met' if gap <= 20 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
