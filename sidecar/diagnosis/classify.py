"""Names the failure family behind stuck requests, as an SRE would reason.

Each rule looks at one cluster's facts and either stays silent or returns a
Finding whose evidence sentences carry the figures they rest on. The key
physical inference of the brief lives in `_gpu_reading`: decode GPUs at ~0 %
utilization and near idle power while requests hang mean the KV transfer is
wedged; a spinning tensor-parallel collective would read ~100 %.
"""

from __future__ import annotations

from typing import Any

from pdwatch import contract as c

from .facts import REPORT_AT, ClusterFacts, Finding, GpuFacts, InstanceFacts

BUSY_UTILIZATION = 0.90  # a collective spinning on the GPU
IDLE_UTILIZATION = 0.10
# Idle power is not reported by NVML; a GPU drawing under this share of its
# limit is "near idle" (an H100/H200 idles at ~160 W of 700 W, ~23 %).
IDLE_POWER_SHARE = 0.35
# A role restarted this much later than every peer of the other role is "alone".
RESTART_SKEW_S = 5.0

ACTIONS = {
    "transfer_wedge": "inspect the KV transfer peers (prefill's bootstrap/peer table, NIXL agents); "
                      "if a decode or prefill was restarted alone, co-restart the PD pair",
    "bootstrap_wedge": "inspect the bootstrap handshake between the PD peers; if one side was restarted alone, "
                       "co-restart the PD pair",
    "collective_desync": "dump the stacks of every rank (py-spy dump), check the collective library (NCCL) logs, "
                         "restart the whole TP group",
    "queue_starvation": "add capacity or KV memory (decode KV pool, max running requests); check for one huge request",
    "kv_starvation": "the decode's KV pool is full: add decode instances or KV memory (--mem-fraction-static), "
                     "or admit less (max running requests, shorter max context); check for one huge request",
    "total_wedge": "nothing finishes anywhere: restart the PD pair; the GPU evidence says which family it resembles",
    "restart_skew": "co-restart the PD pair so both sides start with clean bootstrap state",
    "engine_silent": "the process is dead or frozen: check it (crash, OOM, SIGSTOP, hung driver) and restart it",
}


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{x * 100:.0f} %"


def _w(x: float | None) -> str:
    return "?" if x is None else f"{x:.0f} W"


def _gpus(gpus: list[GpuFacts]) -> str:
    return ",".join(g.gpu for g in gpus)


def _gpu_reading(gpus: list[GpuFacts]) -> tuple[str | None, str]:
    """('idle' | 'busy' | 'mixed' | None, a sentence fragment with the figures)."""
    known = [g for g in gpus if g.utilization is not None]
    if not known:
        return None, "no GPU telemetry"
    util = sum(g.utilization for g in known if g.utilization is not None) / len(known)
    powers = [g.power_w for g in known if g.power_w is not None]
    limits = [g.power_limit_w for g in known if g.power_limit_w]
    power = sum(powers) / len(powers) if powers else None
    limit = sum(limits) / len(limits) if limits else None
    text = f"GPU {_gpus(known)} at {_pct(util)} utilization and {_w(power)}" + (f" of {_w(limit)}" if limit else "")
    near_idle_power = power is not None and limit is not None and power <= IDLE_POWER_SHARE * limit
    if util <= IDLE_UTILIZATION and (power is None or limit is None or near_idle_power):
        return "idle", text
    if util >= BUSY_UTILIZATION:
        return "busy", text
    return "mixed", text


def _stuck_sentence(f: ClusterFacts, stages: tuple[str, ...]) -> str:
    parts, oldest, threshold = [], 0.0, None
    for (role, stage), n in sorted(f.stuck.items()):
        if stage in stages and n:
            parts.append(f"{role} {n}")
            age = f.oldest_stuck_age_s.get((role, stage), 0.0)
            if age >= oldest:
                oldest, threshold = age, f.thresholds_s.get((role, stage))
    total = f.stuck_in(*stages)
    thr = f" (threshold {threshold:.0f} s)" if threshold else ""
    return (f"{total} leg(s) stuck in {'/'.join(stages)} ({', '.join(parts)}) for up to {oldest:.0f} s{thr}")


