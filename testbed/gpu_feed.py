"""Keeps each engine's emulated GPU in step with what the engine really does.

Every `interval_s` it reads each engine process's status file
(`pdwatch.testbed.engine_status`) and shows the result on that engine's device:
mostly waiting in a collective -> `spin()` (~100 %, moderate power); otherwise
`busy(work share)`, so a decode with a running batch reads hot and one with
nothing to do reads ~0 % at idle power. A process that stopped reporting
(SIGSTOP, crashed, killed) reads idle. The device lists the process's PID
while it lives, as NVML's compute processes do.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .engine_status import read_status
from .gpu_emulation import GpuEmulator

log = logging.getLogger("pdwatch.testbed.gpu_feed")

SPIN_SHARE = 0.5  # more of the interval than this inside a collective: the GPU spins
RESIDENT_SHARE = 0.8  # weights + KV pool of a live engine, of the device's memory


@dataclass
class Feed:
    device: int
    status_path: Path
    pid: Callable[[], int | None]  # the engine's current PID, None when not running


class GpuFeed:
    def __init__(self, gpus: GpuEmulator, interval_s: float = 0.5):
        self.gpus = gpus
        self.interval_s = interval_s
        self.feeds: list[Feed] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-feed", daemon=True)

    def add(self, feed: Feed) -> None:
        self.feeds.append(feed)

    def start(self) -> GpuFeed:
        self.tick()
        self._thread.start()
        return self

    def tick(self) -> None:
        with self.gpus.batch():
            for feed in self.feeds:
                pid = feed.pid()
                status = read_status(feed.status_path) if pid else None
                if status is not None and status.get("pid") != pid:
                    status = None  # left by a process that has since been replaced
                total = self.gpus.memory_total(feed.device)
                self.gpus.set(feed.device, pids=[pid] if pid else [],
                              memory_used=int(RESIDENT_SHARE * total) if pid else 0)
                if status is None:
                    self.gpus.idle(feed.device)
                elif float(status.get("spin", 0.0)) >= SPIN_SHARE:
                    self.gpus.spin(feed.device)
                else:
                    self.gpus.busy(feed.device, min(1.0, max(0.0, float(status.get("work", 0.0)))))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception:
                log.exception("GPU feed tick failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)
        for feed in self.feeds:
            try:
                self.gpus.set(feed.device, pids=[], memory_used=0)
                self.gpus.idle(feed.device)
            except Exception:
                log.debug("could not idle GPU %d", feed.device, exc_info=True)
