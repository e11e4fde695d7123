"""Every testbed scenario, run for real, gets its failure family from the diagnosis.

One real `pdwatch serve` reads emulated GPUs through the NVML stub and the
unmodified nvidia-ml-py; each scenario's stack (prefill and decodes over real
NIXL, each engine process driving its own emulated GPU from its real work)
exports to it as its own cluster. `/api/v1/diagnosis` must name:

    decode-restart -> transfer_wedge (restart_skew among the findings)
    freeze-decode  -> engine_silent
    tp-desync      -> collective_desync
    tp-desync-idle -> collective_desync (the leader hung while idle: named from its loop alone)
    kv-starvation  -> queue_starvation
    total-wedge    -> total_wedge
    healthy, long-decode, burst -> no family, at every poll of the run

with the GPU figures in the evidence. About 3 minutes on 2 cores.
"""

from __future__ import annotations

import re

import pytest

from pdwatch.testbed import scenarios
from pdwatch.testbed.diagnosis_run import FLOORS_S, FLOW_WINDOW_S, HEARTBEAT_S, run_scenario, sidecar_env
from pdwatch.testbed.gpu_emulation import STUB_LIBRARY, GpuEmulator
from pdwatch.testbed.sidecar_process import SidecarProcess

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", autouse=True)
def _nvml_stub_built():
    if not STUB_LIBRARY.is_file():
        pytest.fail("the NVML stub is not built (make test builds it: make nvml-stub)")

# Families a scenario may show before its own, and why that is right:
TOLERATED_BEFORE = {
    # A restarted decode is silent for the second it takes to come back.
    "decode-restart": {"engine_silent"},
    # Until the flow window passes, legs finished before the restarts still count as flowing,
    # so the stuck transfers read as a transfer wedge (with restarts alone) first.
    "total-wedge": {"transfer_wedge", "restart_skew", "engine_silent"},
}
# Seconds from the fault to the expected family: floor + 3 heartbeats + polling slack,
# and for total-wedge the flow window on top.
STUCK_BY_S = max(FLOORS_S["bootstrap"], FLOORS_S["transfer"]) + 3 * HEARTBEAT_S + 4.0
DETECTED_BY_S = {"total-wedge": FLOW_WINDOW_S + STUCK_BY_S, "freeze-decode": 3 * HEARTBEAT_S + 3.0,
                 "tp-desync": 3 * HEARTBEAT_S + 3.0, "tp-desync-idle": 3 * HEARTBEAT_S + 3.0}

EVIDENCE = {
    # The brief's inference: the decode's GPU is idle, so it is not a collective.
    "decode-restart": ("0 % utilization", "160 W of 700 W", "near idle"),
    "freeze-decode": ("decode decode-0: no heartbeat",),
    "tp-desync": ("scheduler loop frozen", "100 % utilization", "spin in a collective"),
    "tp-desync-idle": ("scheduler loop frozen while idle", "100 % utilization", "spin in a collective"),
    "kv-starvation": ("decode decode-0", "waiting for KV memory"),
    "total-wedge": ("no leg finished ok anywhere", "idle GPUs", "160 W"),
}


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    gpus = GpuEmulator.for_demo(tmp_path_factory.mktemp("gpus"), count=8)
    # Stack capture on: the testbed's engines run on this host, under PIDs the sidecar can read.
    with SidecarProcess(env=sidecar_env(gpus, PDWATCH_CAPTURE="py-spy")) as sc:
        yield sc, gpus


@pytest.mark.parametrize("name", ["healthy", "long-decode", "burst"])
def test_healthy_shapes_get_no_family(sidecar, name):
    sc, gpus = sidecar
    run = run_scenario(name, sc, gpus)
    assert run.timeline, "the diagnosis was never polled"
    named = [(round(t, 1), v["family"], v["evidence"]) for t, v in run.timeline if v["family"] is not None]
    assert named == [], f"{name} should never be diagnosed"
    assert run.ok_legs >= 60, f"the testbed should have completed requests ({run.ok_legs} legs ok)"
    if name == "burst":
        truth = run.truth
        burst_at = next(e["t"] for e in run.events if e["event"] == "burst")
        before = [r.done_at - r.sent_at for r in truth.requests if r.done_at and r.sent_at < burst_at - 0.5]
        burst = [r.done_at - r.sent_at for r in truth.requests
                 if r.done_at and burst_at - 0.1 <= r.sent_at <= burst_at + 0.5]
        assert len(burst) >= 30, "the burst's requests should have completed"
        # They queued: the slowest took well past anything before the burst, yet nothing was stuck.
        assert max(burst) > max(before) + 1.0, (max(burst), max(before))


@pytest.mark.parametrize("name", ["decode-restart", "freeze-decode", "tp-desync", "tp-desync-idle", "kv-starvation",
                                  "total-wedge"])
