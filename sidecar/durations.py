"""The buckets of pdwatch_stage_duration_seconds: facts the tracker writes on ingest.

The tracker owns one `StageDurations` and adds each batch's finished stages to
it; the judge copies it into every `Evaluation` (`snapshot`), and the metrics
collector reads only that copy.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from typing import Any

from .evaluation import Histogram

# Seconds; from sub-millisecond KV transfers to multi-minute generations.
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 30, 60, 120, 300, 600)


class StageDurations:
    """The buckets of pdwatch_stage_duration_seconds, with a trace_id exemplar per bucket.

    Written by the tracker's thread on ingest and copied by the judge on the
    same thread, so it needs no lock. Kept as plain bucket counts rather than
    a client `Histogram`: that one validates the exemplar's labels on every
    observation, which cost more than the rest of ingest together.
    """

    def __init__(self, max_label_sets: int = 4096, clock: Callable[[], float] = time.time):
        self.bounds = DURATION_BUCKETS
        self._series: dict[tuple[str, str, str], list[Any]] = {}  # key -> [counts, exemplars, sum]
        self.max_label_sets = max_label_sets
        self.refused = 0
        self.clock = clock

    def observe_many(self, cluster: str, role: str, stage: str, seconds: list[float], trace_ids: list[str]) -> None:
        """One batch's durations of one stage; each bucket keeps the batch's last trace id as its exemplar."""
        key = (cluster, role, stage)
        series = self._series.get(key)
        if series is None:
            if len(self._series) >= self.max_label_sets:
                self.refused += 1
                return
            n = len(self.bounds) + 1  # the last slot is +Inf
            series = self._series[key] = [[0] * n, [None] * n, 0.0]
        counts, exemplars, bounds, at = series[0], series[1], self.bounds, self.clock()
        for value, trace_id in zip(seconds, trace_ids):
            i = bisect.bisect_left(bounds, value)
            counts[i] += 1
            exemplars[i] = (trace_id, value, at)
        series[2] += sum(seconds)

    def snapshot(self) -> Histogram:
        return Histogram(self.bounds, {k: (tuple(v[0]), tuple(v[1]), v[2]) for k, v in self._series.items()})
