"""The engine process's CPU per heartbeat as the open-leg inventory grows: typed list writing against item by item.

A heartbeat lists up to PDWATCH_INVENTORY_MAX (2048) open legs in twelve
lists; the recorder's worker builds it every PDWATCH_HEARTBEAT_S (2 s) on
the engine process's GIL. Measured on this thread's CPU, for inventories of
several sizes, the heartbeat's attributes built and written into an OTLP
span and serialized:
  pdwatch   contract/otlp.py: a list of one scalar type written with one
            setter an item;
  baseline  the same attributes written item by item through set_value's
            type dispatch (what contract/otlp.py did before), same run.
Also printed: what one heartbeat costs as a share of the engine's time at
the default interval.

    python bench/heartbeat_cost.py [--legs 10,256,2048] [--repeat 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry.proto.trace.v1.trace_pb2 import Span

from pdwatch import contract as c
from pdwatch.contract.otlp import add_attributes, set_value
from pdwatch.engine_patches.recorder import Recorder, RecorderConfig
from pdwatch.testbed.processes import free_port


def item_by_item(span: Span, attrs: Mapping[str, Any]) -> None:
    """The baseline: every list item through set_value's dispatch."""
    for key, v in attrs.items():
        kv = span.attributes.add()
        kv.key = key
        if isinstance(v, list):
            array = kv.value.array_value
            array.SetInParent()
            for item in v:
                set_value(array.values.add(), item)
        else:
            set_value(kv.value, v)


def recorder_with(legs: int) -> Recorder:
    rec = Recorder(RecorderConfig(role="decode", cluster="bench", instance="d0",
                                  endpoint=f"http://127.0.0.1:{free_port()}", heartbeat_s=c.DEFAULT_HEARTBEAT_S))
    for i in range(legs):
        rid = f"req-{i:08d}"
        rec.arrive(rid, bootstrap_room=1000 + i, prompt_tokens=64, peer="prefill-0")
        rec.enter(rid, "transfer")
        if i % 2:
            rec.enter(rid, "queued")
            rec.enter(rid, "decode")
            rec.token(rid, 3)
    rec.drain()
    return rec


def per_beat_us(rec: Recorder, write: Callable[[Span, Mapping[str, Any]], None], n: int) -> float:
    t = time.thread_time_ns()
    for _ in range(n):
        span = Span()
        write(span, rec.heartbeat_attributes())
        span.SerializeToString()
    return (time.thread_time_ns() - t) / n / 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--legs", default="10,256,2048", help="open-leg counts, comma-separated (default 10,256,2048)")
    ap.add_argument("--repeat", type=int, default=7, help="runs per side and size, alternating (default 7)")
    args = ap.parse_args()
    try:
        sizes = [int(x) for x in args.legs.split(",")]
    except ValueError:
        ap.error(f"--legs must be comma-separated integers, got {args.legs!r}")
    if not sizes or min(sizes) < 0 or max(sizes) > 100_000 or args.repeat < 1:
        ap.error("--legs between 0 and 100000 each, --repeat at least 1")
    interval_s = c.DEFAULT_HEARTBEAT_S
    print(f"heartbeat attributes built, written into a span and serialized; thread CPU, median of {args.repeat} runs")
    for legs in sizes:
        rec = recorder_with(legs)
        listed = len(rec.heartbeat_attributes()[c.H_OPEN_RIDS])
        n = max(3, min(2000, 20_000 // max(1, legs)))
        ours, theirs = [], []
        for _ in range(args.repeat):
            ours.append(per_beat_us(rec, add_attributes, n))
            theirs.append(per_beat_us(rec, item_by_item, n))
        a, b = statistics.median(ours), statistics.median(theirs)
        print(f"{legs:6d} open legs ({listed} listed): typed {a:9.1f} us, item by item {b:9.1f} us "
              f"({b / a:.2f}x); one beat every {interval_s:g} s is {a / (interval_s * 1e6) * 100:.3f} % "
              f"of the engine's time (was {b / (interval_s * 1e6) * 100:.3f} %)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
