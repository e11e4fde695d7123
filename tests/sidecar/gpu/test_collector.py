"""The GPU collector's exposition, scraped through prometheus_client, over real NVML reads of the
stub, joined to instances by the judge from what real recorders' heartbeats claim."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdwatch.sidecar.gpu.collector import GpuCollector
from pdwatch.sidecar.gpu.join import parse_gpu_map
from pdwatch.sidecar.judge import Judge
from pdwatch.sidecar.tracker import Tracker
from tests.support.sidecar import Engine, FakeClock
from tests.support.tracking import ingest

from .conftest import UUIDS


@pytest.fixture
def world():
    """A tracker fed by engines that claim GPUs (by UUID or by PID), and a judge over a sampler."""
    clock = FakeClock()
    tracker = Tracker(clock=clock)
    made = []

    def claim(role, instance, cluster="default", **cfg):
        e = Engine(role, instance, clock, cluster=cluster, **cfg)
        made.append(e)
        ingest(tracker, e.request(heartbeat=True))

    def collector(sampler, gpu_map=""):
        judge = Judge(tracker, gpu=sampler, gpu_map=parse_gpu_map(gpu_map))
        return judge, GpuCollector(lambda: judge.latest)

    yield claim, collector
    for e in made:
        e.rec.shutdown(timeout_s=1)


def judged(judge, collector):
    judge.tick()
    return scrape(collector)


def scrape(collector) -> dict[str, list[tuple[dict[str, str], float]]]:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def by_gpu(samples):
    return {labels["gpu"]: (labels, value) for labels, value in samples}


def test_claimed_and_unclaimed_devices(gpus, make_sampler, world):
    claim, collector = world
    gpus.busy(0, 1.0)
    gpus.set(0, memory_used=1 << 34)
    gpus.set(1, pids=[7001])
    sampler = make_sampler()
    sampler.sample_once()
    claim("decode", "decode-0", gpu_uuids=(UUIDS[0],))
    claim("prefill", "p-0", cluster="c2", pid=7001)
    metrics = judged(*collector(sampler))

    assert metrics["pdwatch_gpu_telemetry_up"] == [({}, 1.0)]
    util = by_gpu(metrics["pdwatch_gpu_utilization_ratio"])
    assert util["0"] == ({"gpu": "0", "uuid": UUIDS[0], "pd_cluster": "default", "role": "decode", "pd_instance": "decode-0"}, 1.0)
    assert util["1"][0] == {"gpu": "1", "uuid": UUIDS[1], "pd_cluster": "c2", "role": "prefill", "pd_instance": "p-0"}
    # Nobody claims GPU 2: its owner labels are empty strings, its figures still there.
    assert util["2"] == ({"gpu": "2", "uuid": UUIDS[2], "pd_cluster": "", "role": "", "pd_instance": ""}, 0.0)
    assert by_gpu(metrics["pdwatch_gpu_power_watts"])["0"][1] == 665.0
    assert by_gpu(metrics["pdwatch_gpu_power_watts"])["2"][1] == 160.0
    assert by_gpu(metrics["pdwatch_gpu_power_limit_watts"])["1"][1] == 700.0
    assert by_gpu(metrics["pdwatch_gpu_memory_used_bytes"])["0"][1] == float(1 << 34)
    joined = {labels["gpu"]: labels["joined_by"] for labels, _ in metrics["pdwatch_gpu_info"]}
    assert joined == {"0": "uuid", "1": "pid", "2": "none"}
    assert "pdwatch_gpu_device_errors" not in metrics


def test_no_nvml_exposes_only_telemetry_up_zero(make_sampler, tmp_path, monkeypatch, world):
    _claim, collector = world
    monkeypatch.setenv("PDWATCH_NVML_STUB_STATE", str(tmp_path / "absent"))
    sampler = make_sampler()
    sampler.sample_once()
    judge, coll = collector(sampler)
    assert judged(judge, coll) == {"pdwatch_gpu_telemetry_up": [({}, 0.0)]}
    assert judge.latest.gpus == () and judge.latest.gpu_reason  # why it is down, for /healthz


def test_device_errors_are_series_of_their_own(gpus, make_sampler, world):
    _claim, collector = world
    sampler = make_sampler()
    sampler.sample_once()
    gpus.set(1, error="GPU_IS_LOST")
    gpus.set(2, fail={"power": "NOT_SUPPORTED"})
    sampler.sample_once()
    metrics = judged(*collector(sampler, "1=decode/decode-0"))

    errors = sorted((x["gpu"], x["query"], x["error"], x["pd_instance"]) for x, v in metrics["pdwatch_gpu_device_errors"] if v == 1.0)
    assert errors == [("1", "handle", "gpu_is_lost", "decode-0"), ("2", "power", "not_supported", "")]
    assert set(by_gpu(metrics["pdwatch_gpu_utilization_ratio"])) == {"0", "2"}
    assert set(by_gpu(metrics["pdwatch_gpu_power_watts"])) == {"0"}
    assert metrics["pdwatch_gpu_telemetry_up"] == [({}, 1.0)]


def test_a_scrape_reads_the_evaluation_and_never_nvml(gpus, make_sampler, world):
    _claim, collector = world
    sampler = make_sampler()
    sampler.sample_once()
    judge, coll = collector(sampler)
    judge.tick()
    gpus.busy(0, 1.0)
    sampler.sample_once()  # a new pass: the scrape still shows what the judge joined
    assert by_gpu(scrape(coll)["pdwatch_gpu_utilization_ratio"])["0"][1] == 0.0
    assert by_gpu(judged(judge, coll)["pdwatch_gpu_utilization_ratio"])["0"][1] == 1.0


def test_a_lost_gpu_keeps_the_owner_its_processes_gave_it(gpus, make_sampler, world):
    claim, collector = world
    gpus.set(1, pids=[8001])
    sampler = make_sampler()
    claim("decode", "decode-0", pid=8001)
    judge, coll = collector(sampler)
    sampler.sample_once()
    first = judged(judge, coll)
    assert by_gpu(first["pdwatch_gpu_info"])["1"][0]["joined_by"] == "pid"

    gpus.set(1, error="GPU_IS_LOST")  # a lost GPU lists no processes
    sampler.sample_once()
    after = judged(judge, coll)
    labels = by_gpu(after["pdwatch_gpu_device_errors"])["1"][0]
    assert (labels["pd_instance"], labels["error"]) == ("decode-0", "gpu_is_lost")
    assert by_gpu(after["pdwatch_gpu_info"])["1"][0]["joined_by"] == "pid_last_known"

    # A healthy device nobody claims any more is unclaimed, not remembered.
    gpus.set(1, error=None, pids=[])
    sampler.sample_once()
    assert by_gpu(judged(judge, coll)["pdwatch_gpu_info"])["1"][0]["joined_by"] == "none"
