"""Where the stuck ones are blocked: Python stacks of the engine processes, taken with py-spy.

Opt-in (`PDWATCH_CAPTURE=py-spy`). When an instance first has stuck legs in an
incident, or its loop freezes, the judge asks for its ranks' stacks; this
module takes them on a thread of its own (never on the ingest path or the
judge's), with `py-spy dump --nonblocking` so the engine is not paused, each
bounded in time and size, at most once per instance per `every_s`, and only
for PIDs the engines reported from this very host and that exist here. The
latest captures are kept, bounded, with the incident they belong to.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdwatch import contract as c

log = logging.getLogger("pdwatch.sidecar.capture")

MODES = ("off", "py-spy")
MAX_TEXT = 64 * 1024  # bytes of one stack dump kept
DUMP_ATTEMPTS = 3  # py-spy runs per capture at most, all within the capture's timeout
KEEP = 32  # captures kept in all
QUEUE = 16  # capture requests waiting at most; more are dropped, counted


@dataclass(frozen=True, slots=True)
class Capture:
    cluster: str
    pd_instance: str
    rank: int
    pid: int
    at_s: float  # Unix seconds, when taken
    reason: str  # why it was taken: stuck legs, or a frozen loop
    stacks: str  # py-spy's dump, cut at MAX_TEXT
    error: str | None  # why there are no stacks, when there are none
    took_s: float

    def as_dict(self) -> dict[str, Any]:
        return {"cluster": self.cluster, "pd_instance": self.pd_instance, "tp_rank": self.rank, "pid": self.pid,
                "at_unix_s": round(self.at_s, 3), "reason": self.reason, "stacks": self.stacks,
                "error": self.error, "took_s": round(self.took_s, 3)}


def find_py_spy() -> str | None:
    """py-spy on PATH, else beside this Python (a virtual environment's bin/)."""
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


class StackCapture:
    def __init__(self, mode: str = "off", *, every_s: float = 600.0, timeout_s: float = 10.0,
                 hosts: tuple[str, ...] | None = None, tool: str | None = None, clock: Any = time.time):
        if mode not in MODES:
            raise ValueError(f"capture mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.mode = mode
        self.every_s = every_s
        self.timeout_s = timeout_s
        self.hosts = frozenset(hosts if hosts is not None else (socket.gethostname(),))
        self.tool = tool or (find_py_spy() if mode == "py-spy" else None)
        self.clock = clock
        self._queue: queue.Queue[tuple[str, str, str, list[tuple[int, int]]]] = queue.Queue(QUEUE)
        self._last: OrderedDict[tuple[str, str], float] = OrderedDict()  # (cluster, instance) -> asked at
        self._kept: list[Capture] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.counts = {"taken": 0, "failed": 0, "rate_limited": 0, "dropped": 0, "not_local": 0}
        if mode == "py-spy" and self.tool is None:
            log.warning("%s=py-spy but no py-spy found (pip install 'pdwatch[capture]'): no stacks", c.ENV_CAPTURE)

    @property
    def enabled(self) -> bool:
        return self.mode != "off" and self.tool is not None

    def want(self, cluster: str, instance: str, reason: str, ranks: list[tuple[int, int | None, str]]) -> bool:
        """From the judge: capture these ranks ((rank, pid, host)) if allowed now; never blocks."""
        if not self.enabled:
            return False
        now = self.clock()
        key = (cluster, instance)
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            self.counts["rate_limited"] += 1
            return False
        local = [(rank, pid) for rank, pid, host in ranks if pid and host in self.hosts and _exists(pid)]
        if not local:
            self.counts["not_local"] += 1
            return False
        try:
            self._queue.put_nowait((cluster, instance, reason, local))
        except queue.Full:
            self.counts["dropped"] += 1
            return False
        self._last[key] = now
        self._last.move_to_end(key)
        while len(self._last) > 4096:
            self._last.popitem(last=False)
        self._start()
        return True

    def captures(self, cluster: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            kept = list(self._kept)
        return [x.as_dict() for x in kept if cluster is None or x.cluster == cluster]

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pdwatch-capture", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            cluster, instance, reason, ranks = self._queue.get()
            for rank, pid in ranks:
                self._keep(self._dump(cluster, instance, reason, rank, pid))

    def _dump(self, cluster: str, instance: str, reason: str, rank: int, pid: int) -> Capture:
        started = time.monotonic()
        assert self.tool is not None
        text, error = "", None
        # Without pausing the engine (--nonblocking) py-spy can read a stack while the interpreter
        # changes it, and fails ("Failed to get stack traces"; seen on a live SGLang prefill): try again.
        for attempt in range(DUMP_ATTEMPTS):
            left = self.timeout_s - (time.monotonic() - started)
            if attempt and left <= 0:
                break
            try:
                done = subprocess.run([self.tool, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True,
                                      timeout=max(left, 0.1), stdin=subprocess.DEVNULL)
                text = done.stdout.decode("utf-8", "replace")[:MAX_TEXT]
                error = None if done.returncode == 0 else \
                    (done.stderr.decode("utf-8", "replace").strip()[:500] or f"py-spy exited {done.returncode}")
            except subprocess.TimeoutExpired:
                text, error = "", f"py-spy took longer than {self.timeout_s:.0f} s"
                break
            except OSError as exc:
                text, error = "", f"py-spy could not run: {exc}"
                break
            if error is None or not _exists(pid):
                break
            time.sleep(0.2)
        self.counts["failed" if error else "taken"] += 1
        if error:
            log.warning("stack capture of %s rank %d (pid %d) failed: %s", instance, rank, pid, error)
        return Capture(cluster, instance, rank, pid, self.clock(), reason, text, error, time.monotonic() - started)

    def _keep(self, capture: Capture) -> None:
        with self._lock:
            self._kept.append(capture)
            del self._kept[:-KEEP]


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # there, but not ours to signal: py-spy will say whether it may read it
    return True
