"""Ingest back-pressure: how many requests are in flight and how much memory
the sidecar holds, and the refusals both cause (429 busy, 503 memory).

Exporters retry a 429 or 503 after `Retry-After`, so refusing costs the
engines nothing but delay, while accepting past these limits could cost the
node its sidecar.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import Metric

from pdwatch import contract as c

from .families import counter, gauge

# Requests being read or applied at once; more are told to come back (429).
MAX_IN_FLIGHT = 32
# Reading /proc costs a syscall and a parse: at most this often.
RSS_EVERY_S = 0.25
RETRY_AFTER_S = "1"


def read_rss_bytes(status_path: str = "/proc/self/status") -> int | None:
    """VmRSS of a process, in bytes; None where /proc is not there."""
    try:
        with open(status_path, "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class IngestGuard:
    def __init__(self, max_rss_bytes: int, *, max_in_flight: int = MAX_IN_FLIGHT,
                 status_path: str = f"/proc/{os.getpid()}/status",
                 monotonic: Callable[[], float] = time.monotonic):
        self.max_rss = max_rss_bytes
        self.max_in_flight = max_in_flight
        self.status_path = status_path
        self.monotonic = monotonic
        self.in_flight = 0
        self.refused = {"busy": 0, "memory": 0}
        self.errors = 0  # requests whose spans raised something other than a rejection: a pdwatch bug
        self.rss: int | None = None
        self._rss_at = -1e18

    def current_rss(self) -> int | None:
        now = self.monotonic()
        if now - self._rss_at >= RSS_EVERY_S:
            self.rss, self._rss_at = read_rss_bytes(self.status_path), now
        return self.rss

    def refusal(self) -> tuple[int, str] | None:
        """(status, reason) when this request must be refused now, else None."""
        if self.in_flight >= self.max_in_flight:
            self.refused["busy"] += 1
            return 429, "too many requests in flight, retry later"
        if self.max_rss:
            rss = self.current_rss()
            if rss is not None and rss > self.max_rss:
                self.refused["memory"] += 1
                return 503, f"sidecar memory {rss} bytes is over its limit of {self.max_rss}, retry later"
        return None


class GuardCollector:
    def __init__(self, guard: IngestGuard):
        self.guard = guard

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        g = self.guard
        refused = counter(c.INGEST_REFUSED)
        for reason, n in g.refused.items():
            refused.add_metric([reason], n)
        yield refused
        yield counter(c.INGEST_ERRORS, g.errors)
        rss = read_rss_bytes(g.status_path)
        if rss is not None:
            yield gauge(c.RESIDENT_MEMORY, rss)
        yield gauge(c.MEMORY_LIMIT, g.max_rss)