def _flow_sentence(f: ClusterFacts) -> str:
    return f"{f.finished_ok_recent} other leg(s) finished ok in the last {f.flow_window_s:.0f} s"


def _instances_with(f: ClusterFacts, *stages: str) -> list[InstanceFacts]:
    return [i for i in f.instances if any(i.stuck.get(s, 0) for s in stages)]


def engine_silent(f: ClusterFacts) -> Finding | None:
    down = f.silent
    if not down:
        return None
    evidence = [
        f"{i.role} {i.pd_instance}: no heartbeat for "
        f"{'?' if i.heartbeat_age_s is None else f'{i.heartbeat_age_s:.0f}'} s (down after 3 intervals)"
        for i in down
    ]
    hung = sum(i.open_legs for i in down)
    if hung:
        evidence.append(f"{hung} leg(s) were open on it when it went silent")
    return Finding("engine_silent", 0.9, evidence, ACTIONS["engine_silent"])


def collective_desync(f: ClusterFacts) -> Finding | None:
    evidence, confidence = [], 0.0
    for i in f.instances:
        if not i.up or not (i.loop_stalled or i.loop_frozen):
            continue
        # In a TP group the ranks that entered the collective spin while the one
        # that never joined sits idle: any busy GPU of the frozen instance counts.
        spinning = [g for g in i.gpus if g.utilization is not None and g.utilization >= BUSY_UTILIZATION]
        reading, text = _gpu_reading(spinning) if spinning else _gpu_reading(i.gpus)
        frozen = (f"{i.role} {i.pd_instance}: scheduler loop frozen with {i.open_legs} leg(s) open while "
                  "heartbeats continue") if i.open_legs or not i.loop_frozen else \
                 (f"{i.role} {i.pd_instance}: scheduler loop frozen while idle (it turned while idle before) and "
                  "heartbeats continue: no new request can reach it")
        held = sum(i.evidence.values())
        if held:
            frozen += f" ({held} leg(s) stuck on it)"
        if reading == "busy":
            evidence.append(f"{frozen}; {text}: the ranks spin in a collective that never completes")
            confidence = max(confidence, 0.85)
        elif reading is None and i.loop_frozen:
            # The loop rule is evidence on its own; the GPUs would say whether it is a collective.
            evidence.append(f"{frozen}; {text}: GPU utilization would confirm a collective hang "
                            "(~100 %) or rule it out")
            confidence = max(confidence, 0.65)
        elif reading is None:
            evidence.append(f"{frozen}; {text}, so a collective hang cannot be confirmed")
            confidence = max(confidence, 0.4)
        elif i.loop_frozen:
            evidence.append(f"{frozen}; {text}: not spinning, so a hang outside a collective "
                            "(a kernel, a lock, the host) is as likely")
            confidence = max(confidence, 0.55)
    if not evidence:
        return None
    return Finding("collective_desync", confidence, evidence, ACTIONS["collective_desync"])


def _explained_by_silence(f: ClusterFacts, evidence: list[str], stages: str) -> float:
    """How much a wedge's confidence drops because a silent engine explains its stuck legs.

    A frozen or dead peer leaves legs hanging in transfer or bootstrap on the
    side that is still up, and its GPUs read idle: the picture of a wedge,
    whose action (co-restart the pair) would be wrong. The silent engine is the
    finding to lead with, so the wedge ranks below it."""
    down = f.silent
    if not down:
        return 0.0
    names = ", ".join(f"{i.role} {i.pd_instance}" for i in down)
    evidence.append(f"{names} sent no heartbeat: the legs stuck in {stages} may wait on it (engine_silent)")
    return 0.3


