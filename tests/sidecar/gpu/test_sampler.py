"""The GPU sampler through the real nvidia-ml-py, against the NVML stub."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from ctypes.util import find_library

import pytest

from pdwatch.sidecar.gpu.sampler import GpuSampler
from tests.support.waiting import wait_for

from .conftest import DRIVER, REPO, UUIDS

GIB = 1 << 30


def test_values_follow_the_state_file(gpus, make_sampler):
    gpus.busy(0, 1.0)
    gpus.spin(1)
    gpus.idle(2)
    gpus.set(0, memory_used=80 * GIB, pids=[4242, 17])
    sampler = make_sampler(clock=lambda: 1234.5)

    sampler.sample_once()
    snap = sampler.snapshot()

    assert snap.up and snap.reason is None
    assert snap.driver == DRIVER  # the stub answered, not some other NVML
    assert snap.sampled_at == 1234.5
    busy, spinning, idle = snap.devices
    assert [d.uuid for d in snap.devices] == list(UUIDS)
    assert busy.name == "NVIDIA H200"
    assert (busy.utilization, busy.power_w, busy.power_limit_w) == (1.0, 665.0, 700.0)
    assert busy.memory_used_bytes == 80 * GIB
    assert busy.pids == (17, 4242)
    assert (spinning.utilization, spinning.power_w) == (1.0, 322.0)
    assert (idle.utilization, idle.power_w, idle.pids) == (0.0, 160.0, ())
    assert all(d.error is None and d.failures == () for d in snap.devices)

    # A later write is seen on the next pass.
    gpus.busy(0, 0.5)
    gpus.set(0, pids=[])
    sampler.sample_once()
    busy = sampler.snapshot().devices[0]
    assert (busy.utilization, busy.power_w, busy.pids) == (0.5, 412.5, ())


def test_one_lost_device_does_not_stop_the_others(gpus, make_sampler):
    gpus.busy(0, 0.25)
    gpus.busy(2, 0.75)
    sampler = make_sampler()
    sampler.sample_once()

    gpus.set(1, error="GPU_IS_LOST")  # fell off the bus after a good pass
    sampler.sample_once()
    snap = sampler.snapshot()

    assert snap.up
    first, lost, last = snap.devices
    assert lost.failures == (("handle", "gpu_is_lost"),)
    assert lost.error == "handle: GPU is lost"
    assert lost.uuid == UUIDS[1]  # remembered from the pass before, so it keeps its owner
    assert (lost.utilization, lost.power_w, lost.memory_used_bytes) == (None, None, None)
    assert (first.utilization, first.error) == (0.25, None)
    assert (last.utilization, last.error) == (0.75, None)

    gpus.set(1, error=None)
    sampler.sample_once()
    assert sampler.snapshot().devices[1].failures == ()


def test_a_query_not_supported_leaves_the_rest_of_the_device(gpus, make_sampler):
    gpus.busy(0, 1.0)
    gpus.set(0, fail={"power": "NOT_SUPPORTED", "processes": "NO_PERMISSION"})
    sampler = make_sampler()
    sampler.sample_once()
    dev = sampler.snapshot().devices[0]

    assert dev.power_w is None and dev.pids == ()
    assert dev.utilization == 1.0 and dev.power_limit_w == 700.0
    assert dev.failures == (("power", "not_supported"), ("processes", "no_permission"))
    assert dev.error == "power: Not Supported; processes: Insufficient Permissions"


def test_driver_not_loaded_then_recovers(gpus, make_sampler, monkeypatch, tmp_path):
    # The library loads but NVML cannot start: what a host without the driver shows.
    monkeypatch.setenv("PDWATCH_NVML_STUB_STATE", str(tmp_path / "absent"))
    sampler = make_sampler()
    sampler.sample_once()
    snap = sampler.snapshot()
    assert not snap.up
    assert snap.reason == "NVML init failed: Driver Not Loaded"
    assert snap.devices == ()

    monkeypatch.setenv("PDWATCH_NVML_STUB_STATE", str(gpus.path))
    sampler.sample_once()
    assert sampler.snapshot().up


def test_device_count_failure_marks_telemetry_down_until_nvml_answers(gpus, make_sampler):
    sampler = make_sampler()
    sampler.sample_once()
    assert sampler.snapshot().up

    gpus.set_system(count_error="UNKNOWN")
    sampler.sample_once()
    snap = sampler.snapshot()
    assert (snap.up, snap.reason, snap.devices) == (False, "NVML device count failed: Unknown Error", ())

    gpus.set_system(count_error=None)
    sampler.sample_once()  # re-initializes NVML, then samples
    assert sampler.snapshot().up and len(sampler.snapshot().devices) == 3


def test_devices_gone_from_nvml_leave_telemetry_up_and_empty(gpus, make_sampler, tmp_path, monkeypatch):
    sampler = make_sampler()
    sampler.sample_once()
    # The stub's state vanishes under a running NVML: it now lists no device.
    monkeypatch.setenv("PDWATCH_NVML_STUB_STATE", str(tmp_path / "absent"))
    sampler.sample_once()
    snap = sampler.snapshot()
    assert snap.up and snap.devices == ()


def test_unloadable_library_is_a_reason_not_a_crash(make_sampler, tmp_path):
    sampler = make_sampler(library=str(tmp_path / "libnvidia-ml.so.1"))
    sampler.sample_once()
    snap = sampler.snapshot()
    assert not snap.up
    assert snap.reason.startswith(f"cannot load NVML library {tmp_path / 'libnvidia-ml.so.1'}")


def test_off_mode_never_samples(gpus, make_sampler):
    sampler = make_sampler(mode="off").start()
    sampler.sample_once()
    snap = sampler.snapshot()
    assert (snap.up, snap.reason, snap.devices) == (False, "disabled", ())


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="mode"):
        GpuSampler(mode="on")
    with pytest.raises(ValueError, match="interval"):
        GpuSampler(interval_s=0)


def test_thread_samples_and_follows_changes(gpus, make_sampler):
    sampler = make_sampler(interval_s=0.05).start()
    assert wait_for(lambda: sampler.snapshot().up)
    gpus.busy(2, 1.0)
    assert wait_for(lambda: sampler.snapshot().devices[2].utilization == 1.0)
    sampler.stop()
    assert sampler.snapshot().up  # the last pass stays readable after stop


def test_a_hung_nvml_call_marks_telemetry_stalled(gpus, make_sampler):
    sampler = make_sampler(interval_s=0.05, stall_after_s=0.2).start()
    assert wait_for(lambda: sampler.snapshot().up)

    gpus.set(0, delay_ms=2500)  # every query of GPU 0 now hangs 2.5 s
    stalled = wait_for(lambda: not sampler.snapshot().up)
    assert stalled
    assert sampler.snapshot().reason.startswith("NVML sampling stalled: a pass has run for")

    gpus.set(0, delay_ms=0)
    assert wait_for(lambda: sampler.snapshot().up, timeout_s=30)


NO_NVML_PROBE = """
import json
from pdwatch.sidecar.gpu.sampler import GpuSampler
s = GpuSampler()
s.sample_once()
snap = s.snapshot()
print(json.dumps({"up": snap.up, "reason": snap.reason}))
"""


@pytest.mark.skipif(find_library("nvidia-ml") is not None, reason="this host has a real NVML library")
def test_no_nvml_library_at_all(tmp_path):
    # A fresh process whose loader cannot find any libnvidia-ml.so.1.
    env = {k: v for k, v in os.environ.items() if k not in ("PDWATCH_NVML_STUB_STATE",)}
    env["LD_LIBRARY_PATH"] = str(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", NO_NVML_PROBE], cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"up": False, "reason": "NVML init failed: NVML Shared Library Not Found"}
