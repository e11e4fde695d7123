"""Prometheus collector for the GPUs of the latest evaluation (contract section 6).

Fresh metric families on every scrape, built from the judge's evaluation,
which joined the sampler's latest pass to the instances once; nothing here
talks to NVML. With telemetry down only `pdwatch_gpu_telemetry_up 0` is
exposed, so no stale GPU figure survives it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from pdwatch import contract as c

from ..evaluation import Evaluation

# pdwatch's additions.
GPU_DEVICE_ERRORS = "pdwatch_gpu_device_errors"
GPU_INFO = "pdwatch_gpu_info"
GPU_LAST_SAMPLE = "pdwatch_gpu_last_sample_timestamp_seconds"


class GpuCollector:
    def __init__(self, latest: Callable[[], Evaluation]) -> None:
        self._latest = latest

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        ev = self._latest()
        fams = self._families()
        up, util, power, limit, memory, errors, info, last = fams
        up.add_metric([], 1.0 if ev.gpu_up else 0.0)
        if not ev.gpu_up:
            yield up
            return
        for g in ev.gpus:
            dev, owner = g.device, g.owner
            labels = [str(dev.index), dev.uuid, *((owner.cluster, owner.role, owner.pd_instance) if owner else ("", "", ""))]
            info.add_metric([*labels, dev.name, g.joined_by], 1.0)
            for fam, value in (
                (util, dev.utilization),
                (power, dev.power_w),
                (limit, dev.power_limit_w),
                (memory, dev.memory_used_bytes),
            ):
                if value is not None:
                    fam.add_metric(labels, float(value))
            for query, code in dev.failures:
                errors.add_metric([*labels, query, code], 1.0)
        if ev.gpu_sampled_at is not None:
            last.add_metric([], ev.gpu_sampled_at)
        yield from fams

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, ...]:
        labels = list(c.GPU_KEY)
        return (
            GaugeMetricFamily(c.GPU_TELEMETRY_UP.name, "1 while NVML answers and GPUs are sampled, else 0 (the reason is in /healthz and the logs).", labels=[]),
            GaugeMetricFamily(c.GPU_UTILIZATION.name, "Fraction of the last sample period in which a kernel ran on the GPU (NVML utilization).", labels=labels),
            GaugeMetricFamily(c.GPU_POWER.name, "GPU power draw in watts.", labels=labels),
            GaugeMetricFamily(c.GPU_POWER_LIMIT.name, "GPU enforced power limit in watts.", labels=labels),
            GaugeMetricFamily(c.GPU_MEMORY_USED.name, "GPU memory in use, in bytes.", labels=labels),
            GaugeMetricFamily(GPU_DEVICE_ERRORS, "1 for each NVML query that failed on this GPU in the last pass, labelled with the query and NVML's error.", labels=[*labels, "query", "error"]),
            GaugeMetricFamily(GPU_INFO, "1 per GPU; names the device and how its owner was found: uuid, pid, config, none, or uuid/pid/config_last_known for a failing device that no longer says.", labels=[*labels, "name", "joined_by"]),
            GaugeMetricFamily(GPU_LAST_SAMPLE, "Unix time of the last completed GPU sampling pass.", labels=[]),
        )