def _explained_by_frozen(f: ClusterFacts, evidence: list[str], stages: str) -> float:
    """How much a wedge's confidence drops because a frozen engine loop explains its stuck legs.

    A loop that stopped (a collective hang on a decode, say) leaves the legs of
    its PD peers waiting in bootstrap or transfer: a downstream symptom. The
    frozen loop is the finding to lead with."""
    frozen = f.frozen
    if not frozen:
        return 0.0
    names = ", ".join(f"{i.role} {i.pd_instance}" for i in frozen)
    evidence.append(f"{names}: scheduler loop frozen while it heartbeats: the legs stuck in {stages} may wait "
                    "on it (collective_desync)")
    return 0.3


def _peer_gone_sentence(f: ClusterFacts, evidence: list[str], *stages: str) -> float:
    n = f.on_evidence("peer_gone", *stages)
    if not n:
        return 0.0
    evidence.append(f"{n} of them talk to a KV peer whose process has ended (peer_gone): they can never finish")
    return 0.1


def _overtaken_sentence(f: ClusterFacts, evidence: list[str], *stages: str) -> float:
    n = f.on_evidence(c.REASON_OVERTAKEN, *stages)
    if not n:
        return 0.0
    evidence.append(f"{n} of them were overtaken ({c.REASON_OVERTAKEN}): later legs at least as big went through "
                    "the same stage on the same instance many times faster, so the path works for others")
    return 0.1


def transfer_wedge(f: ClusterFacts) -> Finding | None:
    n = f.stuck_in("transfer")
    if not n or not f.flowing:
        return None
    evidence = [_stuck_sentence(f, ("transfer",)) + f" while {_flow_sentence(f)}"]
    confidence = 0.6
    stalled = [i for i in f.instances if i.loop_stalled]
    if not stalled:
        evidence.append("every engine's scheduler loop keeps advancing: no engine is wedged, the transfer is")
        confidence += 0.15
    decodes = [i for i in _instances_with(f, "transfer") if i.role == "decode"] or \
              [i for i in f.instances if i.role == "decode" and i.open_legs]
    gpus = [g for i in decodes for g in i.gpus]
    reading, text = _gpu_reading(gpus)
    names = ",".join(i.pd_instance for i in decodes) or "decode"
    if reading == "idle":
        evidence.append(f"{names}: {text}, near idle: not a stuck collective, which would read ~100 %")
        confidence += 0.2
    elif reading == "busy":
        evidence.append(f"{names}: {text}: busy, which fits a collective hang better than a transfer wedge")
        confidence -= 0.2
    elif reading is None:
        evidence.append(f"{names}: no GPU telemetry, so a collective hang is not ruled out by power and utilization")
    confidence += _peer_gone_sentence(f, evidence, "transfer")
    confidence += _overtaken_sentence(f, evidence, "transfer")
    confidence -= _explained_by_silence(f, evidence, "transfer")
    confidence -= _explained_by_frozen(f, evidence, "transfer")
    return Finding("transfer_wedge", min(confidence, 0.95), evidence, ACTIONS["transfer_wedge"])


def _serving_others(i: InstanceFacts) -> bool:
    return i.finished_ok_recent > 0


def _behind_a_transfer_wedge(i: InstanceFacts, evidence: list[str]) -> bool:
    """Whether the instance also holds legs stuck in transfer, said in the evidence: seen on live SGLang,
    a decode whose transfers never end keeps their KV memory, and new requests queue behind them; the
    wedge is the cause to act on, and the starvation ranks below it."""
    if not i.stuck.get("transfer"):
        return False
    evidence.append(f"{i.role} {i.pd_instance} also holds {i.stuck['transfer']} leg(s) stuck in transfer, whose "
                    "KV memory never comes back: starvation downstream of a transfer wedge (transfer_wedge)")
    return True


