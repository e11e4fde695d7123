"""Facts from this sidecar's own tracker and GPU sampler (one node's view)."""

from __future__ import annotations

from ..gpu.join import join
from .facts import ClusterFacts, GpuFacts, InstanceFacts


def gather(sidecar) -> list[ClusterFacts]:
    tracker = sidecar.tracker
    snap = sidecar.gpu.snapshot()
    claims = sidecar.gpu_claims()
    gpus_of: dict = {}
    if snap.up:
        for dev, owner, _how in join(snap.devices, claims, sidecar.gpu_map):
            if owner is not None:
                gpus_of.setdefault((owner.cluster, owner.pd_instance), []).append(
                    GpuFacts(str(dev.index), dev.uuid, dev.utilization, dev.power_w, dev.power_limit_w))
    with tracker.lock:
        ev = tracker.recent_evaluation()  # a scrape has just made one for the tracker's metrics
        now = ev.at_ns
        window_ns = tracker.flow_window_ns
        clusters: dict[str, ClusterFacts] = {
            name: ClusterFacts(name, window_ns / 1e9, 0, 0, gpu_telemetry_up=snap.up) for name in tracker.clusters
        }
        for (cluster, role, stage, inst_name), (n_stuck, _oldest) in ev.groups.items():
            if n_stuck:
                cf = clusters[cluster]
                cf.stuck[(role, stage)] = cf.stuck.get((role, stage), 0) + n_stuck
        for s in ev.stuck:
            key = (s.leg.role, s.leg.stage)
            cf = clusters[s.leg.cluster]
            cf.oldest_stuck_age_s[key] = max(cf.oldest_stuck_age_s.get(key, 0.0), s.age_s)
        for (cluster, role, stage), seconds in ev.thresholds.items():
            if cluster in clusters:
                clusters[cluster].thresholds_s[(role, stage)] = seconds
        for inst in tracker.instances.values():
            cf = clusters[inst.cluster]
            owner = inst.owner
            beats = [inc.last_heartbeat_ns for inc in inst.ranks.values() if inc.last_heartbeat_ns]
            stuck = {stage: g[0] for (cl, _r, stage, name), g in ev.groups.items()
                     if cl == inst.cluster and name == inst.name and g[0]}
            ok = inst.finished_ok_since(now - window_ns)
            open_legs = owner.open_total if owner is not None and owner.open_total is not None else \
                sum(owner.open_counts.values()) if owner is not None else 0
            cf.instances.append(InstanceFacts(
                pd_instance=inst.name,
                role=inst.role,
                up=tracker.instance_up(inst, now),
                heartbeat_age_s=(now - min(beats)) / 1e9 if beats else None,
                loop_stalled=tracker.loop_stalled(inst, now),
                start_time_s=owner.start_ns / 1e9 if owner is not None and owner.start_ns else None,
                restarts=inst.restarts,
                last_restart_age_s=(now - inst.restart_times_ns[-1]) / 1e9 if inst.restart_times_ns else None,
                finished_ok_recent=ok,
                open_legs=open_legs,
                stuck=stuck,
                gpus=gpus_of.get((inst.cluster, inst.name), []),
            ))
            cf.finished_ok_recent += ok
            cf.open_legs += open_legs
        return list(clusters.values())
