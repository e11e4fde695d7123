"""The GPU collector's exposition, scraped through prometheus_client, over real NVML reads of the stub."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdwatch.sidecar.gpu import GpuCollector, InstanceClaim, Owner, parse_gpu_map

from .conftest import UUIDS

DECODE0 = Owner("default", "decode", "decode-0")


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


def test_claimed_and_unclaimed_devices(gpus, make_sampler):
    gpus.busy(0, 1.0)
    gpus.set(0, memory_used=1 << 34)
    gpus.set(1, pids=[7001])
    sampler = make_sampler()
    sampler.sample_once()
    claims = [InstanceClaim(DECODE0, (UUIDS[0],), ()), InstanceClaim(Owner("c2", "prefill", "p-0"), (), (7001,))]
    metrics = scrape(GpuCollector(sampler, lambda: claims, parse_gpu_map("")))

    assert metrics["pdwatch_gpu_telemetry_up"] == [({}, 1.0)]
    util = by_gpu(metrics["pdwatch_gpu_utilization_ratio"])
    assert util["0"] == ({"gpu": "0", "uuid": UUIDS[0], "cluster": "default", "role": "decode", "pd_instance": "decode-0"}, 1.0)
    assert util["1"][0] == {"gpu": "1", "uuid": UUIDS[1], "cluster": "c2", "role": "prefill", "pd_instance": "p-0"}
    # Nobody claims GPU 2: its owner labels are empty strings, its figures still there.
    assert util["2"] == ({"gpu": "2", "uuid": UUIDS[2], "cluster": "", "role": "", "pd_instance": ""}, 0.0)
    assert by_gpu(metrics["pdwatch_gpu_power_watts"])["0"][1] == 665.0
    assert by_gpu(metrics["pdwatch_gpu_power_watts"])["2"][1] == 160.0
    assert by_gpu(metrics["pdwatch_gpu_power_limit_watts"])["1"][1] == 700.0
    assert by_gpu(metrics["pdwatch_gpu_memory_used_bytes"])["0"][1] == float(1 << 34)
    joined = {labels["gpu"]: labels["joined_by"] for labels, _ in metrics["pdwatch_gpu_info"]}
    assert joined == {"0": "uuid", "1": "pid", "2": "none"}
    assert "pdwatch_gpu_device_errors" not in metrics


def test_no_nvml_exposes_only_telemetry_up_zero(make_sampler, tmp_path, monkeypatch):
    monkeypatch.setenv("PDWATCH_NVML_STUB_STATE", str(tmp_path / "absent"))
    sampler = make_sampler()
    sampler.sample_once()
    calls = []
    metrics = scrape(GpuCollector(sampler, lambda: calls.append(1) or [], {}))
    assert metrics == {"pdwatch_gpu_telemetry_up": [({}, 0.0)]}
    assert calls == []  # no owners looked up for no devices


def test_device_errors_are_series_of_their_own(gpus, make_sampler):
    sampler = make_sampler()
    sampler.sample_once()
    gpus.set(1, error="GPU_IS_LOST")
    gpus.set(2, fail={"power": "NOT_SUPPORTED"})
    sampler.sample_once()
    metrics = scrape(GpuCollector(sampler, lambda: [], parse_gpu_map("1=decode/decode-0")))

    errors = sorted((l["gpu"], l["query"], l["error"], l["pd_instance"]) for l, v in metrics["pdwatch_gpu_device_errors"] if v == 1.0)
    assert errors == [("1", "handle", "gpu_is_lost", "decode-0"), ("2", "power", "not_supported", "")]
    assert set(by_gpu(metrics["pdwatch_gpu_utilization_ratio"])) == {"0", "2"}
    assert set(by_gpu(metrics["pdwatch_gpu_power_watts"])) == {"0"}
    assert metrics["pdwatch_gpu_telemetry_up"] == [({}, 1.0)]


def test_a_failing_claims_lookup_leaves_devices_unclaimed(gpus, make_sampler):
    sampler = make_sampler()
    sampler.sample_once()

    def broken():
        raise RuntimeError("tracker gone")

    metrics = scrape(GpuCollector(sampler, broken, {}))
    assert len(metrics["pdwatch_gpu_utilization_ratio"]) == 3
    assert all(labels["pd_instance"] == "" for labels, _ in metrics["pdwatch_gpu_utilization_ratio"])


def test_registering_does_not_read_claims(make_sampler):
    calls = []
    registry = CollectorRegistry(auto_describe=True)
    registry.register(GpuCollector(make_sampler(), lambda: calls.append(1) or [], {}))
    assert calls == []


def test_a_lost_gpu_keeps_the_owner_its_processes_gave_it(gpus, make_sampler):
    gpus.set(1, pids=[8001])
    sampler = make_sampler()
    collector = GpuCollector(sampler, lambda: [InstanceClaim(DECODE0, (), (8001,))], {})
    sampler.sample_once()
    first = scrape(collector)
    assert by_gpu(first["pdwatch_gpu_info"])["1"][0]["joined_by"] == "pid"

    gpus.set(1, error="GPU_IS_LOST")  # a lost GPU lists no processes
    sampler.sample_once()
    after = scrape(collector)
    labels = by_gpu(after["pdwatch_gpu_device_errors"])["1"][0]
    assert (labels["pd_instance"], labels["error"]) == ("decode-0", "gpu_is_lost")
    assert by_gpu(after["pdwatch_gpu_info"])["1"][0]["joined_by"] == "pid_last_known"

    # A healthy device nobody claims any more is unclaimed, not remembered.
    gpus.set(1, error=None, pids=[])
    sampler.sample_once()
    assert by_gpu(scrape(collector)["pdwatch_gpu_info"])["1"][0]["joined_by"] == "none"
