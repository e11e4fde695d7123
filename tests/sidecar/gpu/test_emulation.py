"""The testbed's GPU emulator: the state file it writes and the input it refuses."""

from __future__ import annotations

import pytest

from pdwatch.testbed.gpu_emulation import GpuEmulator


def test_shapes_the_diagnosis_reads(gpus, make_sampler):
    # busy decode hot, wedged decode near 0 % at idle power, spinning collective ~100 % at moderate power
    gpus.busy(0, 0.9)
    gpus.idle(1)
    gpus.spin(2)
    sampler = make_sampler()
    sampler.sample_once()
    busy, wedged, spinning = sampler.snapshot().devices
    assert busy.utilization == 0.9 and busy.power_w > 0.85 * busy.power_limit_w
    assert wedged.utilization == 0.0 and wedged.power_w == 160.0
    assert spinning.utilization == 1.0 and 160.0 < spinning.power_w < 0.5 * spinning.power_limit_w


def test_state_is_replaced_whole(gpus):
    before = gpus.path.stat().st_ino
    gpus.set(0, pids=[1, 2])
    assert gpus.path.stat().st_ino != before  # a rename, never an in-place rewrite
    assert "pids 1 2\n" in gpus.path.read_text()
    assert [p.name for p in gpus.path.parent.iterdir() if p.name.startswith(".gpu-state-")] == []


def test_env_points_a_process_at_the_stub(gpus):
    env = gpus.env()
    assert env["PDWATCH_NVML_STUB_STATE"] == str(gpus.path)
    assert env["LD_LIBRARY_PATH"].split(":")[0].endswith("build/nvml")


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda e: e.busy(0, 1.5), "fraction"),
        (lambda e: e.set(0, utilization=-0.1), "fraction"),
        (lambda e: e.set(0, power_w=-1), "power"),
        (lambda e: e.set(0, memory_used=1 << 60), "memory used"),
        (lambda e: e.set(0, error="GPU IS LOST"), "whitespace"),
        (lambda e: e.set(3, utilization=0.5), "no emulated GPU 3"),
    ],
)
def test_bad_input_is_refused(gpus, call, message):
    with pytest.raises(ValueError, match=message):
        call(gpus)


def test_bad_device_lists_are_refused(tmp_path):
    with pytest.raises(ValueError, match="indices"):
        GpuEmulator(tmp_path / "s", [{"index": 1, "uuid": "GPU-a"}])
    with pytest.raises(ValueError, match="idle power"):
        GpuEmulator(tmp_path / "s", [{"index": 0, "uuid": "GPU-a", "idle_w": 800}])
