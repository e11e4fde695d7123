"""Prometheus collector for the GPU sampler's latest pass (contract section 6).

Fresh metric families on every scrape, built from one snapshot and one call
of `claims_fn`; nothing here talks to NVML. With telemetry down only
`pdwatch_gpu_telemetry_up 0` is exposed, so no stale GPU figure survives it.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterator, Sequence

from prometheus_client.core import GaugeMetricFamily, Metric

from .join import InstanceClaim, Owner, join
from .sampler import GpuSampler

log = logging.getLogger("pdwatch.gpu")

# Contract section 6.
GPU_UTILIZATION = "pdwatch_gpu_utilization_ratio"
GPU_POWER = "pdwatch_gpu_power_watts"
GPU_POWER_LIMIT = "pdwatch_gpu_power_limit_watts"
GPU_MEMORY_USED = "pdwatch_gpu_memory_used_bytes"
GPU_TELEMETRY_UP = "pdwatch_gpu_telemetry_up"
# pdwatch's additions.
GPU_DEVICE_ERRORS = "pdwatch_gpu_device_errors"
GPU_INFO = "pdwatch_gpu_info"
GPU_LAST_SAMPLE = "pdwatch_gpu_last_sample_timestamp_seconds"

DEVICE_LABELS = ("gpu", "uuid", "cluster", "role", "pd_instance")


class GpuCollector:
    def __init__(
        self,
        sampler: GpuSampler,
        claims_fn: Callable[[], Sequence[InstanceClaim]],
        configured: dict[str, Owner],
    ) -> None:
        self._sampler = sampler
        self._claims_fn = claims_fn
        self._configured = dict(configured)
        # Owner each device had when last joined, by index: a GPU that fell off
        # the bus lists no processes, so a PID join would lose it exactly when
        # its owner matters most. Bounded by the number of devices.
        self._last_owner: dict[int, tuple[str, Owner, str]] = {}

    def describe(self) -> Iterator[Metric]:
        # Names only, so registering does not call claims_fn or read the sampler.
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        snap = self._sampler.snapshot()
        fams = self._families()
        up, util, power, limit, memory, errors, info, last = fams
        up.add_metric([], 1.0 if snap.up else 0.0)
        if not snap.up:
            yield up
            return
        try:
            claims = list(self._claims_fn())
        except Exception:  # an owner lookup that fails still leaves the GPU figures
            log.exception("GPU collector: claims lookup failed; devices exposed unclaimed")
            claims = []
        for dev, owner, how in self._join(snap.devices, claims):
            labels = [str(dev.index), dev.uuid, *((owner.cluster, owner.role, owner.pd_instance) if owner else ("", "", ""))]
            info.add_metric([*labels, dev.name, how], 1.0)
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
        if snap.sampled_at is not None:
            last.add_metric([], snap.sampled_at)
        yield from fams

    def _join(self, devices, claims):
        out = []
        for dev, owner, how in join(devices, claims, self._configured):
            last = self._last_owner.get(dev.index)
            if owner is not None:
                self._last_owner[dev.index] = (dev.uuid, owner, how)
            elif dev.failures and last is not None and last[0] == dev.uuid:
                owner, how = last[1], last[2] + "_last_known"
            out.append((dev, owner, how))
        for index in self._last_owner.keys() - {d.index for d in devices}:
            del self._last_owner[index]
        return out

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, ...]:
        return (
            GaugeMetricFamily(GPU_TELEMETRY_UP, "1 while NVML answers and GPUs are sampled, else 0 (the reason is in /healthz and the logs).", labels=[]),
            GaugeMetricFamily(GPU_UTILIZATION, "Fraction of the last sample period in which a kernel ran on the GPU (NVML utilization).", labels=DEVICE_LABELS),
            GaugeMetricFamily(GPU_POWER, "GPU power draw in watts.", labels=DEVICE_LABELS),
            GaugeMetricFamily(GPU_POWER_LIMIT, "GPU enforced power limit in watts.", labels=DEVICE_LABELS),
            GaugeMetricFamily(GPU_MEMORY_USED, "GPU memory in use, in bytes.", labels=DEVICE_LABELS),
            GaugeMetricFamily(GPU_DEVICE_ERRORS, "1 for each NVML query that failed on this GPU in the last pass, labelled with the query and NVML's error.", labels=[*DEVICE_LABELS, "query", "error"]),
            GaugeMetricFamily(GPU_INFO, "1 per GPU; names the device and how its owner was found: uuid, pid, config, none, or uuid/pid/config_last_known for a failing device that no longer says.", labels=[*DEVICE_LABELS, "name", "joined_by"]),
            GaugeMetricFamily(GPU_LAST_SAMPLE, "Unix time of the last completed GPU sampling pass.", labels=[]),
        )
