"""What the classifier reasons over, independent of where it was gathered."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Findings at or above this confidence are "suspected": the diagnosis names them and
# pdwatch_suspected_failure is 1 for them (here, so readers need not import the classifier).
REPORT_AT = 0.5


@dataclass
class GpuFacts:
    gpu: str  # NVML index
    uuid: str
    utilization: float | None  # 0..1
    power_w: float | None
    power_limit_w: float | None


@dataclass
class InstanceFacts:
    pd_instance: str
    role: str
    up: bool
    heartbeat_age_s: float | None
    loop_stalled: bool
    start_time_s: float | None  # Unix seconds, current process
    restarts: int  # new processes seen under this name
    last_restart_age_s: float | None  # seconds since the latest restart was seen, None if never
    finished_ok_recent: int  # legs this instance finished ok within the flow window
    open_legs: int
    stuck: dict[str, int] = field(default_factory=dict)  # stage -> stuck legs
    gpus: list[GpuFacts] = field(default_factory=list)
    # Contract section 5b: the loop rule holds, and legs stuck on evidence by reason.
    loop_frozen: bool = False
    evidence: dict[str, int] = field(default_factory=dict)  # reason -> stuck legs
    kv_used: float | None = None  # share (0..1) of its KV pool in use, when its engine says
    departed: bool = False  # it left in order (a final heartbeat): not silent, raises nothing


@dataclass
class ClusterFacts:
    cluster: str
    flow_window_s: float
    finished_ok_recent: int  # legs finished ok anywhere in the cluster within the window
    open_legs: int
    stuck: dict[tuple[str, str], int] = field(default_factory=dict)  # (role, stage) -> stuck legs
    oldest_stuck_age_s: dict[tuple[str, str], float] = field(default_factory=dict)  # (role, stage) -> seconds
    thresholds_s: dict[tuple[str, str], float] = field(default_factory=dict)  # (role, stage) -> seconds
    instances: list[InstanceFacts] = field(default_factory=list)
    gpu_telemetry_up: bool = False
    evidence: dict[tuple[str, str, str], int] = field(default_factory=dict)  # (role, stage, reason) -> legs stuck on that evidence

    @property
    def flowing(self) -> bool:
        return self.finished_ok_recent > 0

    @property
    def silent(self) -> list[InstanceFacts]:
        """Instances that stopped sending heartbeats without leaving in order (down)."""
        return [i for i in self.instances if not i.up and not i.departed]

    def stuck_in(self, *stages: str, role: str | None = None) -> int:
        return sum(n for (r, s), n in self.stuck.items() if s in stages and (role is None or r == role))

    def on_evidence(self, reason: str, *stages: str) -> int:
        """Legs stuck on this evidence (in these stages, if any are named)."""
        return sum(n for (_r, s, why), n in self.evidence.items() if why == reason and (not stages or s in stages))

    @property
    def frozen(self) -> list[InstanceFacts]:
        """Instances whose loop is frozen while they heartbeat (contract section 5b)."""
        return [i for i in self.instances if i.up and i.loop_frozen]


@dataclass
class Finding:
    family: str
    confidence: float  # 0..1
    evidence: list[str]  # sentences, each with the figures behind it
    action: str

    def as_dict(self) -> dict[str, Any]:
        return {"family": self.family, "confidence": round(self.confidence, 2), "evidence": self.evidence,
                "action": self.action}
