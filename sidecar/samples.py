"""Recent stage durations per (cluster, role, stage): the facts the stuck thresholds are computed from.

Written by the tracker on ingest; the judge's `Thresholds` reads them. Each
window keeps at most `max_samples` durations and, as the writer sees time,
none older than `window_s` (retention, so an idle key does not hold its last
thousand samples for good); the judge still ignores any the writer has not
pruned yet.
"""

from __future__ import annotations

from collections import deque
from itertools import repeat

from pdwatch import contract as c

StageKey = tuple[str, str, str]  # (cluster, role, stage)


class StageSamples:
    def __init__(self, *, window_s: float = c.THRESHOLD_WINDOW_S, max_samples: int = c.THRESHOLD_SAMPLES,
                 max_keys: int = 4096):
        self.window_ns = int(window_s * 1e9)
        self.max_samples = max_samples
        self.max_keys = max_keys
        # key -> deque of (observed_at_ns, seconds), oldest first
        self._samples: dict[StageKey, deque[tuple[int, float]]] = {}
        # key -> samples ever added: tells a reader's cache that the window changed
        self.added: dict[StageKey, int] = {}
        self.keys_refused = 0

    def observe_many(self, key: StageKey, seconds: list[float], now_ns: int) -> None:
        """Durations observed at one moment (one OTLP batch); each must be finite and >= 0."""
        window = self._samples.get(key)
        if window is None:
            if len(self._samples) >= self.max_keys:
                self.keys_refused += 1
                return
            window = self._samples[key] = deque(maxlen=self.max_samples)
        cutoff = now_ns - self.window_ns
        while window and window[0][0] < cutoff:
            window.popleft()
        window.extend(zip(repeat(now_ns), seconds))
        self.added[key] = self.added.get(key, 0) + len(seconds)

    def window(self, key: StageKey) -> deque[tuple[int, float]] | None:
        return self._samples.get(key)

    def keys(self) -> list[StageKey]:
        return list(self._samples)
