"""GPU emulation parts: engine status files, the feed that maps them onto devices, the TP barrier."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from pdwatch.testbed import scenarios
from pdwatch.testbed.engine_status import STALE_AFTER_S, StatusWriter, read_status
from pdwatch.testbed.gpu_emulation import STUB_LIBRARY, GpuEmulator
from pdwatch.testbed.gpu_feed import Feed, GpuFeed
from pdwatch.testbed.tp import ACK, STEP_BUSY, TpLeader
from tests.support.nvml_state import state_devices


def _emulator(tmp_path, n=3) -> GpuEmulator:
    return GpuEmulator(tmp_path / "state", [{"index": i, "uuid": f"GPU-{i:04d}"} for i in range(n)])


def test_status_writer_reports_shares_of_each_interval(tmp_path):
    path = tmp_path / "s.json"
    w = StatusWriter(path, interval_s=0.1).start()
    try:
        deadline = time.monotonic() + 5
        status = None
        while time.monotonic() < deadline:
            w.work(0.05)  # half of every 0.1 s interval
            time.sleep(0.1)
            status = read_status(path)
            if status and status["work"] > 0.2:
                break
        assert status is not None and 0.2 < status["work"] <= 1.0 and status["spin"] == 0.0
        assert status["pid"] == os.getpid()
    finally:
        w.stop()


def test_a_status_that_stopped_changing_reads_as_none(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"work": 1.0, "spin": 0.0, "pid": 1, "t": time.time() - STALE_AFTER_S - 1}))
    assert read_status(path) is None
    path.write_text("{not json")
    assert read_status(path) is None
    assert read_status(tmp_path / "missing.json") is None


def test_feed_maps_work_spin_and_silence_onto_the_devices(tmp_path):
    emu = _emulator(tmp_path)
    now = time.time()
    paths = [tmp_path / f"e{i}.json" for i in range(3)]
    paths[0].write_text(json.dumps({"work": 1.0, "spin": 0.0, "pid": 101, "t": now}))  # decoding
    paths[1].write_text(json.dumps({"work": 0.0, "spin": 0.9, "pid": 102, "t": now}))  # in a collective
    paths[2].write_text(json.dumps({"work": 1.0, "spin": 0.0, "pid": 103, "t": now - 10}))  # frozen since
    feed = GpuFeed(emu)
    for i, pid in enumerate((101, 102, 103)):
        feed.add(Feed(i, paths[i], lambda pid=pid: pid))
    feed.tick()
    busy, spin, frozen = state_devices(emu.path)
    assert busy["utilization_gpu"] == "100" and int(busy["power_mw"]) > 600_000 and busy["pids"] == "101"
    assert spin["utilization_gpu"] == "100" and 250_000 < int(spin["power_mw"]) < 400_000
    assert frozen["utilization_gpu"] == "0" and frozen["power_mw"] == "160000" and frozen["pids"] == "103"
    # A status left by a process that has since been replaced (new PID) is not believed.
    feed.feeds[0].pid = lambda: 999
    feed.tick()
    assert state_devices(emu.path)[0]["utilization_gpu"] == "0"
    feed.stop()
    assert all(d["utilization_gpu"] == "0" and "pids" not in d for d in state_devices(emu.path))


def test_claims_hand_out_each_device_once(tmp_path):
    emu = _emulator(tmp_path, 3)
    assert emu.claim(2) == [0, 1]
    with pytest.raises(ValueError, match="1 free"):
        emu.claim(2)
    emu.release([0])
    assert emu.claim(2) == [0, 2]


def test_batch_writes_once_at_the_end(tmp_path):
    emu = _emulator(tmp_path, 2)
    before = emu.path.stat().st_ino
    with emu.batch():
        emu.busy(0, 1.0)
        emu.spin(1)
        assert emu.path.stat().st_ino == before  # nothing written yet
    assert [d["utilization_gpu"] for d in state_devices(emu.path)] == ["100", "100"]


def test_for_demo_makes_distinct_h200s(tmp_path):
    assert STUB_LIBRARY.is_file(), "the NVML stub is not built (make test builds it: make nvml-stub)"
    emu = GpuEmulator.for_demo(tmp_path, count=4)
    uuids = [emu.uuid(i) for i in range(emu.count)]
    assert len(set(uuids)) == 4 and all(u.startswith("GPU-") for u in uuids)
    assert emu.env()["PDWATCH_NVML_STUB_STATE"] == str(emu.path)
    with pytest.raises(ValueError):
        GpuEmulator.for_demo(tmp_path, count=0)


def test_tp_barrier_waits_for_the_peer_and_counts_the_wait_as_spin():
    stop = threading.Event()
    writer = StatusWriter(None)
    leader = TpLeader(0, writer, stop)
    peer = socket.create_connection(("127.0.0.1", leader.port))
    answered = threading.Event()

    def follower():
        assert peer.recv(1) == STEP_BUSY
        time.sleep(0.3)  # late to the collective
        # Marked before sending: once the ACK is out the leader may return before this thread runs again.
        answered.set()
        peer.sendall(ACK)

    t = threading.Thread(target=follower)
    t.start()
    assert leader.sync(True) is True
    assert answered.is_set()
    t.join()
    assert 0.25 < writer._take()[1] < 5.0
    # A peer that never answers: the leader stays inside until the engine stops.
    result = []
    waiter = threading.Thread(target=lambda: result.append(leader.sync(False)))
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive() and not result
    stop.set()
    waiter.join(2)
    assert result == [False]
    peer.close()
    leader.close()


def test_new_scenarios_are_registered_with_their_families():
    params = scenarios.Params(restart_at=5.0)
    expected = {"healthy": None, "long-decode": None, "burst": None, "decode-restart": "transfer_wedge",
                "freeze-decode": "engine_silent", "tp-desync": "collective_desync",
                "kv-starvation": "queue_starvation", "total-wedge": "total_wedge"}
    assert {n: scenarios.get(n).family for n in expected} == expected
    assert scenarios.get("tp-desync").tp_groups(params) == {"decode-0": 2}
    assert scenarios.get("total-wedge").actions(params) == [(5.0, "restart", "decode-0"), (5.0, "restart", "decode-1")]
    assert scenarios.get("kv-starvation").engine_args(params, "decode-0") == ["--slots", "8"]
    assert scenarios.get("kv-starvation").engine_args(params, "decode-1") == []
