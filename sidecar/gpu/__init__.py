"""GPU telemetry: an NVML sampler on its own thread, the join of each device to
the PD instance that owns it, and a Prometheus collector over both."""

from .collector import GpuCollector
from .join import InstanceClaim, Owner, join, parse_gpu_map
from .sampler import DeviceSample, GpuSampler, GpuSnapshot

__all__ = [
    "DeviceSample",
    "GpuCollector",
    "GpuSampler",
    "GpuSnapshot",
    "InstanceClaim",
    "Owner",
    "join",
    "parse_gpu_map",
]
