"""The one writer: applies decoded records (`spans.decode`) to the state of every
engine instance and open leg.

It keeps facts only: what arrived, when (on the sidecar's clock), and
counters. Whether any of it is late, down, frozen or stuck is the judge's to
say (`judge.py`, `rules.py`), on the same thread; the judge reads these
objects and never writes them, and readers see only its immutable
`Evaluation`. Records may arrive late, twice or out of order: each rule below
says what it does with one that tells it nothing new.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import NamedTuple

from pdwatch import contract as c

from .durations import StageDurations
from .model import (
    IDLE_TURNS_TO_TRUST,
    LOOP_STALL_WINDOW_NS,
    PASSAGE_STAGES,
    Cluster,
    Incarnation,
    Instance,
    Leg,
    Retirement,
    record_passage,
    record_stage,
)
from .samples import StageSamples
from .settings import Settings
from .spans import (
    REASONS,
    Batch,
    Decoded,
    HeartbeatRecord,
    Inventory,
    LegRecord,
    Rejection,
    Source,
    StageRecord,
    room_of,
)

STAGE_INDEX = {role: {s: i for i, s in enumerate(stages)} for role, stages in c.STAGES.items()}
# role -> stage -> (its place in the role's order, the stage that follows it or None)
_STEPS = {role: {s: (i, stages[i + 1] if i + 1 < len(stages) else None) for i, s in enumerate(stages)}
          for role, stages in c.STAGES.items()}
_SEEN_SPANS_MAX = 100_000
_RESTART_TIMES_MAX = 32
# Restarts remembered for the judge, which reads those since its last tick (a few per tick at most).
_RETIREMENTS_MAX = 4096
# Largest engine-to-sidecar clock difference a heartbeat may show (see _heartbeat).
MAX_SKEW_NS = 86_400 * 10**9

# One batch's stage durations: stage -> (seconds, trace ids), for thresholds and the histogram.
Durations = dict[str, tuple[list[float], list[str]]]


class Applied(NamedTuple):
    """What one OTLP request did to the tracker."""

    rejected: int  # spans not applied (partial_success.rejected_spans)
    messages: list[str]  # a few of the reasons, for partial_success.error_message


class Tracker:
    def __init__(self, limits: Limits | None = None, *, clock: Callable[[], int] = time.time_ns):
        limits = limits or Limits.of(Settings.model_construct())  # the settings' defaults
        self.limits = limits
        self.max_open = limits.max_open_legs
        self.max_closed = limits.max_closed_legs
        self.max_instances = limits.max_instances
        self.recent_ns = int(limits.recent_s * 1e9)
        self.clock = clock
        self.samples = StageSamples()  # recent stage durations, for the judge's thresholds
        self.durations = StageDurations()  # all stage durations, for the histogram
        self.open: dict[tuple[str, str], Leg] = {}
        self.closed: OrderedDict[tuple[str, str], Leg] = OrderedDict()
        self.instances: dict[tuple[str, str], Instance] = {}
        self.clusters: dict[str, Cluster] = {}
        self.retirements: deque[Retirement] = deque(maxlen=_RETIREMENTS_MAX)
        self.retired_total = 0  # retirements ever logged: the judge reads those past its last count
        # Span ids applied, for replays: a set to ask, and the same ids oldest first to forget by
        # (cheaper on the hot path than one ordered dict doing both).
        self._seen_spans: set[bytes] = set()
        self._seen_order: deque[bytes] = deque()
        # Monotonic counters, copied into each Evaluation by the judge.
        self.spans_received = 0
        self.spans_foreign = 0
        self.heartbeats_received = 0
        self.duplicates = 0
        self.rejected = dict.fromkeys(REASONS, 0)
        self.evicted: dict[str, int] = {"open_limit": 0, "closed_limit": 0, "vanished": 0, "instance_gone": 0}
        self.instances_expired = 0
        self.finished: dict[tuple[str, str, str, str], int] = {}  # (cluster, role, pd_instance, outcome)
        # Probes apart: a health check finishing is no request flowing.
        self.probes_finished: dict[tuple[str, str, str, str], int] = {}

    # ---- ingest ------------------------------------------------------------

    def apply(self, decoded: Decoded) -> Applied:
        """Apply one decoded OTLP request: how many spans were rejected, and a few reasons why."""
        rejected = 0
        messages: list[str] = []
        now = self.clock()
        self.spans_received += decoded.spans
        self.spans_foreign += decoded.foreign
        for batch in decoded.batches:
            for reason, message in batch.rejected:
                rejected += 1
                self.rejected[reason] += 1
                if len(messages) < 8:
                    messages.append(message)
            if batch.source is None:
                continue
            n = len(batch.stages) + len(batch.legs) + len(batch.heartbeats)
            try:
                inc = self._incarnation(batch.source, now)
            except Rejection as rej:
                rejected += n
                self.rejected[rej.reason] += n
                messages.append(rej.message)
                continue
            bad = self._apply_batch(batch, inc, now)
            for reason, message in bad:
                rejected += 1
                self.rejected[reason] += 1
                if len(messages) < 8:
                    messages.append(message)
        return Applied(rejected, messages)

    def _apply_batch(self, batch: Batch, inc: Incarnation, now: int) -> list[tuple[str, str]]:
        src = batch.source
        assert src is not None
        bad: list[tuple[str, str]] = []
        durations: Durations = {stage: ([], []) for stage in c.STAGES[src.role]}
        try:
            self._stages(src, inc, batch.stages, now, durations)
            for leg in batch.legs:
                self._leg_span(src, inc, leg, now)
            for hb in batch.heartbeats:
                try:
                    self._heartbeat(src, inc, hb, now)
                except Rejection as rej:
                    bad.append((rej.reason, rej.message))
        finally:
            self._observe(src, durations, now)
        return bad

    def _observe(self, src: Source, durations: Durations, now: int) -> None:
        """Hand one batch's stage durations to the thresholds and the histogram, a stage at a time."""
        for stage, (seconds, trace_ids) in durations.items():
            if not seconds:
                continue
            self.samples.observe_many((src.cluster, src.role, stage), seconds, now)
            self.durations.observe_many(src.cluster, src.role, stage, seconds, trace_ids)

    def _seen(self, span_id: bytes) -> bool:
        """True if this span was applied before (replays and retries change nothing twice)."""
        seen = self._seen_spans
        if span_id in seen:
            return True
        seen.add(span_id)
        order = self._seen_order
        order.append(span_id)
        if len(order) > _SEEN_SPANS_MAX:
            seen.remove(order.popleft())
        return False

    def _incarnation(self, src: Source, now: int) -> Incarnation:
        key = (src.cluster, src.pd_instance)
        inst = self.instances.get(key)
        if inst is None:
            if len(self.instances) >= self.max_instances:
                raise Rejection("instance_limit", f"more than {self.max_instances} instances; {key} refused")
            inst = self.instances[key] = Instance(src.cluster, src.pd_instance, src.role)
            self.clusters.setdefault(src.cluster, Cluster(src.cluster))
        inst.role = src.role
        cur = inst.ranks.get(src.tp_rank)
        if cur is not None and cur.id == src.incarnation:
            cur.last_seen_ns = now
            if src.peer_ids and src.peer_ids != cur.peer_ids:
                cur.peer_ids = src.peer_ids  # names a process learns after start-up (its KV agent)
            return cur
        if cur is not None:
            if src.incarnation in inst.retired or (src.start_ns and src.start_ns < cur.start_ns):
                raise Rejection("stale_incarnation",
                                f"{src.pd_instance} rank {src.tp_rank}: spans from a replaced process")
            self._retire(inst, cur, now)
        new = Incarnation(
            id=src.incarnation, rank=src.tp_rank, tp_size=src.tp_size, start_ns=src.start_ns, pid=src.pid,
            host=src.host, gpu_uuids=src.gpu_uuids, service=src.service, version=src.version,
            plugin_version=src.plugin_version,
            first_seen_ns=now, last_seen_ns=now, peer_ids=src.peer_ids, schedule_policy=src.schedule_policy,
        )
        inst.ranks[src.tp_rank] = new
        return new

    def _retire(self, inst: Instance, old: Incarnation, now: int) -> None:
        """A new process under the same pd.instance: the old one's open legs are lost, not stuck,
        and whoever still talks to its peer ids talks to nobody (the judge reads the log)."""
        inst.retired.append(old.id)
        self.retirements.append(Retirement(inst.cluster, inst.name, old, now))
        self.retired_total += 1
        if old.rank == min(inst.ranks):
            inst.restarts += 1
            inst.restart_times_ns.append(now)
            del inst.restart_times_ns[:-_RESTART_TIMES_MAX]
        for key in list(old.keys):
            leg = self.open.pop(key, None)
            if leg is not None and leg.inc is old:
                self._close(leg, c.OUTCOME_LOST, leg.stage_since_ns, now)
        old.keys.clear()

    # ---- legs ----------------------------------------------------------------

    def _new_leg(self, key: tuple[str, str], src: Source, inc: Incarnation) -> Leg | None:
        if len(self.open) >= self.max_open:
            # Full: refuse the newcomer rather than drop an old leg, because the
            # old ones are the stuck candidates (inventories list oldest first).
            self.evicted["open_limit"] += 1
            return None
        leg = Leg(trace_id=key[0], role=key[1], cluster=src.cluster, pd_instance=src.pd_instance, inc=inc)
        self.open[key] = leg
        inc.keys.add(key)
        return leg

    def _adopt(self, leg: Leg, key: tuple[str, str], src: Source, inc: Incarnation) -> None:
        """A leg reported by another process than the one we had (a retry, a migration): latest wins."""
        if leg.inc is not inc:
            if leg.inc is not None:
                leg.inc.keys.discard(key)
            leg.inc, leg.cluster, leg.pd_instance = inc, src.cluster, src.pd_instance
            inc.keys.add(key)

    def _remember_closed(self, key: tuple[str, str], leg: Leg) -> None:
        self.closed[key] = leg
        self.closed.move_to_end(key)
        if len(self.closed) > self.max_closed:
            self.closed.popitem(last=False)
            self.evicted["closed_limit"] += 1

    def _close(self, leg: Leg, outcome: str | None, end_ns: int, now: int) -> None:
        key = (leg.trace_id, leg.role)
        if leg.inc is not None:
            leg.inc.keys.discard(key)
        leg.outcome, leg.end_ns, leg.closed_at_ns = outcome, end_ns, now
        self._remember_closed(key, leg)
        if outcome is None:
            return
        fkey = (leg.cluster, leg.role, leg.pd_instance, outcome)
        if leg.probe:
            self.probes_finished[fkey] = self.probes_finished.get(fkey, 0) + 1
            return
        self.finished[fkey] = self.finished.get(fkey, 0) + 1
        if outcome == "ok":
            cluster = self.clusters.get(leg.cluster)
            if cluster is None:
                cluster = self.clusters[leg.cluster] = Cluster(leg.cluster)
            cluster.last_ok_ns = max(cluster.last_ok_ns, now)
            inst = self.instances.get((leg.cluster, leg.pd_instance))
            if inst is not None:
                times = inst.ok_times_ns
                while times and times[0] < now - self.recent_ns:
                    times.popleft()  # kept for about the flow window: older ones count for nothing
                times.append(now)

    def _leg_span(self, src: Source, inc: Incarnation, rec: LegRecord, now: int) -> None:
        """A leg ended: one per leg."""
        if self._seen(rec.span_id):
            self.duplicates += 1
            return
        trace_id = rec.trace_id.hex()
        key = (trace_id, rec.role)
        leg = self.open.pop(key, None)
        if leg is None:
            leg = self.closed.get(key)
            if leg is not None and leg.outcome is not None:
                self.duplicates += 1  # this leg already ended (same leg, resent with a new id)
                return
            if leg is None:
                leg = Leg(trace_id=trace_id, role=rec.role, cluster=src.cluster, pd_instance=src.pd_instance,
                          inc=inc)
        if rec.rid:
            leg.rid = rec.rid
        if rec.room is not None:
            leg.room = rec.room
        if rec.peer:
            leg.peer = rec.peer
        if rec.probe:
            leg.probe = True
        if rec.prompt_tokens is not None:
            leg.prompt_tokens = rec.prompt_tokens
        if rec.output_tokens is not None:
            leg.tokens = max(leg.tokens, rec.output_tokens)
        if rec.error:
            leg.error = rec.error  # it may never have been listed open: legs shorter than a heartbeat
        leg.span_id = rec.span_id.hex()
        leg.arrive_ns = rec.start_ns
        self._close(leg, rec.outcome, rec.end_ns, now)

    def _stages(self, src: Source, inc: Incarnation, records: list[StageRecord], now: int,
                durations: Durations) -> None:
        """One batch's finished stages, in order: the bulk of all records, so one loop with its lookups
        made once rather than a call per record."""
        seen, order, opened, closed = self._seen_spans, self._seen_order, self.open, self.closed
        role = src.role
        steps, stage_index = _STEPS[role], STAGE_INDEX[role]
        for tid, sid, parent, stage, start, end, error, span in records:
            if sid in seen:
                self.duplicates += 1
                continue
            seen.add(sid)  # as _seen does, without a call per record
            order.append(sid)
            if len(order) > _SEEN_SPANS_MAX:
                seen.remove(order.popleft())
            trace_id = tid.hex()
            key = (trace_id, role)
            leg = opened.get(key) or closed.get(key)
            if leg is None:
                leg = self._new_leg(key, src, inc)
                if leg is not None:
                    leg.room = room_of(span)
            if error is None:
                batch = durations[stage]
                batch[0].append((end - start) / 1e9)
                batch[1].append(trace_id)
            if leg is None:
                continue
            if leg.span_id is None and parent:
                leg.span_id = parent.hex()
            here, following = steps[stage]
            record_stage(leg, stage, start, end, error)
            if error is None and stage in PASSAGE_STAGES:  # the facts the overtaken rule reads
                record_passage(inc, stage, start, end, trace_id)
            if leg.end_ns is not None:
                continue  # closed already: history only
            # The end of one stage is the start of the next: move an open leg on
            # unless a newer heartbeat already put it further along.
            if leg.stage is not None and stage_index.get(leg.stage, -1) > here:
                continue
            if error is not None or following is None:
                if leg.stage != stage:
                    leg.enter(stage, start)
                leg.stage_since_ns, leg.stage_done = start, True
            elif leg.stage != following or leg.stage_since_ns != end:
                leg.enter(following, end)

    # ---- heartbeats ----------------------------------------------------------

    def _heartbeat(self, src: Source, inc: Incarnation, hb: HeartbeatRecord, now: int) -> None:
        if hb.seq <= inc.seq:
            self.duplicates += 1  # a replay or an old heartbeat arriving late
            return
        if abs(now - hb.end_ns) > MAX_SKEW_NS:
            # Minutes of skew are corrected; a day is a broken clock or a forged time,
            # and taking it as the offset would make every age of this process wrong.
            raise Rejection("bad_value", f"pd.heartbeat time is more than {MAX_SKEW_NS // 10**9} s from the sidecar's")
        self.heartbeats_received += 1
        inc.seq = hb.seq
        inc.last_heartbeat_ns = now
        inc.offsets.append(now - hb.end_ns)
        if hb.interval_s is not None:
            inc.interval_s = hb.interval_s
        # The loop turned while idle only if nothing was served between the two heartbeats: both
        # inventories empty and no leg ended meanwhile (legs that come and go within one interval
        # are never listed, and a loop that turns only for them blocks when idle, as vLLM's does).
        ended = sum(hb.counters.get(k, 0) - getattr(inc, k) for k in ("completed", "failed"))
        idle = self._idle(src) and ended == 0 and (hb.inventory is None or hb.inventory.total == 0)
        self._loop(src, inc, hb.loop_iterations, now, idle)
        if hb.loop_idle_turn_s is not None:
            inc.idle_turn_s = hb.loop_idle_turn_s
        for name, value in hb.counters.items():
            setattr(inc, name, value)
        if hb.extra:
            inc.extra = hb.extra
        if hb.plugin_state is not None:
            inc.plugin_state = hb.plugin_state
            inc.plugin_refused = hb.plugin_refused or ()
        if hb.recorder:
            inc.recorder = hb.recorder
        if hb.open_counts or hb.inventory is not None:
            inc.open_counts = hb.open_counts
        if hb.inventory is not None:
            inc.open_total = hb.inventory.total
            if hb.inventory.total == 0:
                inc.busy_since_ns = 0
            elif not inc.busy_since_ns:
                inc.busy_since_ns = now
            self._apply_inventory(src, inc, hb.start_ns, hb.seq, hb.inventory, now)
        inc.final_ns = now if hb.final else 0
        if hb.final:
            self._depart(inc, now)

    def _loop(self, src: Source, inc: Incarnation, loop: int | None, now: int, idle: bool) -> None:
        """Track how long the loop counter was seen unchanged, and remember busy stalls."""
        if loop is None:
            return
        if loop != inc.loop_iterations:
            stalled = (inc.loop_seen_ns - inc.loop_since_ns) / 1e9 if inc.loop_since_ns else 0.0
            if stalled > 0:
                window = inc.stalls if self._busy_during(src, inc) else inc.idle_stalls
                window.append((now, stalled))
                while window and window[0][0] < now - LOOP_STALL_WINDOW_NS:
                    window.popleft()
            if inc.loop_iterations is not None:
                inc.loop_moves = True
                inc.idle_turns = inc.idle_turns + 1 if idle else 0
                inc.turns_idle = inc.turns_idle or inc.idle_turns >= IDLE_TURNS_TO_TRUST
            inc.loop_iterations, inc.loop_since_ns = loop, now
        else:
            inc.idle_turns = 0
        inc.loop_seen_ns = now

    def _idle(self, src: Source) -> bool:
        """The instance listed no open legs in its latest inventory."""
        inst = self.instances.get((src.cluster, src.pd_instance))
        owner = inst.owner if inst is not None else None
        return owner is not None and owner.open_total == 0

    def _busy_during(self, src: Source, inc: Incarnation) -> bool:
        """The rank's instance had open legs over its latest loop stall."""
        inst = self.instances.get((src.cluster, src.pd_instance))
        owner = inst.owner if inst is not None else None
        return owner is not None and bool(owner.busy_since_ns) and owner.busy_since_ns <= inc.loop_since_ns

    def _apply_inventory(self, src: Source, inc: Incarnation, hb_ns: int, seq: int, inventory: Inventory,
                         now: int) -> None:
        role, order = src.role, STAGE_INDEX[src.role]
        for e in inventory.entries:
            key = (e.trace_id, role)
            leg = self.open.get(key)
            if leg is None:
                old = self.closed.get(key)
                if old is not None and old.outcome is not None:
                    continue  # already finished: this heartbeat is older news
                leg = self._new_leg(key, src, inc)
                if leg is None:
                    continue
                if old is not None:  # judged vanished too early (a cut list): it is open after all
                    del self.closed[key]
                    leg.history, leg.errors, leg.probe = old.history, old.errors, old.probe
                    leg.rid, leg.room, leg.peer = old.rid, old.room, old.peer
            else:
                self._adopt(leg, key, src, inc)
            if e.rid:
                leg.rid = e.rid
            if e.span_id is not None:
                leg.span_id = e.span_id
            if e.room >= 0:
                leg.room = e.room
            if e.peer:
                leg.peer = e.peer
            if e.probe:
                leg.probe = True
            if e.prompt_tokens >= 0:
                leg.prompt_tokens = e.prompt_tokens
            if leg.stage != e.stage:
                if leg.stage is None or e.since_ns >= leg.stage_since_ns or order[e.stage] > order.get(leg.stage, -1):
                    leg.enter(e.stage, e.since_ns)
            elif e.since_ns > leg.stage_since_ns:
                leg.stage_since_ns = e.since_ns
                leg.progress_ns = max(leg.progress_ns, e.since_ns)
            if e.tokens > leg.tokens:
                leg.tokens = e.tokens
                # New tokens: the decode was alive when the last of them came. An
                # engine that does not say when (no last-token list) is taken as
                # alive at this heartbeat, which can only age it too little.
                alive_at = min(e.last_token_ns, hb_ns) if e.last_token_ns else hb_ns
                leg.progress_ns = max(leg.progress_ns, alive_at)
            if e.error:
                if e.error != leg.error:
                    leg.error, leg.error_seq = e.error, seq
            elif leg.error is not None:
                leg.error, leg.error_seq = None, -1
            leg.listed_seq, leg.listed_at_ns = seq, now
        # Legs this process no longer lists have ended; their leg span was lost
        # or is late. When the lists were cut, only legs older than the newest
        # listed one can be judged.
        entries = inventory.entries
        cutoff = hb_ns if inventory.complete else min(hb_ns, entries[-1].since_ns - 1 if entries else -1)
        for key in list(inc.keys):
            leg = self.open.get(key)
            if leg is None or leg.inc is not inc:
                inc.keys.discard(key)
                continue
            if leg.listed_seq != seq and leg.stage_since_ns <= cutoff:
                del self.open[key]
                self.evicted["vanished"] += 1
                self._close(leg, None, hb_ns, hb_ns)

    def _depart(self, inc: Incarnation, now: int) -> None:
        """A process that left in order (its final heartbeat): what it still held will never finish,
        and is lost rather than stuck (contract section 5, v1.2)."""
        for key in list(inc.keys):
            leg = self.open.get(key)
            if leg is not None and leg.inc is inc:
                del self.open[key]
                self._close(leg, c.OUTCOME_LOST, leg.stage_since_ns, now)
        inc.keys.clear()

    # ---- forgetting (the judge decides when) -----------------------------------

    def forget_instance(self, key: tuple[str, str], outcome: str | None = None) -> Instance | None:
        """Forget an instance the judge found past its TTL (its open legs vanish) or down too long (they
        end with `outcome`, lost), with its counts.

        An instance that was scaled away or renamed never sends the heartbeat
        that would end its legs: without this, its legs, counters and label
        sets would stay forever and its slot would count against the cap.
        """
        inst = self.instances.pop(key, None)
        if inst is None:
            return None
        now = self.clock()
        for inc in inst.ranks.values():
            for leg_key in list(inc.keys):
                leg = self.open.get(leg_key)
                if leg is not None and leg.inc is inc:
                    del self.open[leg_key]
                    self.evicted["instance_gone"] += 1
                    self._close(leg, outcome, leg.stage_since_ns, now)
            inc.keys.clear()
        for counts in (self.finished, self.probes_finished):
            for fkey in [k for k in counts if k[0] == inst.cluster and k[2] == inst.name]:
                del counts[fkey]
        if not any(other.cluster == inst.cluster for other in self.instances.values()):
            self.clusters.pop(inst.cluster, None)
        self.instances_expired += 1
        return inst


class Limits(NamedTuple):
    """How much the tracker keeps, from the sidecar's settings."""

    max_open_legs: int
    max_closed_legs: int
    max_instances: int
    recent_s: float  # how long recent ok finishes are kept per instance: the flow window

    @classmethod
    def of(cls, settings: Settings) -> Limits:
        return cls(settings.max_open_legs, settings.max_closed_legs, settings.max_instances, settings.flow_window_s)
