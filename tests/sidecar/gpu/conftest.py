"""Fixtures: the NVML stub library, built by make, and emulated GPUs that
the real nvidia-ml-py reads through it, in this test process."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pdwatch.sidecar.gpu.sampler import GpuSampler
from pdwatch.testbed.gpu_emulation import STATE_ENV, STUB_LIBRARY, GpuEmulator

REPO = Path(__file__).resolve().parents[3]
DRIVER = "560.35.03-emulated"
UUIDS = (
    "GPU-0a6c2f3e-5b1d-4e2a-9c8f-111111111111",
    "GPU-0a6c2f3e-5b1d-4e2a-9c8f-222222222222",
    "GPU-0a6c2f3e-5b1d-4e2a-9c8f-333333333333",
)


@pytest.fixture(scope="session")
def stub_library() -> str:
    # make test builds it first; a bare pytest run gets it built here (make is a no-op when fresh).
    subprocess.run(["make", "-s", "nvml-stub"], cwd=REPO, check=True)
    assert STUB_LIBRARY.is_file()
    return str(STUB_LIBRARY)


@pytest.fixture
def gpus(tmp_path, monkeypatch) -> GpuEmulator:
    """Three emulated H200s (700 W limit, 160 W idle), all idle."""
    emu = GpuEmulator(
        tmp_path / "nvml-state",
        [{"index": i, "uuid": u, "name": "NVIDIA H200"} for i, u in enumerate(UUIDS)],
        driver=DRIVER,
    )
    # The stub reads the path from the environment on every call.
    monkeypatch.setenv(STATE_ENV, str(emu.path))
    return emu


@pytest.fixture
def make_sampler(stub_library):
    made: list[GpuSampler] = []

    def make(**kwargs) -> GpuSampler:
        kwargs.setdefault("library", stub_library)
        s = GpuSampler(**kwargs)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()