def queue_starvation(f: ClusterFacts) -> Finding | None:
    evidence = []
    confidence = 0.75
    for i in f.instances:
        waiting = i.stuck.get("queued", 0) + (i.stuck.get("bootstrap", 0) if i.role == "decode" else 0)
        if waiting and _serving_others(i):
            where = "queued" if i.stuck.get("queued") else "bootstrap, waiting for KV memory"
            evidence.append(f"{i.role} {i.pd_instance}: {waiting} leg(s) stuck in {where} while it finished "
                            f"{i.finished_ok_recent} other leg(s) ok in the last {f.flow_window_s:.0f} s")
            if _behind_a_transfer_wedge(i, evidence):
                confidence = 0.55
    if not evidence:
        return None
    confidence -= _explained_by_frozen(f, evidence, "queued")
    return Finding("queue_starvation", confidence, evidence, ACTIONS["queue_starvation"])


# A decode's KV pool at least this full (held by running requests) leaves no room to pre-allocate
# the next request's KV cache: new decode legs wait in bootstrap until some finish.
KV_FULL = 0.9


def kv_starvation(f: ClusterFacts) -> Finding | None:
    """queue_starvation's decode case made certain by the engine's own KV usage: decode legs wait in
    bootstrap (KV pre-allocation) on a decode whose pool is full while it keeps finishing others."""
    evidence = []
    confidence = 0.85
    for i in f.instances:
        waiting = i.stuck.get("bootstrap", 0)
        if i.role != "decode" or not waiting or i.kv_used is None or i.kv_used < KV_FULL or not _serving_others(i):
            continue
        evidence.append(f"decode {i.pd_instance}: {waiting} leg(s) stuck in bootstrap, waiting for KV memory, while "
                        f"its KV pool is {_pct(i.kv_used)} full and it finished {i.finished_ok_recent} other leg(s) "
                        f"ok in the last {f.flow_window_s:.0f} s")
        if _behind_a_transfer_wedge(i, evidence):
            confidence = 0.55
    if not evidence:
        return None
    confidence -= _explained_by_frozen(f, evidence, "bootstrap")
    return Finding("kv_starvation", confidence, evidence, ACTIONS["kv_starvation"])


def bootstrap_wedge(f: ClusterFacts) -> Finding | None:
    if not f.stuck_in("bootstrap") or not f.flowing:
        return None
    # Decode legs waiting in bootstrap on an instance that serves others are
    # starved of KV memory, not wedged.
    wedged = [i for i in _instances_with(f, "bootstrap") if not (i.role == "decode" and _serving_others(i))]
    if not wedged:
        return None
    evidence = [_stuck_sentence(f, ("bootstrap",)) + f" while {_flow_sentence(f)}",
                "stuck on " + ", ".join(f"{i.role} {i.pd_instance}" for i in wedged)]
    confidence = 0.7 + _peer_gone_sentence(f, evidence, "bootstrap") - _explained_by_silence(f, evidence, "bootstrap") \
        - _explained_by_frozen(f, evidence, "bootstrap")
    if f.stuck_in("transfer"):
        # A decode whose transfers never end runs out of KV memory; requests routed to it then
        # wait in bootstrap on both sides (seen on live SGLang): the transfer wedge comes first.
        evidence.append(f"{f.stuck_in('transfer')} leg(s) are stuck in transfer too: the bootstrap waits can be "
                        "requests queued behind a transfer wedge that holds a decode's KV memory (transfer_wedge)")
        confidence -= 0.15
    return Finding("bootstrap_wedge", confidence, evidence, ACTIONS["bootstrap_wedge"])


