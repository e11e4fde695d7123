"""pdwatch_suspected_failure{cluster, family}: 1 for each family the judge's diagnosis suspects."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from pdwatch import contract as c

from ..evaluation import Evaluation
from .facts import REPORT_AT


class DiagnosisCollector:
    def __init__(self, latest: Callable[[], Evaluation]):
        self._latest = latest

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        ev = self._latest()
        family = GaugeMetricFamily(c.SUSPECTED_FAILURE.name,
                                   "1 when the diagnosis suspects this failure family in the cluster.",
                                   labels=list(c.SUSPECTED_FAILURE.labels))
        confidence = GaugeMetricFamily("pdwatch_diagnosis_confidence",
                                       "Confidence (0..1) of each failure family the diagnosis considered.",
                                       labels=[c.L_CLUSTER, c.L_FAMILY])
        for cluster, found in sorted(ev.confidences.items()):
            for name in c.FAMILIES:  # every family, so a cleared suspicion reads 0 rather than vanishing
                value = found.get(name, 0.0)
                family.add_metric([cluster, name], 1 if value >= REPORT_AT else 0)
                confidence.add_metric([cluster, name], value)
        yield family
        yield confidence
