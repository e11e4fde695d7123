"""End to end: `pdwatch serve` in its own process finds the NVML stub through
LD_LIBRARY_PATH (as in the demo), and joins emulated GPUs to engines whose
real recorders send heartbeats: by UUID, by PID, by configuration; and, in this
process, that /healthz and /metrics read the same evaluation of the GPUs."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdwatch.engine_patches.recorder import Recorder, RecorderConfig
from pdwatch.testbed.processes import free_port
from tests.support.waiting import wait_for

from .conftest import DRIVER, REPO, UUIDS


def wait_for_up(fn, timeout_s=20.0, **kw):
    # The sidecar process may not be listening yet: connection errors count as 'not yet'.
    return wait_for(fn, timeout_s, ignore=(httpx.HTTPError,), interval_s=0.1, **kw)

pytestmark = pytest.mark.integration

DECODE_PID = 424_242  # the pid the decode engine's heartbeats announce


def gpu_series(url: str) -> dict[str, dict[str, tuple[dict[str, str], float]]]:
    """metric name -> gpu index -> (labels, value), GPU metrics only."""
    out: dict[str, dict[str, tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text):
        for s in fam.samples:
            if s.name.startswith("pdwatch_gpu_"):
                out.setdefault(s.name, {})[s.labels.get("gpu", "")] = (s.labels, s.value)
    return out


@pytest.fixture
def sidecar(gpus, stub_library, tmp_path):
    port = free_port()
    env = {**os.environ, **gpus.env(), "PDWATCH_GPU_INTERVAL_S": "0.2", "PDWATCH_GPU_MAP": "2=default/decode/decode-1"}
    log = open(tmp_path / "sidecar.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdwatch.cli", "serve", "--port", str(port)],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_for_up(lambda: httpx.get(f"{url}/healthz", timeout=1).status_code == 200), (tmp_path / "sidecar.log").read_text()
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def engine(url: str, role: str, instance: str, **cfg) -> Recorder:
    return Recorder(RecorderConfig(role=role, instance=instance, heartbeat_s=1.0, endpoint=url, **cfg), environ={})


def test_sidecar_samples_and_joins_emulated_gpus(gpus, sidecar):
    url = sidecar
    gpus.busy(0, 1.0)  # the prefill computing
    gpus.idle(1)  # the decode waiting on a transfer that never lands
    gpus.set(1, pids=[DECODE_PID])
    gpus.spin(2)

    health = wait_for_up(lambda: (h := httpx.get(f"{url}/healthz", timeout=2).json())["gpu_telemetry"]["up"] and h)
    assert health["gpu_telemetry"] == {"up": True, "reason": None, "devices": 3, "driver": DRIVER}

    prefill = engine(url, "prefill", "prefill-0", gpu_uuids=(UUIDS[0],))
    decode = engine(url, "decode", "decode-0", pid=DECODE_PID)
    for rec in (prefill, decode):
        rec.heartbeat()
        assert rec.flush()

    def joined():
        series = gpu_series(url)
        info = series.get("pdwatch_gpu_info", {})
        return series if {g: x["joined_by"] for g, (x, _) in info.items()} == {"0": "uuid", "1": "pid", "2": "config"} else None

    series = wait_for_up(joined)
    assert series, gpu_series(url)
    util = series["pdwatch_gpu_utilization_ratio"]
    assert util["0"] == ({"gpu": "0", "uuid": UUIDS[0], "pd_cluster": "default", "role": "prefill", "pd_instance": "prefill-0"}, 1.0)
    assert util["1"] == ({"gpu": "1", "uuid": UUIDS[1], "pd_cluster": "default", "role": "decode", "pd_instance": "decode-0"}, 0.0)
    assert util["2"][0]["pd_instance"] == "decode-1" and util["2"][1] == 1.0
    assert series["pdwatch_gpu_power_watts"]["1"][1] == 160.0
    assert series["pdwatch_gpu_power_limit_watts"]["1"][1] == 700.0
    assert series["pdwatch_gpu_telemetry_up"][""][1] == 1.0

    # The decode's GPU falls off the bus: reported for it, the others go on.
    gpus.set(1, error="GPU_IS_LOST")
    lost = wait_for_up(lambda: gpu_series(url).get("pdwatch_gpu_device_errors", {}).get("1"))
    assert lost[0] == {"gpu": "1", "uuid": UUIDS[1], "pd_cluster": "default", "role": "decode",
                       "pd_instance": "decode-0", "query": "handle", "error": "gpu_is_lost"}
    after = gpu_series(url)
    assert after["pdwatch_gpu_info"]["1"][0]["joined_by"] == "pid_last_known"  # it lists no processes any more
    assert set(after["pdwatch_gpu_utilization_ratio"]) == {"0", "2"}
    assert after["pdwatch_gpu_telemetry_up"][""][1] == 1.0


def test_sidecar_reports_why_gpu_telemetry_is_down(gpus, sidecar):
    # NVML loaded and initialized, then the driver stops answering.
    gpus.set_system(count_error="DRIVER_NOT_LOADED")
    reason = "NVML device count failed: Driver Not Loaded"
    health = wait_for_up(lambda: (h := httpx.get(f"{sidecar}/healthz", timeout=2).json())["gpu_telemetry"]["reason"] == reason and h)
    assert health["gpu_telemetry"]["up"] is False and health["gpu_telemetry"]["devices"] == 0
    # /healthz and /metrics read the same evaluation, so a scrape after /healthz says
    # down can never show the GPUs of an earlier one.
    series = gpu_series(sidecar)
    assert series == {"pdwatch_gpu_telemetry_up": {"": ({}, 0.0)}}


def test_healthz_and_metrics_tell_one_story_while_the_sampler_runs_ahead(gpus, stub_library, live_sidecar):
    # The judge ticks once an hour here, so the sampler sees the driver go while the latest
    # evaluation still holds three GPUs: both readers must keep showing that evaluation.
    sc = live_sidecar(nvml_library=stub_library, gpu_interval_s=0.05, evaluate_interval_s=3600)
    wait_for(lambda: sc.sidecar.gpu.snapshot().up, 10)
    sc.judge_now()
    gpus.set_system(count_error="DRIVER_NOT_LOADED")
    wait_for(lambda: not sc.sidecar.gpu.snapshot().up, 10)
    health = httpx.get(f"{sc.url}/healthz", timeout=2).json()["gpu_telemetry"]
    assert health == {"up": True, "reason": None, "devices": 3, "driver": DRIVER}
    assert gpu_series(sc.url)["pdwatch_gpu_telemetry_up"][""][1] == 1.0
    sc.judge_now()
    health = httpx.get(f"{sc.url}/healthz", timeout=2).json()["gpu_telemetry"]
    assert health["up"] is False and health["reason"] == "NVML device count failed: Driver Not Loaded"
    assert gpu_series(sc.url) == {"pdwatch_gpu_telemetry_up": {"": ({}, 0.0)}}
