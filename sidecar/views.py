"""JSON shapes of the HTTP API, built from tracker state (contract section 7)."""

from __future__ import annotations

from pdwatch import contract as c

from .model import Leg, stage_history
from .tracker import Tracker


def _s(ns: int | None) -> float | None:
    return None if ns is None else round(ns / 1e9, 6)


def stuck_list(tracker: Tracker) -> list[dict]:
    with tracker.lock:
        ev = tracker.evaluate()
        return [
            {
                "trace_id": s.leg.trace_id,
                "rid": s.leg.rid,
                "bootstrap_room": s.leg.room,
                "cluster": s.leg.cluster,
                "role": s.leg.role,
                "stage": s.leg.stage,
                "pd_instance": s.leg.pd_instance,
                "peer": s.leg.peer,
                "stage_age_s": round(s.age_s, 3),
                "threshold_s": round(s.threshold_s, 3),
                # Additions: whether the page condition holds, and when this leg was first judged stuck.
                "others_flowing": bool(ev.flowing.get(s.leg.cluster)),
                "stage_since_unix_s": _s(s.leg.stage_since_ns),
                "stuck_since_unix_s": _s(s.leg.stuck_at_ns),
            }
            for s in ev.stuck
        ]


def _leg(leg: Leg, stuck: dict, now: int) -> dict:
    out = {
        "role": leg.role,
        "rid": leg.rid,
        "bootstrap_room": leg.room,
        "cluster": leg.cluster,
        "pd_instance": leg.pd_instance,
        "incarnation": leg.inc.id if leg.inc is not None else None,
        "peer": leg.peer,
        "span_id": leg.span_id,
        "state": "open" if leg.outcome is None and leg.end_ns is None else "done",
        "outcome": leg.outcome,
        "arrived_unix_s": _s(leg.arrive_ns),
        "ended_unix_s": _s(leg.end_ns),
        "tokens": leg.tokens,
        "stages": [
            {"stage": stage, "start_unix_s": _s(start), "end_unix_s": _s(end),
             "duration_s": round((end - start) / 1e9, 6), "error": error}
            for stage, start, end, error in stage_history(leg)
        ],
    }
    if out["state"] == "open":
        out["stage"] = leg.stage
        out["stage_since_unix_s"] = _s(leg.stage_since_ns)
        offset = leg.inc.offset_ns() if leg.inc is not None else 0
        out["stage_age_s"] = round((now - offset - leg.stage_since_ns) / 1e9, 3)
        verdict = stuck.get((leg.trace_id, leg.role))
        out["stuck"] = verdict is not None
        if verdict is not None:
            out["threshold_s"] = round(verdict.threshold_s, 3)
    return out


def request_detail(tracker: Tracker, trace_id: str) -> dict | None:
    with tracker.lock:
        ev = tracker.evaluate()
        stuck = {(s.leg.trace_id, s.leg.role): s for s in ev.stuck}
        legs = []
        for role in c.ROLES:
            leg = tracker.open.get((trace_id, role)) or tracker.closed.get((trace_id, role))
            if leg is not None:
                legs.append(_leg(leg, stuck, ev.at_ns))
        if not legs:
            return None
        return {"trace_id": trace_id, "legs": legs}


def summary(tracker: Tracker) -> dict:
    """Per cluster: legs finished by role and outcome, open legs per role and stage, flow, stuck; instances."""
    with tracker.lock:
        ev = tracker.evaluate()
        now = ev.at_ns
        clusters: dict = {}
        for name in tracker.clusters:
            clusters[name] = {"finished": {}, "open": {}, "flowing": bool(ev.flowing.get(name)), "stuck": 0}
        # Summed from the same counts as pdwatch_requests_finished_total, so the two always agree.
        for (cluster, role, _inst, outcome), n in tracker.finished.items():
            if cluster in clusters:
                by_outcome = clusters[cluster]["finished"].setdefault(role, {})
                by_outcome[outcome] = by_outcome.get(outcome, 0) + n
        instances = []
        for inst in tracker.instances.values():
            cl = clusters[inst.cluster]
            owner = inst.owner
            counts = owner.open_counts if owner is not None else {}
            per_stage = cl["open"].setdefault(inst.role, dict.fromkeys(c.STAGES[inst.role], 0))
            for stage, n in counts.items():
                per_stage[stage] = per_stage.get(stage, 0) + n
            instances.append({
                "cluster": inst.cluster,
                "pd_instance": inst.name,
                "role": inst.role,
                "up": tracker.instance_up(inst, now),
                "loop_stalled": tracker.loop_stalled(inst, now),
                "restarts": inst.restarts,
                "ranks": [
                    {"tp_rank": inc.rank, "incarnation": inc.id, "pid": inc.pid, "host": inc.host,
                     "start_unix_s": _s(inc.start_ns), "heartbeat_seq": inc.seq,
                     "loop_iterations": inc.loop_iterations, "completed": inc.completed, "failed": inc.failed,
                     "tokens_generated": inc.tokens_generated, "open_total": inc.open_total,
                     "clock_offset_s": round(inc.offset_ns() / 1e9, 3), "gpu_uuids": list(inc.gpu_uuids),
                     "engine": inc.extra}
                    for inc in sorted(inst.ranks.values(), key=lambda i: i.rank)
                ],
            })
        for s in ev.stuck:
            clusters[s.leg.cluster]["stuck"] += 1
        return {"at_unix_s": _s(now), "clusters": clusters, "instances": instances,
                "tracked_legs": len(tracker.open)}
