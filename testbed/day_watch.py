"""A watch over clusters at work: at every tick of the sidecar's judge, what is stuck and what would page.

The ordinary-day test and `bench/ordinary_day.py` read the same record: one `Poll`
per judge tick they saw (about every `interval_s`), with the stuck legs by cluster
(`/api/v1/stuck`), every alert of severity critical Prometheus holds (pending or
firing), the notifications the pager route received so far, each instance's state,
and the alerts Prometheus holds for the sidecars that hear from no engine.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from .monitoring import Json, Monitoring, MonitoringError
from .sidecar_process import SidecarProcess
from .stack_base import StackBase

log = logging.getLogger("pdwatch.testbed.day_watch")

PAGER_PATH = "/pdwatch/page"  # alerts/alertmanager.example.yml's pager receiver
TICK_WAIT_S = 5.0  # the longest a poll waits for the judge's next evaluation


@dataclass
class Poll:
    t: float  # wall clock of the poll
    judged_at: float  # the evaluation it read (the sidecar's at_unix_s)
    stuck: list[Json]  # /api/v1/stuck: every stuck leg, every cluster
    critical: list[Json]  # labels of each ALERTS{severity="critical"} series (alertstate: pending or firing)
    alerts: list[Json]  # labels of every ALERTS series
    pages: list[Json]  # alerts the pager route received so far (firing), each once
    instances: dict[tuple[str, str], Json]  # (pd_cluster, pd_instance) -> its /api/v1/summary entry
    flowing: dict[str, bool]  # pd_cluster -> the sidecar says it flows
    quiet_alerts: list[Json]  # ALERTS of the sidecars that hear from no engine
    open: dict[str, int] = field(default_factory=dict)  # pd_cluster -> requests open at its router
    load: float = 0.0  # the machine's 1-minute load average (a starved CPU explains late heartbeats)

    def stuck_in(self, cluster: str) -> list[Json]:
        return [s for s in self.stuck if s.get("cluster") == cluster]

    def critical_in(self, cluster: str) -> list[Json]:
        return [a for a in self.critical if a.get("pd_cluster") == cluster]

    def pages_in(self, cluster: str) -> list[Json]:
        return [a for a in self.pages if a["labels"].get("pd_cluster") == cluster]

    def alerts_named(self, name: str, cluster: str, severity: str, state: str = "firing") -> list[Json]:
        return [a for a in self.alerts if a.get("alertname") == name and a.get("pd_cluster") == cluster
                and a.get("severity") == severity and a.get("alertstate") == state]


class DayWatch:
    """Polls one sidecar, Prometheus and the webhook on a thread until stopped; `polls` keeps every one."""

    def __init__(self, sidecar: SidecarProcess, monitoring: Monitoring, *, quiet: Sequence[str] = (),
                 stacks: dict[str, StackBase] | None = None, interval_s: float = 0.5):
        self.sidecar = sidecar
        self.monitoring = monitoring
        # Prometheus's instance label of each sidecar no engine reports to (host:port).
        self.quiet = [q.replace("http://", "").rstrip("/") for q in quiet]
        self.stacks = dict(stacks or {})
        self.interval_s = interval_s
        self.polls: list[Poll] = []
        self.errors: list[str] = []  # polls that failed, why (a slow answer under load, not a finding)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._judged_at = 0.0
        self._thread = threading.Thread(target=self._run, name="day-watch", daemon=True)

    def watch(self, cluster: str, stack: StackBase) -> None:
        with self._lock:
            self.stacks[cluster] = stack

    def start(self) -> DayWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(TICK_WAIT_S + 15.0)

    def snapshot(self) -> list[Poll]:
        with self._lock:
            return list(self.polls)

    def latest(self) -> Poll | None:
        with self._lock:
            return self.polls[-1] if self.polls else None

    def wait_for(self, fn: Callable[[Poll], Any], timeout_s: float) -> Poll | None:
        """The first poll from now on for which fn(poll) is truthy (None: none within timeout_s)."""
        seen = len(self.snapshot())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            polls = self.snapshot()
            for poll in polls[seen:]:
                if fn(poll):
                    return poll
            seen = len(polls)
            time.sleep(0.1)
        return None

    # ---- polling -----------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                poll = self._poll()
            except (httpx.HTTPError, MonitoringError, ValueError) as e:
                self.errors.append(f"{time.time():.1f}: {type(e).__name__}: {e}")
                continue
            except Exception as e:  # the watch must outlive a surprise; the caller sees it in errors
                log.exception("poll failed")
                self.errors.append(f"{time.time():.1f}: {type(e).__name__}: {e}")
                continue
            if poll is not None:
                with self._lock:
                    self.polls.append(poll)

    def _next_tick(self) -> Json | None:
        """The sidecar's summary of an evaluation newer than the last poll's (None: none came in time)."""
        deadline = time.monotonic() + TICK_WAIT_S
        while not self._stop.is_set():
            summary: Json = self.sidecar.get("/api/v1/summary")
            if summary["at_unix_s"] > self._judged_at:
                self._judged_at = summary["at_unix_s"]
                return summary
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        return None

    def _poll(self) -> Poll | None:
        summary = self._next_tick()
        if summary is None:
            return None
        stuck: list[Json] = self.sidecar.get("/api/v1/stuck")
        alerts = [r["metric"] for r in self.monitoring.query("ALERTS")]
        quiet = [a for a in alerts if a.get("instance") in self.quiet]
        pages = [alert for _t, path, alert in self.monitoring.webhook.alerts() if path == PAGER_PATH]
        with self._lock:
            stacks = dict(self.stacks)
        return Poll(
            t=time.time(), judged_at=summary["at_unix_s"], stuck=stuck,
            critical=[a for a in alerts if a.get("severity") == "critical"], alerts=alerts, pages=pages,
            instances={(i["cluster"], i["pd_instance"]): i for i in summary["instances"]},
            flowing={name: bool(cl["flowing"]) for name, cl in summary["clusters"].items()},
            quiet_alerts=quiet, open={name: len(stack.truth().open) for name, stack in stacks.items()},
            load=os.getloadavg()[0])
