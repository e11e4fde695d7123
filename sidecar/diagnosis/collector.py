"""The suspected failure families, 1 for each the judge's diagnosis suspects, and its confidence in each."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import Metric

from pdwatch import contract as c

from ..evaluation import Evaluation
from ..families import gauge
from .facts import REPORT_AT


class DiagnosisCollector:
    def __init__(self, latest: Callable[[], Evaluation]):
        self._latest = latest

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        ev = self._latest()
        family, confidence = gauge(c.SUSPECTED_FAILURE), gauge(c.DIAGNOSIS_CONFIDENCE)
        for cluster, found in sorted(ev.confidences.items()):
            for name in c.FAMILIES:  # every family, so a cleared suspicion reads 0 rather than vanishing
                value = found.get(name, 0.0)
                family.add_metric([cluster, name], 1 if value >= REPORT_AT else 0)
                confidence.add_metric([cluster, name], value)
        yield family
        yield confidence