def total_wedge(f: ClusterFacts) -> Finding | None:
    stuck = sum(f.stuck.values())
    if f.flowing or not f.open_legs or not stuck:
        return None
    evidence = [f"{f.open_legs} leg(s) open, {stuck} stuck, and no leg finished ok anywhere in the cluster in the "
                f"last {f.flow_window_s:.0f} s"]
    busy = [i for i in f.instances if _gpu_reading(i.gpus)[0] == "busy"]
    idle = [i for i in f.instances if _gpu_reading(i.gpus)[0] == "idle"]
    if busy:
        evidence.append("busy GPUs on " + ", ".join(f"{i.pd_instance} ({_gpu_reading(i.gpus)[1]})" for i in busy)
                        + ": resembles a collective desync")
    elif idle:
        evidence.append("idle GPUs on " + ", ".join(f"{i.pd_instance} ({_gpu_reading(i.gpus)[1]})" for i in idle)
                        + ": resembles a transfer or bootstrap wedge")
    return Finding("total_wedge", 0.8, evidence, ACTIONS["total_wedge"])


def restart_skew(f: ClusterFacts) -> Finding | None:
    trouble = f.stuck_in("transfer", "bootstrap")
    if not trouble:
        return None
    evidence = []
    for i in f.instances:
        if not i.restarts or i.start_time_s is None:
            continue
        peers = [p for p in f.instances if p.role != i.role and p.role != "unified" and p.start_time_s is not None]
        if not peers:
            continue
        newest_peer = max(p.start_time_s for p in peers if p.start_time_s is not None)
        restarted_peers = [p for p in peers if p.restarts and p.last_restart_age_s is not None
                           and i.last_restart_age_s is not None and p.last_restart_age_s <= i.last_restart_age_s + 60]
        gap = i.start_time_s - newest_peer
        if gap >= RESTART_SKEW_S and not restarted_peers:
            oldest = min(peers, key=lambda p: p.start_time_s or 0.0)  # known for every peer
            evidence.append(
                f"{i.role} {i.pd_instance} was restarted alone ({i.restarts} restart(s), the latest "
                f"{'?' if i.last_restart_age_s is None else f'{i.last_restart_age_s:.0f}'} s ago): its process started "
                f"{gap:.0f} s after {oldest.role} {oldest.pd_instance}'s, which kept its bootstrap state"
            )
    if not evidence:
        return None
    evidence.append(_stuck_sentence(f, ("transfer", "bootstrap")) + " since")
    # A likely cause rather than the failure itself: it ranks below the wedge it explains.
    return Finding("restart_skew", 0.7, evidence, ACTIONS["restart_skew"])


RULES = (engine_silent, collective_desync, total_wedge, transfer_wedge, bootstrap_wedge, queue_starvation,
         kv_starvation, restart_skew)


def classify(f: ClusterFacts) -> list[Finding]:
    """Every family the facts support, most confident first."""
    findings = [x for rule in RULES if (x := rule(f)) is not None]
    findings.sort(key=lambda x: -x.confidence)
    return findings


def verdict(f: ClusterFacts, findings: list[Finding] | None = None) -> dict[str, Any]:
    """Contract section 7's per-cluster diagnosis: the leading family plus every finding.

    `findings` are classify(f)'s, when the caller has them already."""
    findings = [x for x in (classify(f) if findings is None else findings) if x.confidence >= REPORT_AT]
    if not findings:
        return {"cluster": f.cluster, "family": None, "confidence": 0.0,
                "evidence": [_flow_sentence(f) + f"; {sum(f.stuck.values())} leg(s) stuck"],
                "action": "nothing to do", "findings": []}
    top = findings[0]
    action = top.action
    if top.family in ("transfer_wedge", "bootstrap_wedge") and any(x.family == "restart_skew" for x in findings):
        # The brief's incident: the wedge follows a one-sided restart, and the fix is known.
        action = ("co-restart the PD pair: one side was restarted alone and the other kept stale bootstrap "
                  "state; then watch the stuck legs clear")
    return {"cluster": f.cluster, **top.as_dict(), "action": action,
            "findings": [x.as_dict() for x in findings]}
