"""JSON shapes of the HTTP API (contract section 7).

Every view is built from the judge's immutable values: the latest
`Evaluation`, or for one request's detail the `RequestView` the judge made
when asked. Nothing here sees the tracker or applies a rule of its own.
"""

from __future__ import annotations

from typing import Any

from pdwatch import contract as c

from .evaluation import Evaluation, InstanceView, LegDetail, RequestView, StuckLeg


def _s(ns: int | None) -> float | None:
    return None if ns is None else round(ns / 1e9, 6)


def stuck_leg(s: StuckLeg, ev: Evaluation) -> dict[str, Any]:
    return {
        "trace_id": s.trace_id,
        "rid": s.rid,
        "bootstrap_room": s.room,
        "cluster": s.cluster,
        "role": s.role,
        "stage": s.stage,
        "pd_instance": s.pd_instance,
        "peer": s.peer,
        "stage_age_s": round(s.age_s, 3),
        "threshold_s": round(s.threshold_s, 3),
        "reason": s.reason,
        # Additions: the evidence in words, whether the page condition holds, when the leg
        # entered its stage and when it was first judged stuck.
        "why": s.why,
        "others_flowing": bool(ev.flowing.get(s.cluster)),
        "stage_since_unix_s": _s(s.stage_since_ns + s.offset_ns),
        "stuck_since_unix_s": _s(s.stuck_since_ns),
        "prompt_tokens": s.prompt_tokens,
        "error": s.error,
    }


def stuck_list(ev: Evaluation) -> list[dict[str, Any]]:
    return [stuck_leg(s, ev) for s in ev.stuck]


def _leg(leg: LegDetail) -> dict[str, Any]:
    out: dict[str, Any] = {
        "role": leg.role,
        "rid": leg.rid,
        "bootstrap_room": leg.room,
        "cluster": leg.cluster,
        "pd_instance": leg.pd_instance,
        "incarnation": leg.incarnation,
        "peer": leg.peer,
        "span_id": leg.span_id,
        "state": "open" if leg.open else "done",
        "outcome": leg.outcome,
        "arrived_unix_s": _s(leg.arrive_ns),
        "ended_unix_s": _s(leg.end_ns),
        "tokens": leg.tokens,
        "prompt_tokens": leg.prompt_tokens,
        "stages": [
            {"stage": run.stage, "start_unix_s": _s(run.start_ns), "end_unix_s": _s(run.end_ns),
             "duration_s": round((run.end_ns - run.start_ns) / 1e9, 6), "error": run.error}
            for run in leg.stages
        ],
        "error": leg.error,  # the engine's last error for the leg that did not end it, open or done
    }
    if leg.open:
        out["stage"] = leg.stage
        out["stage_since_unix_s"] = _s(leg.stage_since_ns)
        out["stage_age_s"] = round(leg.age_s or 0.0, 3)  # decode: since its last new token
        verdict = leg.stuck
        out["stuck"] = verdict is not None
        if verdict is not None:
            out["threshold_s"] = round(verdict.threshold_s, 3)
            out["reason"] = verdict.reason
            out["why"] = verdict.why
    return out


def request_detail(view: RequestView | None) -> dict[str, Any] | None:
    """Both legs of one request, from the judge's `request_view`."""
    if view is None:
        return None
    return {"trace_id": view.trace_id, "legs": [_leg(leg) for leg in view.legs]}


def instance(inst: InstanceView) -> dict[str, Any]:
    return {
        "cluster": inst.cluster,
        "pd_instance": inst.name,
        "role": inst.role,
        "up": inst.up,
        "state": inst.state,  # up, down or departed (contract section 5, v1.2)
        "open_at_silence": inst.open_at_silence,
        "loop_stalled": inst.loop_stalled,
        "loop_frozen": inst.loop_frozen,
        "restarts": inst.restarts,
        "restart_times_unix_s": [_s(t) for t in inst.restart_times_ns],
        "open": inst.open_counts,
        "finished_ok_recent": inst.finished_ok_recent,
        "kv_used_ratio": inst.kv_used,
        # v1.2: what the engine runs, how much of it the plugin sees, and what its recorders lost.
        "engine": inst.engine,
        "engine_version": inst.engine_version,
        "plugin_version": inst.plugin_version,
        "plugin_state": inst.plugin_state,
        "plugin_refused": list(inst.plugin_refused),
        "recorder": dict(inst.recorder),
        "ranks": [
            {"tp_rank": r.rank, "incarnation": r.incarnation, "pid": r.pid, "host": r.host,
             "start_unix_s": _s(r.start_ns), "heartbeat_seq": r.heartbeat_seq,
             "heartbeat_age_s": None if r.heartbeat_age_s is None else round(r.heartbeat_age_s, 3), "up": r.up,
             "loop_iterations": r.loop_iterations, "loop_still_s": round(r.loop_still_s, 3),
             "loop_rule_s": round(r.loop_rule_s, 3), "idle_turn_s": r.idle_turn_s, "completed": r.completed, "failed": r.failed,
             "tokens_generated": r.tokens_generated, "open_total": r.open_total, "clock_offset_s": r.offset_s,
             "gpu_uuids": list(r.gpu_uuids), "peer_ids": list(r.peer_ids), "engine": r.engine}
            for r in inst.ranks
        ],
    }


def summary(ev: Evaluation) -> dict[str, Any]:
    """Per cluster: legs finished by role and outcome, open legs per role and stage, flow, stuck; instances."""
    clusters: dict[str, dict[str, Any]] = {
        name: {"finished": {}, "open": {}, "flowing": bool(ev.flowing.get(name)), "stuck": 0,
               "stuck_by_reason": {}}
        for name in ev.clusters()
    }
    # Summed from the same counts as pdwatch_requests_finished_total, so the two always agree.
    for (cluster, role, _inst, outcome), n in ev.counters.finished.items():
        if cluster in clusters:
            by_outcome = clusters[cluster]["finished"].setdefault(role, {})
            by_outcome[outcome] = by_outcome.get(outcome, 0) + n
    for inst in ev.instances:
        per_stage = clusters[inst.cluster]["open"].setdefault(inst.role, dict.fromkeys(c.STAGES[inst.role], 0))
        for stage, n in inst.open_counts.items():
            per_stage[stage] = per_stage.get(stage, 0) + n
    for s in ev.stuck:
        cl = clusters[s.cluster]
        cl["stuck"] += 1
        cl["stuck_by_reason"][s.reason] = cl["stuck_by_reason"].get(s.reason, 0) + 1
    return {"at_unix_s": _s(ev.at_ns), "clusters": clusters, "instances": [instance(i) for i in ev.instances],
            "tracked_legs": ev.counters.tracked_legs}
