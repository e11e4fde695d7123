"""Added cost per hooked SGLang call on the scheduler thread, plugin off vs on, in one run.

Loads pdwatch through SGLang's own `load_plugins()` (sglang 0.5.23, CPU), then
times real SGLang methods through the patched attribute (SGLang's HookRegistry
wrapper + the pdwatch hook + the recorder's append) and through the original
the wrapper holds (`__wrapped__`), alternating, on the same objects:

  DecodePreallocQueue._send_kv_metadata  one transition (decode: enter transfer + transfer detail)
  Scheduler.get_new_batch_prefill  one transition (queued -> prefill), a one-request batch
  PrefillBootstrapQueue.pop_bootstrapped, empty queue: the per-loop cost with no transition
  Scheduler.ingest_requests hook   the loop counter, through HookRegistry's BEFORE wrapper
                                   around a no-op (the real method needs live sockets)
  stream_output hook, per request  one decode step of one request (token count), hook only

The recorder runs its worker thread and exports to a loopback port where nothing
listens (sidecar down, the worst case). Thread CPU time: what the scheduler
thread pays. Goal: <= 2000 ns added per transition.

    python bench/sglang_hook_cost.py [--n 50000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
import types
from array import array
from types import SimpleNamespace

from pdwatch import contract as c
from pdwatch.testbed.processes import free_port


def per_call_ns(fn, n: int, repeat: int, reset=None) -> float:
    runs = []
    for _ in range(repeat):
        if reset is not None:
            reset()
        t = time.thread_time_ns()
        for _ in range(n):
            fn()
        runs.append((time.thread_time_ns() - t) / n)
    return statistics.median(runs)


def load_sglang_with_plugin():
    # CPU torch 2.13 with PyPI torchvision 0.28 (this bench's environment, see
    # docs/sglang.md): torchvision's op registrations fail and are not needed.
    for name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
        sys.modules.setdefault(name, types.ModuleType(name))
    os.environ[c.ENV_SGLANG] = "1"
    os.environ["SGLANG_PLUGINS"] = "pdwatch"
    import sglang.srt.disaggregation.decode
    import sglang.srt.disaggregation.prefill
    import sglang.srt.managers.scheduler  # noqa: F401
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import pdwatch.engine_patches.sglang as plugin

    if plugin.status != "registered":
        raise SystemExit(f"pdwatch plugin not registered: {plugin.status} {plugin.problems}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=50_000, help="calls per run")
    ap.add_argument("--repeat", type=int, default=5, help="runs; the median is reported")
    args = ap.parse_args()
    logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)
    logging.getLogger("sglang").setLevel(logging.WARNING)
    load_sglang_with_plugin()

    from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeRequest
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.disaggregation.utils import DisaggregationMode, ReqToMetadataIdxAllocator, TransferBackend
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn
    from sglang.srt.sampling.sampling_params import SamplingParams

    from pdwatch.engine_patches.recorder import Recorder, RecorderConfig
    from pdwatch.engine_patches.sglang import hooks
    from pdwatch.engine_patches.sglang.state import state

    sched = object.__new__(Scheduler)
    sched.disaggregation_mode = DisaggregationMode.DECODE
    sched.transfer_backend = TransferBackend.NIXL
    sched.gpu_id = 0
    endpoint = f"http://127.0.0.1:{free_port()}"
    state.start_for_scheduler(sched, recorder_factory=lambda role, **kw: Recorder(
        RecorderConfig(role=role, instance="bench", endpoint=endpoint, export_timeout_s=0.2,
                       buffer_max=1 << 22, **kw), environ={}).start())
    rec = state.rec

    def req(rid):
        return Req(rid, "", array("q", range(512)), SamplingParams(max_new_tokens=16),
                   bootstrap_host="10.0.0.2", bootstrap_port=8998, bootstrap_room=hash(rid) & 0xFFFFFFFF)

    results = []

    # 1. DecodePreallocQueue._send_kv_metadata: one transition. The KV page list and the
    # receiver are stand-ins (the real ones need a KV pool and a prefill to talk to).
    pq = object.__new__(DecodePreallocQueue)
    pq.transfer_queue = SimpleNamespace(enable_staging=False)
    pq._num_published_destinations = 0
    pq._transfer_page_indices = lambda decode_req, kv_indices, page_size: kv_indices
    dreq = DecodeRequest(req=req("d-0"), kv_receiver=SimpleNamespace(send_metadata=lambda *a, **k: None))

    def fresh_allocator():
        pq.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(args.n)

    patched = DecodePreallocQueue._send_kv_metadata
    orig = patched.__wrapped__
    pages = list(range(4))
    results.append(("DecodePreallocQueue._send_kv_metadata",
                    per_call_ns(lambda: orig(pq, dreq, pages, 1), args.n, args.repeat, fresh_allocator),
                    per_call_ns(lambda: patched(pq, dreq, pages, 1), args.n, args.repeat, fresh_allocator), True))

    # 2. Scheduler.get_new_batch_prefill: one transition for a one-request batch.
    state.role = "prefill"
    batch = SimpleNamespace(reqs=[req("p-0")])
    s2 = object.__new__(Scheduler)
    s2.prefill_delayer = None
    s2._get_new_batch_prefill_raw = lambda prefill_delayer_single_pass, running_batch: (batch, running_batch)
    patched = Scheduler.get_new_batch_prefill
    orig = patched.__wrapped__
    results.append(("Scheduler.get_new_batch_prefill", per_call_ns(lambda: orig(s2, None), args.n, args.repeat),
                    per_call_ns(lambda: patched(s2, None), args.n, args.repeat), True))

    # 3. pop_bootstrapped with nothing bootstrapping: the per-loop overhead.
    bq = object.__new__(PrefillBootstrapQueue)
    bq.queue = []
    bq.scheduler_stage_metrics = None
    patched = PrefillBootstrapQueue.pop_bootstrapped
    orig = patched.__wrapped__
    results.append(("PrefillBootstrapQueue.pop_bootstrapped (empty)",
                    per_call_ns(lambda: orig(bq), args.n, args.repeat),
                    per_call_ns(lambda: patched(bq), args.n, args.repeat), False))

    # 4. Loop counter: HookRegistry's BEFORE wrapper + hook around a no-op.
    def noop(self):
        return None

    wrapped = _wrap_fn(noop, hooks.on_loop_iteration, HookType.BEFORE)
    results.append(("ingest_requests loop tick (wrapper + hook)", per_call_ns(lambda: noop(sched), args.n, args.repeat),
                    per_call_ns(lambda: wrapped(sched), args.n, args.repeat), False))

    # 5. stream_output hook: one decode step for a 64-request batch, per request.
    state.role = "decode"
    reqs = [req(f"d-{i}") for i in range(64)]

    def step_base():
        for r in reqs:
            r.output_ids.append(1)

    def step_hooked():
        for r in reqs:
            r.output_ids.append(1)
        hooks.on_stream_output(None, None, reqs, False)

    steps = max(1, args.n // 64)
    base = per_call_ns(step_base, steps, args.repeat) / 64
    hooked = per_call_ns(step_hooked, steps, args.repeat) / 64
    results.append(("stream_output hook, per request per step", base, hooked, True))

    stats = rec.stats()
    rec.shutdown(timeout_s=1)
    print(f"{'per call, scheduler thread CPU, ns':48s} {'plugin off':>10s} {'plugin on':>10s} {'added':>8s}")
    worst = 0.0
    for name, off, on, transition in results:
        added = on - off
        if transition:
            worst = max(worst, added)
        print(f"{name:48s} {off:10.0f} {on:10.0f} {added:8.0f}{'  (transition)' if transition else ''}")
    print(f"records dropped: {stats['dropped']}, hook errors: {stats['hook_errors']}")
    print(f"goal (<= 2000 ns added per transition): {'met' if worst <= 2000 else 'NOT met'} (worst {worst:.0f} ns)")


if __name__ == "__main__":
    main()
