"""Metric names as tests check them: the contract's, from pdwatch.contract, and what a real
sidecar exposes, read from its own registry (nobody keeps a list by hand)."""

from __future__ import annotations

from functools import lru_cache

from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdwatch import contract as c

_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}


def required_series() -> set[str]:
    """Sample names of every metric contract section 6 requires."""
    return {name for metric in c.REQUIRED_METRICS for name in metric.series_names}


@lru_cache(maxsize=1)
def exposed_series() -> frozenset[str]:
    """Sample names a sidecar's registry exposes (GPU families too: built as if telemetry were up)."""
    from pdwatch.sidecar.service import Sidecar
    from pdwatch.sidecar.settings import Settings

    sc = Sidecar(Settings(nvml="off", forward_otlp_endpoint="http://127.0.0.1:9"))
    names = set()
    text = generate_latest(sc.registry).decode()
    for family in text_string_to_metric_families(text):
        names.update(family.name + s for s in _SUFFIXES.get(family.type, ("",)))
    from pdwatch.sidecar.gpu.collector import GpuCollector

    for family in GpuCollector._families():
        names.add(family.name)
    return frozenset(names)
