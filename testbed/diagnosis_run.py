"""Run one scenario under a real sidecar and record what its diagnosis said, and when.

Shared by `tests/integration/test_scenarios.py` and `bench/diagnosis_confusion.py`:

    gpus = GpuEmulator.for_demo()
    with SidecarProcess(env=sidecar_env(gpus)) as sc:
        run = run_scenario("tp-desync", sc, gpus)
    run.final_family, run.latency_s, run.timeline

The sidecar reads the emulated GPUs through the NVML stub; the stack's engines
drive them from their real work (`pdwatch.testbed.gpu_feed`). Settings are short
(floors of seconds, 0.5 s heartbeats) so one scenario takes ~15-25 s.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdwatch import contract as c

from . import scenarios
from .gpu_emulation import GpuEmulator
from .router import Truth
from .stack import Stack
from .stack_base import Event

# One cluster's verdict, as /api/v1/diagnosis gives it (JSON).
Verdict = dict[str, Any]


class Sidecar(Protocol):
    """What a run needs of a started sidecar (a `SidecarProcess` has it)."""

    url: str

    def get(self, path: str) -> Any: ...  # the JSON answer

HEARTBEAT_S = 0.5
FAULT_AT_S = 3.0
# decode-restart: late enough that decode-0's new process starts more than the
# classifier's restart skew (5 s) after the prefill's, so the restart reads as "alone".
FAULT_AT = {"decode-restart": 7.0}
# Short floors: a leg is stuck after seconds. queued stays above what `burst` queues for.
FLOORS_S = {"bootstrap": 3.0, "transfer": 3.0, "queued": 10.0, "prefill": 10.0, "decode": 30.0}
LONG_DECODE_FLOOR_S = 2.0  # long-decode's generations run 4x this while producing tokens
FLOW_WINDOW_S = 10.0
# How long to watch after the fault: total-wedge needs the flow window to pass without a finish.
WATCH_S = {"total-wedge": FLOW_WINDOW_S + 8.0}
DEFAULT_WATCH_S = 12.0


def sidecar_env(gpus: GpuEmulator | None, **extra: str) -> dict[str, str]:
    env = {
        c.ENV_EVALUATE_INTERVAL: "0.25",
        c.ENV_GPU_INTERVAL: "0.5",
        c.ENV_FLOW_WINDOW: str(FLOW_WINDOW_S),
        c.ENV_LOG_LEVEL: "warning",
        **{c.floor_env(stage): str(v) for stage, v in FLOORS_S.items()},
    }
    env[c.floor_env("decode")] = str(LONG_DECODE_FLOOR_S)
    env.update(gpus.env() if gpus is not None else {c.ENV_NVML: "off"})
    env.update(extra)
    return env


@dataclass
class ScenarioRun:
    scenario: str
    cluster: str
    expected: str | None
    fault_at: float | None = None  # wall clock of the fault (the scenario action), None without one
    # (seconds since the stack's load began, the cluster's verdict from /api/v1/diagnosis)
    timeline: list[tuple[float, Verdict]] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    truth: Truth | None = None
    ok_legs: int = 0

    @property
    def families(self) -> list[str | None]:
        return [v["family"] for _t, v in self.timeline]

    @property
    def final(self) -> Verdict | None:
        return self.timeline[-1][1] if self.timeline else None

    @property
    def final_family(self) -> str | None:
        family: str | None = self.final["family"] if self.final else None
        return family

    @property
    def latency_s(self) -> float | None:
        """Seconds from the fault to the first verdict naming the expected family."""
        if self.expected is None or self.fault_at is None:
            return None
        for t, v in self.timeline:
            if v["family"] == self.expected:
                return t - (self.fault_at - self.t0)
        return None

    t0: float = 0.0


def _verdict(diagnosis: list[Verdict], cluster: str) -> Verdict:
    for v in diagnosis:
        if v["cluster"] == cluster:
            return v
    return {"cluster": cluster, "family": None, "confidence": 0.0, "evidence": [], "findings": []}


def run_scenario(name: str, sidecar: Sidecar, gpus: GpuEmulator | None, *, cluster: str | None = None, seed: int = 1,
                 rate: float | None = None, watch_s: float | None = None, poll_s: float = 0.5) -> ScenarioRun:
    """Start the scenario's stack against `sidecar` (a started SidecarProcess), poll the diagnosis from the
    start until `watch_s` after the fault, stop the stack. The cluster is named after the scenario."""
    scenario = scenarios.get(name)
    cluster = cluster or name
    # Rooms (so trace ids) come from the seed: runs sharing a sidecar must not reuse them.
    seed = seed * 100_003 + zlib.crc32(cluster.encode())
    run = ScenarioRun(name, cluster, scenario.family)
    decode_floor = LONG_DECODE_FLOOR_S if name == "long-decode" else 30.0
    watch = watch_s if watch_s is not None else WATCH_S.get(name, DEFAULT_WATCH_S)
    fault_at = FAULT_AT.get(name, FAULT_AT_S)
    rate = rate if rate is not None else scenario.rate or 4.0
    stack = Stack(name, otlp_endpoint=sidecar.url, heartbeat_s=HEARTBEAT_S, rate=rate, restart_at=fault_at,
                  seed=seed, decode_floor_s=decode_floor, cluster=cluster, duration_s=fault_at + watch + 5.0,
                  gpus=gpus)
    try:
        stack.start()
        run.t0 = time.time()
        deadline = time.monotonic() + fault_at + watch
        while time.monotonic() < deadline:
            time.sleep(poll_s)
            for event in stack.poll_events():
                run.events.append(event)
                if run.fault_at is None and event["event"] in ("killed", "frozen", "desync", "kv_leak", "burst"):
                    run.fault_at = event["t"]
            run.timeline.append((time.time() - run.t0, _verdict(sidecar.get("/api/v1/diagnosis"), cluster)))
        run.truth = stack.truth()
        summary = sidecar.get("/api/v1/summary")
        finished = summary["clusters"].get(cluster, {}).get("finished", {})
        run.ok_legs = sum(v.get("ok", 0) for v in finished.values())
    finally:
        stack.stop()
    return run
