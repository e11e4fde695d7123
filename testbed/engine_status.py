"""How busy an engine's emulated GPU is, told to the parent through a tiny file.

The engine adds up the seconds its GPU would be working (`work`: a forward
pass, a decode step with a running batch) and the seconds it waits inside a
collective for a peer (`spin`); a thread rewrites a one-line JSON file every
`interval_s` with the shares of the last interval. The parent
(`pdwatch.testbed.gpu_feed`) reads it; a file that stops changing means the process
is frozen or dead, which is an idle GPU. Nothing here can raise into the
engine's loop: a failed write is skipped.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import TypedDict, cast


class Status(TypedDict, total=False):
    """The file's one JSON object (a reader takes what it finds: a missing key reads as 0)."""

    work: float  # share of the last interval the GPU computed
    spin: float  # share of it spent waiting in a collective
    pid: int
    t: float  # wall clock of the write


STALE_AFTER_S = 1.5  # a status older than this: the process stopped reporting


class StatusWriter:
    def __init__(self, path: str | os.PathLike[str] | None, interval_s: float = 0.25):
        self.path = Path(path) if path else None
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._work = 0.0
        self._spin = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-status", daemon=True)

    def start(self) -> StatusWriter:
        if self.path is not None:
            self._thread.start()
        return self

    def work(self, seconds: float) -> None:
        if seconds > 0:
            with self._lock:
                self._work += seconds

    def spin(self, seconds: float) -> None:
        if seconds > 0:
            with self._lock:
                self._spin += seconds

    def _take(self) -> tuple[float, float]:
        with self._lock:
            work, spin, self._work, self._spin = self._work, self._spin, 0.0, 0.0
        return work, spin

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            span, last = max(now - last, 1e-6), now
            work, spin = self._take()
            self._write({"work": min(1.0, work / span), "spin": min(1.0, spin / span), "pid": os.getpid(),
                         "t": time.time()})

    def _write(self, status: Status) -> None:
        if self.path is None:  # the thread runs only with a path
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(status))
            os.replace(tmp, self.path)  # the reader sees a whole file or the previous one
        except OSError:
            pass

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(1.0)


def read_status(path: str | os.PathLike[str], now: float | None = None) -> Status | None:
    """The engine's last status, or None when it is missing, unreadable or stale."""
    now = time.time() if now is None else now
    try:
        status = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(status, dict) or now - float(status.get("t", 0)) > STALE_AFTER_S:
        return None
    return cast(Status, status)
