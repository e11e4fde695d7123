"""Per-stage stuck thresholds that adapt to what the cluster normally does: the judge's rule.

threshold(cluster, role, stage) = max(floor(stage), P99_FACTOR x p99 of that
stage's durations in the cluster over the last THRESHOLD_WINDOW_S or
THRESHOLD_SAMPLES samples, whichever is fewer) -- contract section 5, whose
module fixes the three (3, 10 minutes, 1,000). The floor keeps a quiet cluster
from paging on noise; the p99 term keeps a slow-but-healthy cluster from paging
at all. The durations are the tracker's facts (`samples.StageSamples`); this
reads them and never changes them, caching each p99 until its window changes.
"""

from __future__ import annotations

import math

from pdwatch import contract as c

from .samples import StageKey, StageSamples


class Thresholds:
    def __init__(self, samples: StageSamples, floors: dict[str, float]):
        self.samples = samples
        self.floors = dict(floors)
        # key -> (samples added, samples too old, p99) when it was computed
        self._cache: dict[StageKey, tuple[int, int, float]] = {}

    def p99(self, key: StageKey, now_ns: int) -> float | None:
        window = self.samples.window(key)
        if not window:
            self._cache.pop(key, None)
            return None
        cutoff = now_ns - self.samples.window_ns
        old = 0
        for at, _ in window:  # the writer prunes as it writes: only the few since its last batch are old
            if at >= cutoff:
                break
            old += 1
        if old == len(window):
            return None
        added = self.samples.added.get(key, 0)
        cached = self._cache.get(key)
        if cached is not None and cached[0] == added and cached[1] == old:
            return cached[2]
        values = sorted(v for i, (_, v) in enumerate(window) if i >= old)
        # Nearest-rank p99: the smallest value with at least 99 % of samples at or below it.
        value = values[max(0, math.ceil(0.99 * len(values)) - 1)]
        self._cache[key] = (added, old, value)
        return value

    def threshold(self, key: StageKey, now_ns: int) -> float:
        floor = self.floors[key[2]]
        p99 = self.p99(key, now_ns)
        return floor if p99 is None else max(floor, c.P99_FACTOR * p99)

    def forget(self, keep: set[StageKey]) -> None:
        """Drop cached values of keys the samples no longer hold."""
        for key in [k for k in self._cache if k not in keep]:
            del self._cache[key]
