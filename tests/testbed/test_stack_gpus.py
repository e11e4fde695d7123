"""The stack with emulated GPUs: each engine process claims its own device and
drives it from its real work; a TP-2 decode whose rank 1 stops joining leaves
rank 0 spinning in the barrier with its loop frozen and its heartbeats on."""

from __future__ import annotations

import time

import pytest

from pdwatch import contract as c
from pdwatch.testbed.gpu_emulation import GpuEmulator
from pdwatch.testbed.stack import Stack
from tests.support.nvml_state import state_devices
from tests.support.otlp_receiver import OtlpReceiver
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration




def test_tp_desync_spins_rank_0_and_freezes_its_loop(tmp_path):
    emu = GpuEmulator(tmp_path / "state", [{"index": i, "uuid": f"GPU-{i:04d}"} for i in range(6)])
    with OtlpReceiver() as sink:
        stack = Stack("tp-desync", otlp_endpoint=sink.url, heartbeat_s=0.5, rate=4.0, restart_at=2.5,
                      duration_s=12.0, gpus=emu)
        try:
            stack.start()
            assert set(stack.gpu_of) == {"prefill-0", "decode-0", "decode-1", "decode-0/tp1"}
            assert len(set(stack.gpu_of.values())) == 4
            d0, d0r1 = stack.gpu_of["decode-0"], stack.gpu_of["decode-0/tp1"]
            pids = stack.pids()
            # Before the fault, decode-0 (both ranks) works and its GPUs read busy with its PIDs.
            wait_for(lambda: int(state_devices(emu.path)[d0]["utilization_gpu"]) > 50, 5, "decode-0's GPU busy")
            assert state_devices(emu.path)[d0]["pids"] == str(pids["decode-0"])
            assert state_devices(emu.path)[d0r1]["pids"] == str(pids["decode-0/tp1"])
            wait_for(lambda: any(e["event"] == "desync" for e in stack.poll_events()), 10, "the desync")
            # Rank 0 spins in the collective (~100 %, moderate power); rank 1 sits idle.
            wait_for(lambda: state_devices(emu.path)[d0]["utilization_gpu"] == "100"
                     and 250_000 < int(state_devices(emu.path)[d0]["power_mw"]) < 400_000, 5, "rank 0 spinning")
            wait_for(lambda: state_devices(emu.path)[d0r1]["utilization_gpu"] == "0", 5, "rank 1 idle")
            time.sleep(3.5)  # three heartbeats (1 s) after the freeze, with the recorder's 1 s wake-ups
            # Both ranks heartbeat; rank 0's loop counter no longer moves.
            beats = [s for s in sink.heartbeats("decode-0") if s.resource.get(c.R_TP_RANK) == 0]
            recent = [s.attrs[c.H_LOOP] for s in sorted(beats, key=lambda s: s.end_ns)[-3:]]
            assert len(recent) == 3 and len(set(recent)) == 1, recent
            assert any(s.resource.get(c.R_TP_RANK) == 1 for s in sink.heartbeats("decode-0"))
            assert list(beats[-1].resource[c.R_GPU_UUIDS]) == [emu.uuid(d0)]
            # decode-1 keeps serving.
            ok_before = len(stack.truth().completed)
            wait_for(lambda: len(stack.truth().completed) > ok_before, 5, "decode-1 completing")
        finally:
            stack.stop()
    assert all(d["utilization_gpu"] == "0" and "pids" not in d for d in state_devices(emu.path))
    assert emu.claim(6) == list(range(6))  # released on stop