def test_fault_gets_its_family(sidecar, name):
    sc, gpus = sidecar
    expected = scenarios.get(name).family
    run = run_scenario(name, sc, gpus)
    assert run.fault_at is not None, f"the fault never happened: {run.events}"
    assert run.final_family == expected, (run.final, run.families)
    # Detected in time, and never anything but the expected family once named.
    assert run.latency_s is not None and run.latency_s <= DETECTED_BY_S.get(name, STUCK_BY_S), run.latency_s
    first = run.families.index(expected)
    assert set(run.families[first:]) == {expected}, run.families[first:]
    others = {f for f in run.families[:first] if f is not None} - TOLERATED_BEFORE.get(name, set())
    assert not others, f"named {others} before {expected}"
    final = run.final
    text = " ".join(final["evidence"])
    for needle in EVIDENCE[name]:
        assert needle in text, f"{needle!r} not in the evidence: {final['evidence']}"
    findings = {f["family"] for f in final["findings"]}
    if name == "decode-restart":
        assert "restart_skew" in findings, final["findings"]
        assert "co-restart the PD pair" in final["action"]
    if name == "freeze-decode":
        # Others kept flowing while decode-0 was frozen.
        assert any(r.decode == "decode-1" and r.outcome == "ok" and r.done_at > run.fault_at
                   for r in run.truth.requests)
    # What sets the stuck legs apart (the best of what the sidecar reports).
    contrast = [(x["attribute"], x["value"], x.get("role")) for x in final.get("contrast", [])]
    if name == "decode-restart":
        # The prefill legs write to decode-0's agent from before its restart; the decode legs are decode-0's.
        assert ("peer_process", "ended", "prefill") in contrast or ("peer_process", "ended", None) in contrast, \
            final["contrast"]
        assert ("involves", "decode-0", None) in contrast, final["contrast"]
    if name in ("freeze-decode", "kv-starvation"):
        # A fault of one decode instance: its legs, or the legs that talk to it (a frozen decode is down,
        # and its own legs are no longer judged: the prefill legs writing to it are the stuck ones).
        assert {a for a in contrast if a[1] == "decode-0" and a[0] in ("pd_instance", "involves", "peer")}, \
            final["contrast"]
    if name == "tp-desync-idle":
        # It hung holding no request, and no leg of decode-0 opened since: none is stuck on evidence.
        assert next(e for e in run.events if e["event"] == "desync_idle")["idle"], run.events
        assert not any(s["pd_instance"] == "decode-0" for s in sidecar[0].get("/api/v1/stuck")
                       if s.get("cluster") == run.cluster)
    if name == "tp-desync":
        # Where it is blocked: decode-0's leader waits in the per-step collective (testbed/tp.py).
        captures = [cap for cap in final.get("captures", []) if cap["pd_instance"] == "decode-0"]
        assert captures and not any(cap["error"] for cap in captures), captures
        leader = next(cap for cap in captures if cap["tp_rank"] == 0)
        # py-spy names a frame `Class.method (path:line)`, the path relative to the process's sys.path entry
        # (testbed/tp.py from a checkout, pdwatch/testbed/tp.py from a wheel).
        assert re.search(r"TpLeader\.sync \((?:[^()\s]*/)?tp\.py:\d+\)", leader["stacks"]), leader["stacks"][-3000:]
        assert "its scheduler loop froze" in leader["reason"] or "stuck legs" in leader["reason"]
    if name == "kv-starvation":
        assert any(r.decode == "decode-0" and r.outcome == "ok" and r.done_at > run.fault_at
                   for r in run.truth.requests), "decode-0's running requests should have kept finishing"
    if name == "total-wedge":
        assert not any(r.outcome == "ok" and r.done_at > run.fault_at + 3.0 for r in run.truth.requests)


@pytest.mark.parametrize("name", ["long-prompt-wedge", "scattered-wedge"])
def test_the_contrast_names_what_the_stuck_share_or_nothing(sidecar, name):
    sc, gpus = sidecar
    run = run_scenario(name, sc, gpus, watch_s=12.0)
    final = run.final
    assert final["family"] is not None and sum(1 for r in run.truth.requests if r.done_at is None) >= 3, final
    contrast = final.get("contrast", [])
    if name == "long-prompt-wedge":
        # The prompts over 200 tokens hang, the rest flow: the best cut lies above 200.
        top = contrast[0] if contrast else {}
        assert top.get("attribute") == "prompt_tokens" and top["value"].startswith(">= "), contrast
        assert 200 < int(top["value"][3:]) <= 257 and top["stuck"] == 1.0 and top["flowing"] == 0.0, top
    else:
        # Hung at random, through both decodes, of every length: nothing clear to name.
        assert contrast == [], contrast

