"""The engine process's CPU per exported leg: pdwatch's OTLP writer against the OTel SDK's span path.

Everything off the scheduler thread still shares the engine process's GIL
(and, on a small machine, its cores), so the CPU the recorder's worker and
export threads spend per request is what the live plugin cost is made of.
Both sides send the same five spans per prefill leg (four stages, the leg),
with the same recorded times and attributes, over OTLP/HTTP to one real
`pdwatch serve` in its own process; measured is this process's CPU time
(every thread) per leg:
  pdwatch   the recorder: hot-path records, drained into protobuf spans
            written in place, posted by its export thread (http.client);
  baseline  what the recorder did before: OTel SDK spans started and ended
            with those times, a BatchSpanProcessor and the SDK's
            OTLPSpanExporter (encoder, requests).

    python bench/export_cost.py [--legs 4000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags

from pdwatch import contract as c
from pdwatch.engine_patches.legs import new_span_id, new_trace_id
from pdwatch.engine_patches.recorder import Recorder, RecorderConfig
from pdwatch.testbed.sidecar_process import SidecarProcess

STAGES = ("bootstrap", "queued", "prefill", "transfer")
T0 = 1_800_000_000_000_000_000


def config(url: str, name: str) -> RecorderConfig:
    return RecorderConfig(role="prefill", instance=name, endpoint=url, heartbeat_s=3600.0,
                          max_export_queue=1 << 16, buffer_max=1 << 20)


def pdwatch_run(rec: Recorder, legs: int, first: int) -> float:
    cpu = time.process_time_ns()
    for i in range(first, first + legs):
        rid = f"p-{i}"
        rec.arrive(rid, bootstrap_room=i, prompt_tokens=512, peer="decode-0")
        for stage in STAGES:
            rec.enter(rid, stage)
        rec.finish(rid)
        if i % 64 == 0:
            rec.drain()  # the worker's pace: a drain every few requests
    assert rec.flush(timeout_s=30)
    return (time.process_time_ns() - cpu) / legs


def sdk_run(tracer: trace.Tracer, provider: TracerProvider, legs: int, first: int) -> float:
    cpu = time.process_time_ns()
    for i in range(first, first + legs):
        trace_id, leg_id, t = new_trace_id(), new_span_id(), T0 + i * 10_000_000
        parent = trace.set_span_in_context(
            NonRecordingSpan(SpanContext(trace_id, leg_id, False, TraceFlags(TraceFlags.SAMPLED))))
        for k, stage in enumerate(STAGES):
            attrs = {c.A_ROLE: "prefill", c.A_STAGE: stage, c.A_RID: f"p-{i}", c.A_ROOM: i}
            tracer.start_span(c.stage_span_name(stage), context=parent, kind=SpanKind.INTERNAL, attributes=attrs,
                              start_time=t + k * 1000).end(end_time=t + (k + 1) * 1000)
        attrs = {c.A_ROLE: "prefill", c.A_RID: f"p-{i}", c.A_OUTCOME: "ok", c.A_OUTPUT_TOKENS: 0,
                 c.A_PROMPT_TOKENS: 512, c.A_ROOM: i, c.A_PEER: "decode-0"}
        tracer.start_span(c.SPAN_LEG, context=trace.set_span_in_context(trace.INVALID_SPAN), kind=SpanKind.SERVER,
                          attributes=attrs, start_time=t).end(end_time=t + 5000)
    assert provider.force_flush(30_000)
    return (time.process_time_ns() - cpu) / legs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--legs", type=int, default=4000, help="prefill legs per run (five spans each)")
    ap.add_argument("--repeat", type=int, default=5, help="runs per side, alternating; the median is reported")
    args = ap.parse_args()
    logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)
    with SidecarProcess(env={c.ENV_NVML: "off", c.ENV_LOG_LEVEL: "warning"}) as sidecar:
        rec = Recorder(config(sidecar.url, "bench-pdwatch"), environ={})
        # The baseline's resource: the recorder's own attributes, so both send the same bytes' worth.
        res = {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in rec.export.resource.attributes
               if kv.value.WhichOneof("value") != "array_value"}
        res[c.R_INSTANCE] = "bench-sdk"
        provider = TracerProvider(resource=Resource(res))
        provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=f"{sidecar.url}/v1/traces", timeout=10), max_queue_size=1 << 16,
            schedule_delay_millis=200, max_export_batch_size=512))
        tracer = provider.get_tracer("bench")
        ours, theirs = [], []
        for r in range(args.repeat):
            ours.append(pdwatch_run(rec, args.legs, r * args.legs))
            theirs.append(sdk_run(tracer, provider, args.legs, r * args.legs))
        stats = rec.stats()
        rec.shutdown(timeout_s=5)
        provider.shutdown()
        received = sidecar.get("/api/v1/summary")
    ours_us, theirs_us = statistics.median(ours) / 1e3, statistics.median(theirs) / 1e3
    print(f"legs per run: {args.legs} (5 spans each), {args.repeat} runs per side, alternating")
    print(f"pdwatch recorder (OTLP written in place, http.client): {ours_us:7.1f} us CPU per leg")
    print(f"OTel SDK spans + BatchSpanProcessor + OTLPSpanExporter: {theirs_us:7.1f} us CPU per leg")
    print(f"ratio: the recorder costs {ours_us / theirs_us:.2f}x the SDK path ({theirs_us / ours_us:.1f}x cheaper)")
    print(f"recorder: {stats['spans_sent']} spans sent, {stats['export_failed_spans']} failed, "
          f"{stats['spans_dropped']} dropped; the sidecar knows {len(received['instances'])} instances")


if __name__ == "__main__":
    main()
