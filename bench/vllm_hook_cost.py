"""Added cost per hooked vLLM call on the EngineCore's scheduler thread, adapter off vs on, in one run.

Runs in vLLM's own environment (build/vllm, docs/vllm.md):

    build/vllm/bin/python bench/vllm_hook_cost.py [--n 20000] [--repeat 9]

Builds vLLM's own Scheduler with the adapter's NixlConnector (SCHEDULER role,
PDWATCH_VLLM=1), then times each overridden connector method through the
adapter's class (vLLM's method + the hook + the recorder's append) and through
vLLM's own method on the same connector object, alternating, on the same
request objects:

  on_new_request               one transition (arrival: queued, one record)
  build_connector_meta         one transition per step (queued -> prefill), a one-request step
  build_connector_meta         a step with nothing new (the loop counter only)
  request_finished_all_groups  one transition (prefill -> transfer)
  update_connector_output      one transition (transfer -> ended ok), its blocks read

The recorder runs its worker thread and exports to a loopback port where nothing
listens (sidecar down, the worst case). Thread CPU time: what the scheduler thread
pays. Goal: <= 2000 ns added per transition.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support, as the adapter's tests use it

from pdwatch import contract as c
from pdwatch.testbed.processes import free_port
from tests.support.vllm_scheduler import build_scheduler


def per_call_ns(fn: Callable[[], object], n: int) -> float:
    t = time.thread_time_ns()
    for _ in range(n):
        fn()
    return (time.thread_time_ns() - t) / n


def paired(off: Callable[[], object], on: Callable[[], object], n: int, repeat: int) -> tuple[float, float, float]:
    """Runs of vLLM's method and the adapter's back to back, `repeat` times: the medians of each, and the
    median of the per-run differences (drift on a shared machine hits both runs of a pair alike)."""
    offs, ons = [], []
    for _ in range(repeat):
        offs.append(per_call_ns(off, n))
        ons.append(per_call_ns(on, n))
    return statistics.median(offs), statistics.median(ons), statistics.median(b - a for a, b in zip(offs, ons))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20_000, help="calls per run")
    ap.add_argument("--repeat", type=int, default=9, help="paired runs; medians are reported")
    args = ap.parse_args()
    if importlib.util.find_spec("vllm") is None:  # `make bench` runs every bench in the project's venv
        from pdwatch.testbed.vllm_pd.servers import vllm_python

        os.execv(vllm_python(), [vllm_python(), __file__, *sys.argv[1:]])
    for name in ("opentelemetry", "vllm", "pdwatch"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.update({c.ENV_VLLM: "1", c.ENV_INSTANCE: "bench", c.ENV_HEARTBEAT: "1",
                       c.ENV_OTLP_ENDPOINT: f"http://127.0.0.1:{free_port()}",  # nothing listens
                       "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())})

    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector as VllmConnector
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from pdwatch.engine_patches.vllm.connector import NixlConnector
    from pdwatch.engine_patches.vllm.state import state

    with tempfile.TemporaryDirectory() as folder:
        sched = build_scheduler(Path(folder), "kv_producer")
        conn = sched.connector
        assert isinstance(conn, NixlConnector), type(conn)
        rec = state.rec
        assert rec is not None, "the adapter made no recorder"

        sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {
            "do_remote_decode": True, "do_remote_prefill": False}})
        req = Request(request_id="p-0", prompt_token_ids=list(range(3, 43)), sampling_params=sampling,
                      pooling_params=None)
        # One real step, for a real SchedulerOutput with one new request in it, and one with nothing new.
        sched.add_request(req)
        step_new = sched.schedule()
        step_empty = sched.schedule()
        stages = state.stages
        n, repeat = args.n, args.repeat
        results: list[tuple[str, float, float, float, bool]] = []

        def pair(name: str, method: str, call_args: tuple, reset: Callable[[], None] | None,
                 transition: bool) -> None:
            mine, theirs = getattr(NixlConnector, method), getattr(VllmConnector, method)

            def on() -> None:
                if reset is not None:
                    reset()
                mine(conn, *call_args)

            def off() -> None:
                if reset is not None:
                    reset()
                theirs(conn, *call_args)

            results.append((name, *paired(off, on, n, repeat), transition))

        pair("on_new_request", "on_new_request", (req,), None, True)
        pair("build_connector_meta, one new request", "build_connector_meta", (step_new,),
             lambda: stages.__setitem__("p-0", "queued"), True)
        pair("build_connector_meta, nothing new", "build_connector_meta", (step_empty,), None, False)
        pair("request_finished_all_groups", "request_finished_all_groups", (req, ([1, 2, 3],)),
             lambda: stages.__setitem__("p-0", "prefill"), True)
        done = KVConnectorOutput(finished_sending={"p-0"})
        pair("update_connector_output, blocks read", "update_connector_output", (done,),
             lambda: stages.__setitem__("p-0", "transfer"), True)

        stats = rec.stats()
        rec.shutdown(timeout_s=1)
        sched.shutdown()
    print(f"{'per call, scheduler thread CPU, ns':44s} {'vLLM':>8s} {'adapter':>8s} {'added':>8s}")
    worst = 0.0
    for name, off, on, added, transition in results:
        if transition:
            worst = max(worst, added)
        print(f"{name:44s} {off:8.0f} {on:8.0f} {added:8.0f}{'  (transition)' if transition else ''}")
    print(f"records dropped: {stats['dropped']} (the recorder's bounded queue under a tight loop), "
          f"hook errors: {stats['hook_errors']}")
    print(f"goal (<= 2000 ns added per transition): {'met' if worst <= 2000 else 'NOT met'} (worst {worst:.0f} ns)")


if __name__ == "__main__":
    main()
