"""Sidecar memory per tracked open leg, up to 100,000 open legs.

Legs are opened the way an engine opens them: a real Recorder walks each
request into `queued` (its finished `pd.bootstrap` span) and, every 2,048 legs,
sends a heartbeat listing the open ones; the spans go through the real OTLP
encoder. All bodies are built first; then, under tracemalloc, a fresh Tracker
parses and ingests them. Memory per leg = (traced memory after - before) /
open legs, with the parsed messages freed. It counts everything a leg costs
the tracker: the leg, its keys, its stage history, the span id remembered for
de-duplication. Goal: <= 1 KiB per open leg at every size.

    python bench/memory_per_leg.py [--sizes 1000,10000,100000]
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import time
import tracemalloc

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from pdwatch.engine_patches.otlp_http import MemoryTransport
from pdwatch.engine_patches.recorder import Recorder, RecorderConfig
from pdwatch.sidecar.settings import Settings
from pdwatch.sidecar.spans import decode
from pdwatch.sidecar.tracker import Limits, Tracker

CHUNK = 2048  # legs per OTLP body; the inventory limit, so each heartbeat lists its chunk's legs


def build_bodies(n_legs: int) -> list[bytes]:
    kept = MemoryTransport()
    # The recorder's own cap on open legs (65,536 by default) must not evict before the sidecar sees them.
    rec = Recorder(RecorderConfig(role="prefill", instance="bench-prefill-0", heartbeat_s=3600.0,
                                  max_export_queue=1 << 20, buffer_max=1 << 22, max_open_legs=n_legs + CHUNK),
                   transport=kept, environ={})
    bodies = []
    try:
        for start in range(0, n_legs, CHUNK):
            for i in range(start, min(n_legs, start + CHUNK)):
                rid = f"p-{i}"
                rec.arrive(rid, bootstrap_room=i, prompt_tokens=512, peer="decode-0")
                rec.enter(rid, "bootstrap")
                rec.enter(rid, "queued")
            rec.drain()
            rec.heartbeat()
            rec.flush()
            bodies.append(b"".join(kept.take()))
    finally:
        rec.shutdown(1)
    return bodies


def empty_body() -> bytes:
    """One heartbeat of a process with nothing open: what any tracker holds before its first leg."""
    kept = MemoryTransport()
    rec = Recorder(RecorderConfig(role="prefill", instance="bench-prefill-0", heartbeat_s=3600.0),
                   transport=kept, environ={})
    try:
        rec.heartbeat()
        rec.flush()
        return b"".join(kept.take())
    finally:
        rec.shutdown(1)


def measure(bodies: list[bytes], max_open: int) -> tuple[int, int, int]:
    """(bytes held by the tracker after ingesting every body, open legs, bytes of its duration window).

    The window of recent stage durations behind the adaptive thresholds is
    bounded (1,000 samples per stage) whatever the number of legs: it is
    measured apart, by emptying it, so the per-leg figure can be read without it.
    """
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    tracker = Tracker(Limits.of(Settings(max_open_legs=max_open)), clock=time.time_ns)
    for body in bodies:
        tracker.apply(decode(ExportTraceServiceRequest.FromString(body)))
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    n_open = len(tracker.open)
    for window in tracker.samples._samples.values():
        window.clear()
    gc.collect()
    window_bytes = held - (tracemalloc.get_traced_memory()[0] - before)
    del tracker
    gc.collect()
    return held, n_open, window_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,10000,100000", help="open leg counts to measure")
    args = ap.parse_args()
    logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)
    sizes = [int(s) for s in args.sizes.split(",")]
    tracemalloc.start()
    base, _, _ = measure([empty_body()], max_open=1)
    tracemalloc.stop()
    print(f"baseline: a tracker that knows one engine and no leg holds {base} bytes (tracemalloc, "
          f"Python {sys.version.split()[0]})")
    print(f"{'open legs':>10} {'tracker bytes':>14} {'bytes/leg':>10} {'above baseline':>15} "
          f"{'without window':>15}")
    worst = 0.0
    for n in sizes:
        t = time.perf_counter()
        bodies = build_bodies(n)
        built = time.perf_counter() - t
        tracemalloc.start()
        held, n_open, window = measure(bodies, max_open=max(n, 1) * 2)
        tracemalloc.stop()
        assert n_open == n, f"expected {n} open legs, tracker holds {n_open}"
        per, marginal = held / n_open, (held - base) / n_open
        worst = max(worst, marginal)
        print(f"{n_open:>10} {held:>14} {per:>10.0f} {marginal:>15.0f} {(held - base - window) / n_open:>15.0f}   "
              f"(bodies built in {built:.1f} s, {sum(map(len, bodies)) / n:.0f} B/leg on the wire)")
    print("'without window': less the bounded window of recent stage durations (1,000 samples per stage)")
    print(f"goal (<= 1024 bytes per open leg above the baseline, window included): "
          f"{'met' if worst <= 1024 else 'NOT met'} (worst {worst:.0f} B)")


if __name__ == "__main__":
    main()
