"""What GPU sampling costs, on 8 emulated GPUs through nvidia-ml-py and the NVML stub.

Figures, each against a baseline measured in the same run:
- one sampling pass, against one bare NVML call through pynvml (the floor of any pass);
- one scrape of the GPU collector;
- a CPU-bound loop on the main thread (ingest's stand-in) with the sampler
  thread running at 10 passes/s, against the same loop alone.

The stub answers from a file, so a pass here is the binding's and the
sampler's own cost; a real driver adds its call latency on the sampler
thread only.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from pdwatch import contract as c
from pdwatch.sidecar.gpu.collector import GpuCollector
from pdwatch.sidecar.gpu.join import parse_gpu_map
from pdwatch.sidecar.gpu.sampler import GpuSampler
from pdwatch.sidecar.judge import Judge
from pdwatch.sidecar.tracker import Tracker
from pdwatch.testbed.gpu_emulation import STATE_ENV, STUB_LIBRARY, GpuEmulator

REPO = Path(__file__).resolve().parent.parent

DEVICES = 8


def per_call(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def loop_rate(seconds: float) -> float:
    # A stand-in for ingest: parse-and-build work that holds the GIL.
    doc = json.dumps({"spans": [{"name": c.stage_span_name("transfer"), "attrs": list(range(20))}] * 20})
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        json.loads(doc)
        n += 1
    return n / seconds


def main() -> None:
    subprocess.run(["make", "-s", "nvml-stub"], cwd=REPO, check=True)
    with tempfile.TemporaryDirectory() as tmp:
        emu = GpuEmulator(Path(tmp) / "state", [{"index": i, "uuid": f"GPU-bench-{i}"} for i in range(DEVICES)])
        os.environ[STATE_ENV] = str(emu.path)
        for i in range(DEVICES):
            emu.busy(i, i / DEVICES)
            emu.set(i, pids=[10_000 + i])

        sampler = GpuSampler(library=str(STUB_LIBRARY))
        sampler.sample_once()
        snap = sampler.snapshot()
        assert snap.up and len(snap.devices) == DEVICES, snap.reason

        import pynvml

        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        bare = per_call(lambda: pynvml.nvmlDeviceGetPowerUsage(handle), 2000)
        one_pass = per_call(sampler.sample_once, 200)
        print(f"bare NVML call (pynvml + stub): {bare * 1e6:8.1f} us")
        print(f"sampling pass, {DEVICES} GPUs:       {one_pass * 1e3:8.2f} ms  ({one_pass / bare:.0f} bare calls; "
              f"{one_pass / DEVICES * 1e6:.0f} us per GPU)")

        # The judge joins the pass to owners once per tick; a scrape only formats that.
        owners = parse_gpu_map(",".join(f"{i}=decode/decode-{i}" for i in range(DEVICES)))
        judge = Judge(Tracker(), gpu=sampler, gpu_map=owners)
        join = per_call(judge.tick, 500)
        registry = CollectorRegistry()
        registry.register(GpuCollector(lambda: judge.latest))
        scrape = per_call(lambda: generate_latest(registry), 500)
        print(f"judge tick with the GPU join, {DEVICES} GPUs: {join * 1e3:8.2f} ms")
        print(f"collector scrape, {DEVICES} GPUs:    {scrape * 1e3:8.2f} ms")

        alone = loop_rate(1.5)
        sampler = GpuSampler(interval_s=0.1, library=str(STUB_LIBRARY)).start()
        with_sampler = loop_rate(1.5)
        sampler.stop()
        again = loop_rate(1.5)
        base = (alone + again) / 2
        print(f"main-thread loop alone:        {base:10.0f} /s")
        print(f"  with sampler at 10 passes/s: {with_sampler:10.0f} /s  ({(with_sampler / base - 1) * 100:+.1f} % change; "
              f"the two alone runs differ by {abs(alone - again) / base * 100:.1f} %)")


if __name__ == "__main__":
    main()
