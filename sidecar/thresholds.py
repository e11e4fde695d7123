"""Per-stage stuck thresholds that adapt to what the cluster normally does.

threshold(cluster, role, stage) = max(floor(stage), P99_FACTOR x p99 of that
stage's durations in the cluster over the last THRESHOLD_WINDOW_S or
THRESHOLD_SAMPLES samples, whichever is fewer) -- contract section 5, whose
module fixes the three (3, 10 minutes, 1,000). The floor keeps a quiet cluster
from paging on noise; the p99 term keeps a slow-but-healthy cluster from paging
at all.
"""

from __future__ import annotations

import math
from collections import deque
from itertools import repeat

from pdwatch import contract as c

StageKey = tuple[str, str, str]  # (cluster, role, stage)


class StageThresholds:
    def __init__(self, floors: dict[str, float], *, window_s: float = c.THRESHOLD_WINDOW_S,
                 max_samples: int = c.THRESHOLD_SAMPLES,
                 max_keys: int = 4096):
        self.floors = dict(floors)
        self.window_ns = int(window_s * 1e9)
        self.max_samples = max_samples
        self.max_keys = max_keys
        # (cluster, role, stage) -> deque of (observed_at_ns, seconds)
        self._samples: dict[StageKey, deque[tuple[int, float]]] = {}
        self._p99_cache: dict[StageKey, float | None] = {}
        self.keys_refused = 0

    def observe_many(self, key: StageKey, seconds: list[float], now_ns: int) -> None:
        """Durations observed at one moment (one OTLP batch); each must be finite and >= 0."""
        window = self._samples.get(key)
        if window is None:
            if len(self._samples) >= self.max_keys:
                self.keys_refused += 1
                return
            window = self._samples[key] = deque(maxlen=self.max_samples)
        window.extend(zip(repeat(now_ns), seconds))
        self._p99_cache.pop(key, None)

    def p99(self, key: StageKey, now_ns: int) -> float | None:
        window = self._samples.get(key)
        if not window:
            return None
        cutoff = now_ns - self.window_ns
        if window[0][0] < cutoff:
            while window and window[0][0] < cutoff:
                window.popleft()
            self._p99_cache.pop(key, None)
            if not window:
                return None
        cached = self._p99_cache.get(key)
        if cached is not None:
            return cached
        values = sorted(v for _, v in window)
        # Nearest-rank p99: the smallest value with at least 99 % of samples at or below it.
        value = values[max(0, math.ceil(0.99 * len(values)) - 1)]
        self._p99_cache[key] = value
        return value

    def threshold(self, key: StageKey, now_ns: int) -> float:
        floor = self.floors[key[2]]
        p99 = self.p99(key, now_ns)
        return floor if p99 is None else max(floor, c.P99_FACTOR * p99)

    def keys(self) -> list[StageKey]:
        return list(self._samples)
