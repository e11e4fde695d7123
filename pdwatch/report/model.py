"""The incident a report shows, whatever it was read from: series per instance, alerts, the diagnosis."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class ReportError(RuntimeError):
    pass


@dataclass
class Series:
    t: list[float]
    v: list[float | None]

    def at(self, when: float) -> float | None:
        """The latest value at or before `when`."""
        best = None
        for t, v in zip(self.t, self.v):
            if t > when + 1e-6:
                break
            best = v
        return best


EMPTY = Series([], [])


def sum_series(series: list[Series]) -> Series:
    """Sample by sample (aligned to the millisecond), a missing value counting 0."""
    total: dict[float, float] = {}
    for s in series:
        for t, v in zip(s.t, s.v):
            key = round(t, 3)
            total[key] = total.get(key, 0.0) + (v or 0.0)
    keys = sorted(total)
    return Series(keys, [total[k] for k in keys])


@dataclass
class Gpu:
    gpu: str
    uuid: str
    utilization: Series  # 0..1
    power_w: Series
    power_limit_w: float | None


@dataclass
class Instance:
    cluster: str
    pd_instance: str
    role: str
    open: dict[str, Series] = field(default_factory=dict)  # stage -> open legs
    stuck: dict[str, Series] = field(default_factory=dict)  # stage -> stuck legs ("" = all stages)
    ok_rate: Series | None = None  # legs finished ok per second
    up: Series | None = None  # 1 / 0
    frozen: Series | None = None  # 1 when the loop is frozen
    gpus: list[Gpu] = field(default_factory=list)
    restarts: list[float] = field(default_factory=list)  # Unix s

    def sort_key(self) -> tuple[str, int, str]:
        return (self.cluster, {"prefill": 0, "decode": 1, "unified": 2}.get(self.role, 9), self.pd_instance)


@dataclass
class Alert:
    name: str
    labels: dict[str, str]
    firing: list[tuple[float, float]]  # [start, end] intervals


@dataclass
class Diagnosis:
    """What the classifier said about one cluster at one moment: its verdict (contract section 7), not retold.

    `evidence` and `action` are the leading finding's, `findings` every finding behind the verdict with its
    own sentences; `published` the families the sidecars themselves published then (from Prometheus)."""

    cluster: str
    at_unix_s: float
    said_by: str
    family: str | None
    confidence: float
    evidence: list[str]
    action: str | None
    findings: list[dict[str, Any]] = field(default_factory=list)
    published: list[tuple[str, float]] | None = None

    @classmethod
    def from_verdict(cls, verdict: dict[str, Any], at_unix_s: float, said_by: str,
                     published: list[tuple[str, float]] | None = None) -> Diagnosis:
        return cls(verdict["cluster"], at_unix_s, said_by, verdict.get("family"),
                   float(verdict.get("confidence") or 0.0), list(verdict.get("evidence") or []),
                   verdict.get("action"), list(verdict.get("findings") or []), published)

    def others(self) -> list[dict[str, Any]]:
        """The findings behind the verdict besides the leading one."""
        return [f for f in self.findings if f.get("family") != self.family]


@dataclass
class Incident:
    source: str
    start: float
    end: float
    instances: list[Instance] = field(default_factory=list)
    alerts: list[Alert] | None = None  # None: the source knows no alert state
    stuck_by_stage_known: bool = True
    diagnosis: list[Diagnosis] = field(default_factory=list)  # per cluster
    oldest: list[dict[str, Any]] = field(default_factory=list)  # oldest stuck legs
    notes: list[str] = field(default_factory=list)
    worst_at: float | None = None
    worst_stuck: int = 0

    def stuck_total(self) -> Series:
        return sum_series([s for i in self.instances for s in i.stuck.values()])

    def clusters(self) -> list[str]:
        return sorted({i.cluster for i in self.instances})

    def mark_worst(self) -> None:
        """The worst moment: the latest one at the peak of stuck legs."""
        best = None
        total = self.stuck_total()
        for t, v in zip(total.t, total.v):
            if v and (best is None or v >= best[1]):
                best = (t, v)
        if best is not None:
            self.worst_at, self.worst_stuck = best[0], int(round(best[1]))
