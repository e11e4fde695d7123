"""Prometheus collector for the GPUs of the latest evaluation (contract section 6).

Fresh metric families on every scrape, built from the judge's evaluation,
which joined the sampler's latest pass to the instances once; nothing here
talks to NVML. With telemetry down only the telemetry-up gauge, at 0, is
exposed, so no stale GPU figure survives it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from pdwatch import contract as c

from ..evaluation import Evaluation
from ..families import gauge


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
        return tuple(gauge(m) for m in (c.GPU_TELEMETRY_UP, c.GPU_UTILIZATION, c.GPU_POWER, c.GPU_POWER_LIMIT,
                                        c.GPU_MEMORY_USED, c.GPU_DEVICE_ERRORS, c.GPU_INFO, c.GPU_LAST_SAMPLE))
