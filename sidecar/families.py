"""Prometheus metric families made from the contract's metric objects.

Every collector of the sidecar builds its families here, so a family's name,
type, label names and help text are the contract's (`pdwatch.contract`) and
written nowhere else; asking for a gauge of a counter raises.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from pdwatch import contract as c


def _checked(metric: c.Metric, kind: str, value: float | None) -> c.Metric:
    if metric.type != kind:
        raise ValueError(f"{metric.name} is a {metric.type}, not a {kind}")
    if value is not None and metric.labels:
        raise ValueError(f"{metric.name} has labels {metric.labels}: add its samples, not one value")
    return metric


def gauge(metric: c.Metric, value: float | None = None) -> GaugeMetricFamily:
    """The metric's family with its labels, or, for an unlabelled one, with its one `value`."""
    m = _checked(metric, "gauge", value)
    if value is not None:
        return GaugeMetricFamily(m.name, m.help, value=value)
    return GaugeMetricFamily(m.name, m.help, labels=list(m.labels))


def counter(metric: c.Metric, value: float | None = None) -> CounterMetricFamily:
    """As `gauge`, for a counter (exposed as <name>_total)."""
    m = _checked(metric, "counter", value)
    if value is not None:
        return CounterMetricFamily(m.name, m.help, value=value)
    return CounterMetricFamily(m.name, m.help, labels=list(m.labels))


def histogram(metric: c.Metric) -> HistogramMetricFamily:
    m = _checked(metric, "histogram", None)
    return HistogramMetricFamily(m.name, m.help, labels=list(m.labels))
