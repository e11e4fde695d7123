"""Facts from one sidecar's latest evaluation (one node's view)."""

from __future__ import annotations

from collections.abc import Callable

from pdwatch import contract as c

from ..evaluation import Evaluation
from .facts import ClusterFacts, GpuFacts, InstanceFacts


def gather(ev: Evaluation) -> list[ClusterFacts]:
    clusters: dict[str, ClusterFacts] = {
        name: ClusterFacts(name, ev.flow_window_s, 0, 0, gpu_telemetry_up=ev.gpu_up) for name in ev.clusters()
    }
    gpus_of: dict[tuple[str, str], list[GpuFacts]] = {}
    for g in ev.gpus:
        if g.owner is not None:
            d = g.device
            gpus_of.setdefault((g.owner.cluster, g.owner.pd_instance), []).append(
                GpuFacts(str(d.index), d.uuid, d.utilization, d.power_w, d.power_limit_w))
    per_instance: dict[tuple[str, str], tuple[dict[str, int], dict[str, int]]] = {}  # stuck, evidence
    for (cluster, role, stage, name), group in ev.groups.items():
        if not group.stuck:
            continue
        cf = clusters.setdefault(cluster, ClusterFacts(cluster, ev.flow_window_s, 0, 0, gpu_telemetry_up=ev.gpu_up))
        cf.stuck[(role, stage)] = cf.stuck.get((role, stage), 0) + group.stuck
        stuck, evidence = per_instance.setdefault((cluster, name), ({}, {}))
        stuck[stage] = stuck.get(stage, 0) + group.stuck
        for reason, n in group.evidence.items():
            evidence[reason] = evidence.get(reason, 0) + n
            cf.evidence[(role, stage, reason)] = cf.evidence.get((role, stage, reason), 0) + n
    for s in ev.stuck:
        key = (s.role, s.stage)
        cf = clusters[s.cluster]
        cf.oldest_stuck_age_s[key] = max(cf.oldest_stuck_age_s.get(key, 0.0), s.age_s)
    for (cluster, role, stage), seconds in ev.thresholds.items():
        if cluster in clusters:
            clusters[cluster].thresholds_s[(role, stage)] = seconds
    restart_age: Callable[[tuple[int, ...]], float | None] = lambda times: (ev.at_ns - times[-1]) / 1e9 if times else None  # noqa: E731
    for inst in ev.instances:
        cf = clusters[inst.cluster]
        stuck, evidence = per_instance.get((inst.cluster, inst.name), ({}, {}))
        cf.instances.append(InstanceFacts(
            pd_instance=inst.name,
            role=inst.role,
            up=inst.up,
            heartbeat_age_s=inst.heartbeat_age_s,
            loop_stalled=inst.loop_stalled,
            start_time_s=inst.start_ns / 1e9 if inst.start_ns else None,
            restarts=inst.restarts,
            last_restart_age_s=restart_age(inst.restart_times_ns),
            finished_ok_recent=inst.finished_ok_recent,
            open_legs=inst.open_total,
            stuck=dict(stuck),
            gpus=gpus_of.get((inst.cluster, inst.name), []),
            loop_frozen=inst.loop_frozen,
            evidence=dict(evidence),
            kv_used=inst.kv_used,
            departed=inst.state == c.STATE_DEPARTED,
        ))
        cf.finished_ok_recent += inst.finished_ok_recent
        cf.open_legs += inst.open_total
    return list(clusters.values())
