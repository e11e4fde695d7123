"""The judge: the one place where time passes.

On each tick (the worker thread, every `PDWATCH_EVALUATE_INTERVAL_S`) it
forgets instances past their TTL, reads the restarts the tracker logged,
finds ranks that went down, applies the stuck rule and the evidence rules of
contract section 5b to every open leg, joins GPUs to instances, diagnoses
each cluster, and publishes the result as one immutable `Evaluation`. Legs
that became stuck on this tick go to `on_stuck` once each (the forwarder's
pd.stuck spans), with the family this same tick diagnosed.

The tracker's objects are facts it reads and never writes (tests/test_layout.py
holds it so); the rules over them are `rules.py` and `thresholds.py`, and what
it concludes lives in its own tables (`verdicts.py`): per-leg verdicts, ranks
found down, peers gone, legs found stuck.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from pdwatch import contract as c

from . import engine_health, rules
from .capture import StackCapture
from .contrast import Contrast, LegFacts, contrast
from .diagnosis.classify import classify, verdict
from .diagnosis.from_evaluation import gather
from .evaluation import (
    EMPTY,
    Counters,
    Evaluation,
    GpuView,
    Group,
    InstanceView,
    LegDetail,
    Rank,
    RequestView,
    StageRun,
    StuckLeg,
)
from .gpu.join import InstanceClaim, Owner, OwnerMemory
from .gpu.sampler import GpuSampler
from .history import History
from .model import Incarnation, Instance, Leg, arrival_ns, stage_history
from .settings import Settings
from .thresholds import Thresholds
from .tracker import Tracker
from .verdicts import GonePeers, LegVerdict

log = logging.getLogger("pdwatch.sidecar.judge")

_EVIDENCE_STAGES = ("bootstrap", "transfer")  # where a leg waits on its KV peer
# Legs that finished ok looked at for the contrast, newest first: enough to see a pattern.
CONTRAST_FLOWING_MAX = 5000

# (cluster, instance) -> its ranks whose loop froze with legs open
Frozen = dict[tuple[str, str], list[Incarnation]]
# One tick's passages, read once per process and stage for the overtaken rule (None: it does not judge there)
PassedNow = dict[Incarnation, dict[str, rules.Passed | None]]
_UNREAD = rules.Passed([], [], 0, 0, 0.0)  # a stage whose passages this tick has not read yet
# The stuck legs' views oldest first, the groups, the thresholds, the views of the legs newly stuck, the stuck legs
JudgedLegs = tuple[tuple[StuckLeg, ...], dict[tuple[str, str, str, str], Group], dict[tuple[str, str, str], float],
                   list[StuckLeg], list[Leg]]


class Judge:
    def __init__(
        self,
        tracker: Tracker,
        settings: Settings | None = None,
        *,
        gpu: GpuSampler | None = None,
        gpu_map: dict[str, Owner] | None = None,
        on_stuck: Callable[[Sequence[StuckLeg], dict[str, str | None]], None] | None = None,
        history: History | None = None,
        capture: StackCapture | None = None,
    ):
        settings = settings or Settings.model_construct()  # the settings' defaults
        self.tracker = tracker
        self.thresholds = Thresholds(tracker.samples, settings.floors)
        self.flow_window_ns = int(settings.flow_window_s * 1e9)
        self.instance_ttl_ns = int(settings.instance_ttl_s * 1e9)
        self.down_forget_ns = int(settings.down_forget_s * 1e9)
        self.overtaken_k, self.overtaken_m = settings.overtaken_k, settings.overtaken_m
        # The judge's own tables (verdicts.py): what it concluded, never written into the tracker.
        self.verdicts: dict[tuple[str, str], LegVerdict] = {}
        self.gone_peers = GonePeers()
        # Ranks whose process ended for their peers (left in order, or silent) -> (since when, their cluster).
        self.down: dict[Incarnation, tuple[int, str]] = {}
        self.stuck_detected: dict[tuple[str, str, str], int] = {}
        self._retired_seen = 0
        self.gpu = gpu
        self.owners = OwnerMemory(gpu_map or {})
        self.on_stuck = on_stuck
        self.history = history
        self.capture = capture
        self._had_stuck: set[tuple[str, str]] = set()
        self._had_frozen: set[tuple[str, str]] = set()
        self.latest: Evaluation = EMPTY
        self._seq = 0

    def tick(self, now: int | None = None) -> Evaluation:
        t = self.tracker
        now = t.clock() if now is None else now
        self._expire(now)
        self._read_restarts()
        self._find_down(now)
        states = {key: rules.instance_state(inst, now) for key, inst in t.instances.items()}
        frozen = {(inst.cluster, inst.name): ranks for inst in t.instances.values()
                  if (ranks := rules.frozen_ranks(inst, now))}
        stuck, groups, thresholds, fresh, stuck_legs = self._judge_legs(now, frozen, states)
        # A loop frozen while idle names its instance, never a leg (rules.idle_frozen_ranks).
        frozen_any = frozen | {(inst.cluster, inst.name): ranks for inst in t.instances.values()
                               if (ranks := rules.idle_frozen_ranks(inst, now))}
        flowing = {name: rules.flowing(cl.last_ok_ns, now, self.flow_window_ns) for name, cl in t.clusters.items()}
        instances = tuple(self._instance(inst, now, frozen_any, states[key]) for key, inst in t.instances.items())
        gpus, gpu_up, reason, driver, sampled_at = self._gpus(instances)
        self._seq += 1
        ev = Evaluation(
            at_ns=now, seq=self._seq, stuck=stuck, groups=groups, thresholds=thresholds, flowing=flowing,
            flow_window_s=self.flow_window_ns / 1e9, instances=instances, counters=self._counters(),
            histogram=t.durations.snapshot(),
            gpu_up=gpu_up, gpu_reason=reason, gpu_driver=driver, gpu_sampled_at=sampled_at, gpus=gpus, diagnosis=(),
        )
        contrasts = self._contrasts(stuck_legs, now)
        self._ask_for_stacks(stuck, frozen_any)
        verdicts, confidences = [], {}
        for facts in gather(ev):
            findings = classify(facts)
            confidences[facts.cluster] = {f.family: round(f.confidence, 2) for f in findings}
            verdicts.append({**verdict(facts, findings),
                             "contrast": [x.as_dict() for x in contrasts.get(facts.cluster, ())],
                             "captures": self.capture.captures(facts.cluster) if self.capture is not None else []})
        ev = replace(ev, diagnosis=tuple(verdicts), confidences=confidences)
        self.latest = ev
        if self.history is not None:
            self.history.record(ev)
        if fresh and self.on_stuck is not None:
            family = {v["cluster"]: v["family"] for v in verdicts}
            try:
                self.on_stuck(fresh, family)
            except Exception:  # a sink's bug must not stop the judge
                log.exception("pd.stuck sink failed")
        return ev

    # ---- instances -------------------------------------------------------------------------

    def _expire(self, now: int) -> None:
        """Instances silent past the TTL are forgotten: the tracker drops its facts, the judge its verdicts.
        A down one goes sooner, after PDWATCH_DOWN_FORGET_S, its legs ending lost: a killed pod that was
        rescheduled elsewhere reports to another sidecar, and its legs here no longer exist."""
        t = self.tracker
        gone: list[tuple[tuple[str, str], str | None]] = []
        for key, inst in t.instances.items():
            if rules.expired(inst, now, self.instance_ttl_ns):
                gone.append((key, None))
            elif rules.instance_state(inst, now) == c.STATE_DOWN and self._down_since(inst) < now - self.down_forget_ns:
                gone.append((key, c.OUTCOME_LOST))
        for key, outcome in gone:
            forgotten = t.forget_instance(key, outcome)
            if forgotten is None:
                continue
            for inc in forgotten.ranks.values():
                self.down.pop(inc, None)
            if forgotten.cluster not in t.clusters:
                self.gone_peers.forget_cluster(forgotten.cluster)
                for skey in [k for k in self.stuck_detected if k[0] == forgotten.cluster]:
                    del self.stuck_detected[skey]

    def _read_restarts(self) -> None:
        """A process replaced by a restart has ended: its peer ids name nobody, since it went down if it did."""
        t = self.tracker
        new, self._retired_seen = t.retired_total - self._retired_seen, t.retired_total
        if new <= 0:
            return
        for r in list(t.retirements)[-new:]:
            down = self.down.pop(r.inc, None)
            self.gone_peers.add(r.cluster, r.inc, r.instance, down[0] if down is not None else r.at_ns)

    def _find_down(self, now: int) -> None:
        """A rank that left in order or stopped heartbeating has ended, as far as its KV peers are
        concerned; one that heartbeats again (a stopped process continued) names a live peer once more."""
        for inc in [inc for inc in self.down if not rules.ended(inc, now)]:
            _, cluster = self.down.pop(inc)
            self.gone_peers.revive(cluster, inc)
        for inst in self.tracker.instances.values():
            for inc in inst.ranks.values():
                if inc not in self.down and rules.ended(inc, now):
                    at = inc.final_ns or now
                    self.down[inc] = (at, inst.cluster)
                    self.gone_peers.add(inst.cluster, inc, inst.name, at)

    def _down_since(self, inst: Instance) -> int:
        """When the earliest of the instance's ranks found silent went so (sidecar clock)."""
        return min((self.down[inc][0] for inc in inst.ranks.values() if inc in self.down and not inc.final_ns),
                   default=2**63)

    def _instance(self, inst: Instance, now: int, frozen: Frozen, state: str) -> InstanceView:
        owner = inst.owner
        beats = [inc.last_heartbeat_ns for inc in inst.ranks.values() if inc.last_heartbeat_ns]
        open_total = owner.open_total if owner is not None and owner.open_total is not None else \
            sum(owner.open_counts.values()) if owner is not None else 0
        plugin_state, refused = engine_health.plugin_state(inst.ranks.values())
        return InstanceView(
            cluster=inst.cluster, name=inst.name, role=inst.role, up=state == c.STATE_UP, state=state,
            open_at_silence=open_total if state == c.STATE_DOWN else 0,
            loop_stalled=rules.loop_stalled(inst, now), loop_frozen=(inst.cluster, inst.name) in frozen,
            restarts=inst.restarts, restart_times_ns=tuple(inst.restart_times_ns),
            start_ns=owner.start_ns if owner is not None and owner.start_ns else None,
            heartbeat_age_s=(now - min(beats)) / 1e9 if beats else None,
            open_counts=dict(owner.open_counts) if owner is not None else {},
            open_total=open_total,
            finished_ok_recent=rules.finished_ok_since(inst, now - self.flow_window_ns),
            kv_used=owner.extra.get(c.H_KV_USED) if owner is not None else None,
            recorder=engine_health.recorder_totals(inst.ranks.values()),
            engine=owner.service if owner is not None else "",
            engine_version=owner.version if owner is not None else "",
            plugin_version=owner.plugin_version if owner is not None else "",
            plugin_state=plugin_state, plugin_refused=refused,
            ranks=tuple(self._rank(inc, now) for inc in sorted(inst.ranks.values(), key=lambda i: i.rank)),
        )

    @staticmethod
    def _rank(inc: Incarnation, now: int) -> Rank:
        return Rank(
            rank=inc.rank, incarnation=inc.id, pid=inc.pid, host=inc.host, start_ns=inc.start_ns,
            heartbeat_seq=inc.seq,
            heartbeat_age_s=(now - inc.last_heartbeat_ns) / 1e9 if inc.last_heartbeat_ns else None,
            up=rules.rank_up(inc, now), loop_iterations=inc.loop_iterations, loop_still_s=rules.loop_still_s(inc),
            loop_rule_s=rules.loop_rule_s(inc, now), idle_turn_s=inc.idle_turn_s, completed=inc.completed, failed=inc.failed,
            tokens_generated=inc.tokens_generated, open_total=inc.open_total,
            offset_s=round(inc.offset_ns() / 1e9, 3), gpu_uuids=inc.gpu_uuids, peer_ids=inc.peer_ids,
            engine=dict(inc.extra),
        )

    # ---- legs ------------------------------------------------------------------------------

    def _verdict(self, key: tuple[str, str], leg: Leg) -> LegVerdict | None:
        """The standing verdict on this leg: started over when the key names a new leg or the leg a new stage."""
        v = self.verdicts.get(key)
        if v is None:
            return None
        if v.leg is not leg:
            del self.verdicts[key]
            return None
        if v.entries != leg.entries:
            v.entries, v.stage, v.evidence, v.evidence_why, v.stuck_at_ns = leg.entries, None, None, "", None
        return v

    def _judge_legs(self, now: int, frozen: Frozen, states: dict[tuple[str, str], str]) -> JudgedLegs:
        t = self.tracker
        thresholds: dict[tuple[str, str, str], float] = {}
        groups: dict[tuple[str, str, str, str], list[Any]] = {}  # key -> [stuck, oldest age, evidence counts]
        stuck: list[StuckLeg] = []
        fresh: list[StuckLeg] = []
        stuck_legs: list[Leg] = []
        passed: PassedNow = {}
        for key, leg in t.open.items():
            stage = leg.stage
            v = self._verdict(key, leg)
            if stage is None or leg.stage_done:
                if v is not None:
                    v.stuck_at_ns = None
                continue
            tkey = (leg.cluster, leg.role, stage)
            thr = thresholds.get(tkey)
            if thr is None:
                thr = thresholds[tkey] = self.thresholds.threshold(tkey, now)
            age = rules.leg_age_s(leg, now)
            gkey = (leg.cluster, leg.role, stage, leg.pd_instance)
            group = groups.get(gkey)
            if group is None:
                group = groups[gkey] = [0, 0.0, {}]
            if age > group[1]:
                group[1] = age
            if states.get((leg.cluster, leg.pd_instance)) == c.STATE_DOWN and leg.inc is not None \
                    and leg.inc.last_heartbeat_ns:
                # Section 5 (v1.2): a down instance's own legs are no longer judged; the page for them is
                # the silent engine's, and its open_at_silence counts them. (An engine that never sent a
                # heartbeat never fell silent: its legs keep the threshold.)
                if v is not None:
                    v.stuck_at_ns = None
                continue
            if v is not None and v.stage != stage:
                v.evidence = None
            if v is None or v.evidence is None:
                found = self._evidence(leg, stage, now, frozen, age, passed)
                if found is not None:
                    if v is None:
                        v = self.verdicts[key] = LegVerdict(leg, leg.entries)
                    (v.evidence, v.evidence_why), v.stage = found, stage
            evidence = v.evidence if v is not None else None
            reason = evidence or (c.REASON_THRESHOLD if age > thr else None)
            if reason is None:
                if v is not None:
                    v.stuck_at_ns = None
                continue
            if v is None:
                v = self.verdicts[key] = LegVerdict(leg, leg.entries)
            why = v.evidence_why if evidence else f"in {stage} for {age:.0f} s, past its threshold of {thr:.0f} s"
            group[0] += 1
            if reason != c.REASON_THRESHOLD:
                group[2][reason] = group[2].get(reason, 0) + 1
            first = v.stuck_at_ns is None
            if first:
                v.stuck_at_ns = now
            view = self._stuck_view(leg, stage, age, thr, reason, why, v.stuck_at_ns or now)
            stuck.append(view)
            stuck_legs.append(leg)
            if first and not v.ever_stuck:
                v.ever_stuck = True
                skey = (leg.cluster, leg.role, stage)
                self.stuck_detected[skey] = self.stuck_detected.get(skey, 0) + 1
                fresh.append(view)
        # Verdicts on legs that ended (or were forgotten) go with them.
        for key in [k for k, v in self.verdicts.items() if t.open.get(k) is not v.leg]:
            del self.verdicts[key]
        for skey in t.samples.keys():
            if skey not in thresholds:
                thresholds[skey] = self.thresholds.threshold(skey, now)
        for inst in t.instances.values():
            for stage in c.STAGES[inst.role]:
                tkey = (inst.cluster, inst.role, stage)
                if tkey not in thresholds:
                    thresholds[tkey] = self.thresholds.threshold(tkey, now)
        self.thresholds.forget(set(t.samples.keys()))
        stuck.sort(key=lambda s: -s.age_s)
        out_groups = {k: Group(v[0], round(v[1], 3), v[2]) for k, v in groups.items()}
        return tuple(stuck), out_groups, thresholds, fresh, stuck_legs

    def _evidence(self, leg: Leg, stage: str, now: int, frozen: Frozen, age: float,
                  passed: PassedNow) -> tuple[str, str] | None:
        """(reason, the evidence in words) when the engines' reports prove the leg cannot progress."""
        if leg.error is not None and leg.listed_seq > leg.error_seq:
            return c.REASON_ENGINE_ERROR, f"the engine recorded {leg.error!r} and still lists the leg"
        ranks = frozen.get((leg.cluster, leg.pd_instance))
        if ranks:
            inc = ranks[0]
            return c.REASON_LOOP_FROZEN, (
                f"{leg.pd_instance} rank {inc.rank}: its loop has not advanced for "
                f"{rules.loop_still_s(inc):.1f} s with legs open while it keeps heartbeating "
                f"(rule {rules.loop_rule_s(inc, now):.1f} s)")
        if stage in _EVIDENCE_STAGES and leg.peer and len(self.gone_peers):
            interval_ns = (leg.inc.interval_s if leg.inc is not None else c.DEFAULT_HEARTBEAT_S) * 1e9
            offset = leg.inc.offset_ns() if leg.inc is not None else 0
            for peer in leg.peer.split(","):
                gone = self.gone_peers.get(leg.cluster, peer)
                # The leg talked to that process (entered its stage before the end) and an
                # inventory taken a heartbeat after the end still lists it.
                if gone is not None and leg.stage_since_ns + offset < gone.ended_ns \
                        and leg.listed_at_ns > gone.ended_ns + interval_ns:
                    return c.REASON_PEER_GONE, (
                        f"its peer {peer} was {gone.instance}'s process {gone.incarnation[:12]}, which ended "
                        f"{(now - gone.ended_ns) / 1e9:.0f} s ago; the leg is still listed")
        own = leg.inc
        # overtaken: most legs are turned away at once (young ones, those of unknown size), the rest by what
        # their process's passages through the stage allow, read once a tick for the first leg that asks.
        if leg.prompt_tokens is None or own is None or age <= c.OVERTAKEN_INTERVALS * own.interval_s:
            return None
        per_stage = passed.get(own)
        if per_stage is None:
            per_stage = passed[own] = {}
        p = per_stage.get(stage, _UNREAD)
        if p is _UNREAD:
            p = per_stage[stage] = self._passed(own, stage, leg.role)
        # The rule's own first tests, here to spare most of the rest a call: K entered after the leg, K as big.
        if p is None or leg.stage_since_ns >= p.kth_start or leg.prompt_tokens > p.kth_prompt or age <= p.least_rule_s:
            return None
        return self._overtaken(leg, own, p, leg.prompt_tokens, stage, age)

    def _overtaken(self, leg: Leg, inc: Incarnation, p: rules.Passed, prompt_tokens: int, stage: str,
                   age: float) -> tuple[str, str] | None:
        """Later legs at least as big went through the leg's stage on its instance while it waited (section 5b)."""
        # In bootstrap only the leg's own peer's legs count: one peer short of KV memory keeps its legs
        # waiting while another serves.
        peer = None
        if stage == "bootstrap":
            if not leg.peer:
                return None  # whose legs to count is unknown
            peer = leg.peer
        k = self.overtaken_k
        found = rules.overtaken(p, leg.stage_since_ns, prompt_tokens, peer, age, k=k, m=self.overtaken_m,
                                interval_s=inc.interval_s)
        if found is None:
            return None
        of_peer = f" of its peer {peer}" if peer is not None else ""
        return c.REASON_OVERTAKEN, (
            f"{found.overtakers} {leg.role} legs{of_peer} that entered {stage} on {leg.pd_instance} after it, with at "
            f"least its {prompt_tokens} prompt tokens, went through while it waited {age:.1f} s, past "
            f"max({c.OVERTAKEN_INTERVALS} heartbeats, {self.overtaken_m:g} x {found.longest_s:.3g} s, the longest of "
            f"the {k} quickest) = {found.rule_s:.1f} s")

    def _passed(self, inc: Incarnation, stage: str, role: str) -> rules.Passed | None:
        """The process's passages through the stage as the rule reads them; None where it does not judge."""
        kept = inc.passages.get(stage)
        if kept is None or len(kept) < self.overtaken_k or not rules.overtaken_applies(stage, inc.schedule_policy):
            return None
        t = self.tracker
        return rules.passed(kept, lambda tid: t.open.get((tid, role)) or t.closed.get((tid, role)),
                            k=self.overtaken_k, m=self.overtaken_m, interval_s=inc.interval_s)

    @staticmethod
    def _stuck_view(leg: Leg, stage: str, age: float, thr: float, reason: str, why: str,
                    stuck_since_ns: int) -> StuckLeg:
        inc = leg.inc
        return StuckLeg(
            trace_id=leg.trace_id, rid=leg.rid, room=leg.room, cluster=leg.cluster, role=leg.role, stage=stage,
            pd_instance=leg.pd_instance, peer=leg.peer, age_s=age, threshold_s=thr, reason=reason, why=why,
            stage_since_ns=leg.stage_since_ns, stuck_since_ns=stuck_since_ns, span_id=leg.span_id,
            offset_ns=inc.offset_ns() if inc is not None else 0, prompt_tokens=leg.prompt_tokens,
            error=leg.error, incarnation=inc.id if inc is not None else None, arrive_ns=leg.arrive_ns,
        )

    # ---- where they are blocked ---------------------------------------------------------------

    def _ask_for_stacks(self, stuck: tuple[StuckLeg, ...], frozen: Frozen) -> None:
        """An instance that just got stuck legs, or whose loop just froze: its ranks' stacks, once."""
        if self.capture is None or not self.capture.enabled:
            return
        now_stuck = {(s.cluster, s.pd_instance) for s in stuck}
        now_frozen = set(frozen)
        for key in sorted((now_stuck - self._had_stuck) | (now_frozen - self._had_frozen)):
            inst = self.tracker.instances.get(key)
            if inst is None:
                continue
            reason = "its scheduler loop froze" if key in now_frozen else "it has stuck legs"
            self.capture.want(inst.cluster, inst.name, reason,
                              [(inc.rank, inc.pid, inc.host) for inc in inst.ranks.values()])
        self._had_stuck, self._had_frozen = now_stuck, now_frozen

    # ---- what sets the stuck legs apart ----------------------------------------------------

    def _contrasts(self, stuck_legs: list[Leg], now: int) -> dict[str, list[Contrast]]:
        """Per cluster with stuck legs: the attributes that separate them from the legs that flowed."""
        if not stuck_legs:
            return {}
        t = self.tracker
        by_cluster: dict[str, list[Leg]] = {}
        for leg in stuck_legs:
            by_cluster.setdefault(leg.cluster, []).append(leg)
        flowing: dict[str, list[Leg]] = {name: [] for name in by_cluster}
        since, seen = now - self.flow_window_ns, 0
        for leg in reversed(t.closed.values()):  # newest ends first
            if leg.closed_at_ns < since or seen >= CONTRAST_FLOWING_MAX:
                break
            seen += 1
            if leg.outcome == "ok" and not leg.probe and leg.cluster in flowing:
                flowing[leg.cluster].append(leg)
        owners = {(inst.cluster, pid): inst.name for inst in t.instances.values()
                  for inc in inst.ranks.values() for pid in inc.peer_ids}
        out = {}
        for cluster, legs in by_cluster.items():
            restarts = {inst.name: inst.restart_times_ns[-1] / 1e9 for inst in t.instances.values()
                        if inst.cluster == cluster and inst.restart_times_ns}
            out[cluster] = contrast([self._facts(leg, now, owners) for leg in legs],
                                    [self._facts(leg, leg.closed_at_ns, owners) for leg in flowing[cluster]],
                                    restarts)
        return out

    def _facts(self, leg: Leg, at_ns: int, owners: dict[tuple[str, str], str]) -> LegFacts:
        """What the contrast knows of a leg, as of `at_ns` (its end for a finished leg, now for a stuck one)."""
        owner, ended = None, False
        for peer in (leg.peer or "").split(","):
            if not peer:
                continue
            gone = self.gone_peers.get(leg.cluster, peer)
            if gone is not None and gone.ended_ns <= at_ns:
                owner, ended = gone.instance, True
                break
            owner = owner or owners.get((leg.cluster, peer)) or (gone.instance if gone is not None else None)
        offset = leg.inc.offset_ns() if leg.inc is not None else 0
        arrived = arrival_ns(leg)
        return LegFacts(role=leg.role, pd_instance=leg.pd_instance, peer=leg.peer, peer_owner=owner, peer_ended=ended,
                        prompt_tokens=leg.prompt_tokens, arrived_s=(arrived + offset) / 1e9 if arrived else None,
                        error=leg.error is not None)

    # ---- GPUs and counters -------------------------------------------------------------------

    def _gpus(self, instances: tuple[InstanceView, ...]
              ) -> tuple[tuple[GpuView, ...], bool, str | None, str | None, float | None]:
        if self.gpu is None:
            return (), False, "no GPU sampler", None, None
        snap = self.gpu.snapshot()
        if not snap.up:
            return (), False, snap.reason, snap.driver, snap.sampled_at
        # What each engine process says it drives, freshest heartbeat first (the first claim wins).
        ranks = sorted(((i, r) for i in instances for r in i.ranks), key=lambda p: p[1].heartbeat_age_s or 0.0)
        claims = [InstanceClaim(Owner(i.cluster, i.role, i.name), r.gpu_uuids, (r.pid,) if r.pid else ())
                  for i, r in ranks]
        joined = tuple(GpuView(dev, owner, how) for dev, owner, how in self.owners.join(snap.devices, claims))
        return joined, True, None, snap.driver, snap.sampled_at

    def _counters(self) -> Counters:
        t = self.tracker
        refused = t.samples.keys_refused + t.durations.refused
        return Counters(
            spans_received=t.spans_received, spans_foreign=t.spans_foreign, spans_rejected=dict(t.rejected),
            duplicates=t.duplicates, heartbeats=t.heartbeats_received, tracked_legs=len(t.open),
            tracked_instances=len(t.instances), evicted=dict(t.evicted), instances_expired=t.instances_expired,
            finished=dict(t.finished), probes_finished=dict(t.probes_finished),
            stuck_detected=dict(self.stuck_detected), label_sets_refused=refused, gone_peers=len(self.gone_peers),
        )

    # ---- one request, asked for by the API ---------------------------------------------------

    def request_view(self, trace_id: str) -> RequestView | None:
        """Both legs of one request as the judge sees them now (on the tracker's thread), or None."""
        t = self.tracker
        now = t.clock()
        stuck = {s.role: s for s in self.latest.stuck if s.trace_id == trace_id}
        legs = []
        for role in c.ROLES:
            leg = t.open.get((trace_id, role)) or t.closed.get((trace_id, role))
            if leg is not None:
                legs.append(self._detail(leg, now, stuck.get(role)))
        return RequestView(trace_id, tuple(legs)) if legs else None

    @staticmethod
    def _detail(leg: Leg, now: int, stuck: StuckLeg | None) -> LegDetail:
        is_open = leg.outcome is None and leg.end_ns is None
        return LegDetail(
            role=leg.role, rid=leg.rid, room=leg.room, cluster=leg.cluster, pd_instance=leg.pd_instance,
            incarnation=leg.inc.id if leg.inc is not None else None, peer=leg.peer, span_id=leg.span_id,
            open=is_open, outcome=leg.outcome, arrive_ns=leg.arrive_ns, end_ns=leg.end_ns, tokens=leg.tokens,
            prompt_tokens=leg.prompt_tokens, stages=tuple(StageRun(*run) for run in stage_history(leg)),
            stage=leg.stage if is_open else None, stage_since_ns=leg.stage_since_ns if is_open else None,
            age_s=rules.leg_age_s(leg, now) if is_open else None, error=leg.error,
            stuck=stuck if is_open else None,
        )


__all__ = ["Judge"]
