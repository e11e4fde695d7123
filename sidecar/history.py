"""The last minutes of every instance, sampled by the judge: what the live page and a report plot.

One sample per instance at most every `every_s` seconds, `keep` samples each
(10 minutes at 1 s by default), for at most `max_instances` instances (the
longest silent is forgotten first). The judge appends on its thread; readers
copy under a lock held only for that copy.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from .evaluation import Evaluation


@dataclass(frozen=True, slots=True)
class Sample:
    t: float  # Unix seconds, sidecar clock
    up: bool
    loop_frozen: bool
    open: dict[str, int]  # stage -> open legs
    stuck: int
    finished_ok: int  # cumulative: a rate is its difference
    gpus: tuple[tuple[str, str, float | None, float | None, float | None], ...]  # gpu, uuid, util, W, limit W


class History:
    def __init__(self, *, every_s: float = 1.0, keep: int = 600, max_instances: int = 256):
        self.every_s = every_s
        self.keep = keep
        self.max_instances = max_instances
        self._lock = threading.Lock()
        self._series: OrderedDict[tuple[str, str], tuple[str, deque[Sample]]] = OrderedDict()
        self._last_t = 0.0

    def record(self, ev: Evaluation) -> None:
        """From the judge, after each tick; keeps one sample per `every_s`."""
        t = ev.at_ns / 1e9
        if t - self._last_t < self.every_s:
            return
        self._last_t = t
        ok: dict[tuple[str, str], int] = {}
        for (cluster, _role, name, outcome), n in ev.counters.finished.items():
            if outcome == "ok":
                ok[(cluster, name)] = ok.get((cluster, name), 0) + n
        stuck: dict[tuple[str, str], int] = {}
        for (cluster, _role, _stage, name), group in ev.groups.items():
            stuck[(cluster, name)] = stuck.get((cluster, name), 0) + group.stuck
        gpus: dict[tuple[str, str], list[tuple[str, str, float | None, float | None, float | None]]] = {}
        for g in ev.gpus:
            if g.owner is not None:
                d = g.device
                gpus.setdefault((g.owner.cluster, g.owner.pd_instance), []).append(
                    (str(d.index), d.uuid, d.utilization, d.power_w, d.power_limit_w))
        with self._lock:
            for inst in ev.instances:
                key = (inst.cluster, inst.name)
                entry = self._series.get(key)
                if entry is None:
                    entry = self._series[key] = (inst.role, deque(maxlen=self.keep))
                    while len(self._series) > self.max_instances:
                        self._series.popitem(last=False)
                self._series.move_to_end(key)
                entry[1].append(Sample(t, inst.up, inst.loop_frozen, dict(inst.open_counts), stuck.get(key, 0),
                                       ok.get(key, 0), tuple(gpus.get(key, ()))))

    def view(self, seconds: float, now_s: float) -> list[dict[str, Any]]:
        """Each instance's samples of the last `seconds`, as columns (JSON for /api/v1/history)."""
        since = now_s - seconds
        with self._lock:
            series = [(key, role, [s for s in samples if s.t >= since]) for key, (role, samples) in self._series.items()]
        out = []
        for (cluster, name), role, samples in series:
            if not samples:
                continue
            stages = sorted({stage for s in samples for stage in s.open})
            gpu_ids = sorted({(g[0], g[1]) for s in samples for g in s.gpus})
            gpu_cols = []
            for gpu, uuid in gpu_ids:
                rows = [next((g for g in s.gpus if g[0] == gpu), None) for s in samples]
                gpu_cols.append({"gpu": gpu, "uuid": uuid,
                                 "utilization": [r[2] if r else None for r in rows],
                                 "power_w": [r[3] if r else None for r in rows],
                                 "power_limit_w": next((r[4] for r in rows if r and r[4]), None)})
            out.append({
                "cluster": cluster, "pd_instance": name, "role": role,
                "t": [round(s.t, 3) for s in samples],
                "up": [s.up for s in samples],
                "loop_frozen": [s.loop_frozen for s in samples],
                "open": {stage: [s.open.get(stage, 0) for s in samples] for stage in stages},
                "stuck": [s.stuck for s in samples],
                "finished_ok": [s.finished_ok for s in samples],
                "gpus": gpu_cols,
            })
        return out
