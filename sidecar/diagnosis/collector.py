"""pdwatch_suspected_failure{cluster, family}: 1 for each family the diagnosis suspects."""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily

from .classify import ACTIONS, REPORT_AT, classify
from .from_tracker import gather


class DiagnosisCollector:
    def __init__(self, sidecar):
        self.sidecar = sidecar

    def describe(self):
        return []

    def collect(self):
        family = GaugeMetricFamily("pdwatch_suspected_failure",
                                   "1 when the diagnosis suspects this failure family in the cluster.",
                                   labels=["cluster", "family"])
        confidence = GaugeMetricFamily("pdwatch_diagnosis_confidence",
                                       "Confidence (0..1) of each failure family the diagnosis considered.",
                                       labels=["cluster", "family"])
        for facts in gather(self.sidecar):
            found = {f.family: f.confidence for f in classify(facts)}
            for name in ACTIONS:  # every family, so a cleared suspicion reads 0 rather than vanishing
                value = found.get(name, 0.0)
                family.add_metric([facts.cluster, name], 1 if value >= REPORT_AT else 0)
                confidence.add_metric([facts.cluster, name], round(value, 2))
        return [family, confidence]
