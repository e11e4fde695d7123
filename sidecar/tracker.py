"""Tracks every open leg from lifecycle spans and heartbeat inventories, and
judges which are stuck (contract section 5).

All state changes happen under one lock, one OTLP request at a time; readers
(API, metrics) take the same lock briefly. Spans may arrive late, twice, or out
of order: each rule below says what it does with a span that tells it nothing new.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable, NamedTuple

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from pdwatch import contract as c

from .model import Cluster, Evaluation, Incarnation, Instance, Leg, StuckLeg, record_stage
from .spans import (
    REASONS, STAGE_SPANS, Heartbeat, Rejection, Source, attributes, finite, ids_and_times, is_int, iter_batches,
    read_heartbeat, room_of,
)
from .thresholds import StageThresholds

_STAGE_INDEX = {role: {s: i for i, s in enumerate(stages)} for role, stages in c.STAGES.items()}
# role -> stage -> (its place in the role's order, the stage that follows it or None)
_STEPS = {role: {s: (i, stages[i + 1] if i + 1 < len(stages) else None) for i, s in enumerate(stages)}
          for role, stages in c.STAGES.items()}
_SEEN_SPANS_MAX = 100_000
_STATUS_ERROR = Status.STATUS_CODE_ERROR
_RESTART_TIMES_MAX = 32
# Largest engine-to-sidecar clock difference a heartbeat may show (see _heartbeat).
MAX_SKEW_NS = 86_400 * 10**9


def _is_hex(value, length: int) -> bool:
    if not isinstance(value, str) or len(value) != length:
        return False
    try:
        int(value, 16)
    except ValueError:
        return False
    return value == value.lower()


class Applied(NamedTuple):
    """What one OTLP request did to the tracker."""

    rejected: int  # spans not applied (partial_success.rejected_spans)
    messages: list[str]  # a few of the reasons, for partial_success.error_message
    other: int  # spans that are not stage or leg spans: heartbeats, unknown names, refused resources


class Tracker:
    def __init__(
        self,
        floors: dict[str, float] | None = None,
        *,
        flow_window_s: float = c.DEFAULT_FLOW_WINDOW_S,
        max_open_legs: int = 200_000,
        max_closed_legs: int = 50_000,
        max_instances: int = 1024,
        instance_ttl_s: float = 3600.0,
        clock: Callable[[], int] = time.time_ns,
        on_stage_durations: Callable[[str, str, str, list, list], None] | None = None,
        on_stuck: Callable[[Leg, float, float, int], None] | None = None,
    ):
        self.thresholds = StageThresholds(floors or c.DEFAULT_FLOORS_S)
        self.flow_window_ns = int(flow_window_s * 1e9)
        self.max_open = max_open_legs
        self.max_closed = max_closed_legs
        self.max_instances = max_instances
        self.instance_ttl_ns = int(instance_ttl_s * 1e9)
        self.clock = clock
        self.on_stage_durations = on_stage_durations
        self.on_stuck = on_stuck
        self.lock = threading.RLock()
        self.open: dict[tuple[str, str], Leg] = {}
        self.closed: OrderedDict[tuple[str, str], Leg] = OrderedDict()
        self.instances: dict[tuple[str, str], Instance] = {}
        self.clusters: dict[str, Cluster] = {}
        self._seen_spans: OrderedDict[bytes, None] = OrderedDict()
        # Monotonic counters, exposed by the metrics collector.
        self.spans_received = 0
        self.heartbeats_received = 0
        self.duplicates = 0
        self.rejected = dict.fromkeys(REASONS, 0)
        self.evicted: dict[str, int] = {"open_limit": 0, "closed_limit": 0, "vanished": 0, "instance_gone": 0}
        self.instances_expired = 0
        self.finished: dict[tuple[str, str, str, str], int] = {}  # (cluster, role, pd_instance, outcome)
        # Probes apart: a health check finishing is no request flowing.
        self.probes_finished: dict[tuple[str, str, str, str], int] = {}
        self.stuck_detected: dict[tuple[str, str, str], int] = {}
        self.last_eval = Evaluation(0, [], {}, {}, {})
        self.ingests = 0  # OTLP requests applied; tells whether last_eval still holds
        self._eval_after = -1  # self.ingests when last_eval was made

    # ---- ingest ------------------------------------------------------------

    def ingest(self, request: ExportTraceServiceRequest) -> Applied:
        """Apply one OTLP request: what was rejected and why, and how many spans were not lifecycle spans."""
        rejected, messages, other = 0, [], 0
        with self.lock:
            self.ingests += 1
            now = self.clock()
            for source, spans in iter_batches(request):
                self.spans_received += len(spans)
                if isinstance(source, Rejection):
                    rejected += len(spans)
                    other += len(spans)
                    self.rejected[source.reason] += len(spans)
                    messages.append(source.message)
                    continue
                try:
                    inc = self._incarnation(source, now)
                except Rejection as rej:
                    rejected += len(spans)
                    other += len(spans)
                    self.rejected[rej.reason] += len(spans)
                    messages.append(rej.message)
                    continue
                durations = {stage: ([], []) for stage in c.STAGES[source.role]}
                try:
                    for proto in spans:
                        try:
                            name = proto.name
                            stage = STAGE_SPANS.get(name)
                            if stage is not None:
                                self._stage(source, inc, proto, stage, now, durations)
                            elif name == c.SPAN_LEG:
                                self._leg_span(source, inc, proto, now)
                            else:
                                other += 1
                                self._heartbeat(source, inc, read_heartbeat(proto), now)
                        except Rejection as rej:
                            rejected += 1
                            self.rejected[rej.reason] += 1
                            if len(messages) < 8:
                                messages.append(rej.message)
                finally:
                    self._observe(source, durations, now)
        return Applied(rejected, messages, other)

    def _observe(self, src: Source, durations: dict, now: int) -> None:
        """Hand one batch's stage durations to the thresholds and the histogram, a stage at a time.

        Batched because two calls per span cost as much as the rest of a stage span.
        """
        for stage, (seconds, trace_ids) in durations.items():
            if not seconds:
                continue
            self.thresholds.observe_many((src.cluster, src.role, stage), seconds, now)
            if self.on_stage_durations is not None:
                self.on_stage_durations(src.cluster, src.role, stage, seconds, trace_ids)

    def _seen(self, span_id: bytes) -> bool:
        """True if this span was applied before (replays and retries change nothing twice).

        Keyed by the raw 8-byte span id for every kind of span, as `_stage` does inline.
        """
        seen = self._seen_spans
        if span_id in seen:
            return True
        seen[span_id] = None
        if len(seen) > _SEEN_SPANS_MAX:
            seen.popitem(last=False)
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
            return cur
        if cur is not None:
            if src.incarnation in inst.retired or (src.start_ns and src.start_ns < cur.start_ns):
                raise Rejection("stale_incarnation",
                                f"{src.pd_instance} rank {src.tp_rank}: spans from a replaced process")
            self._retire(inst, cur, now)
        new = Incarnation(
            id=src.incarnation, rank=src.tp_rank, tp_size=src.tp_size, start_ns=src.start_ns, pid=src.pid,
            host=src.host, gpu_uuids=src.gpu_uuids, service=src.service, version=src.version,
            first_seen_ns=now, last_seen_ns=now,
        )
        inst.ranks[src.tp_rank] = new
        return new

    def _retire(self, inst: Instance, old: Incarnation, now: int) -> None:
        """A new process under the same pd.instance: the old one's open legs are lost, not stuck."""
        inst.retired.append(old.id)
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

    def _adopt(self, leg: Leg, key, src: Source, inc: Incarnation) -> None:
        """A leg reported by another process than the one we had (a retry, a migration): latest wins."""
        if leg.inc is not inc:
            if leg.inc is not None:
                leg.inc.keys.discard(key)
            leg.inc, leg.cluster, leg.pd_instance = inc, src.cluster, src.pd_instance
            inc.keys.add(key)

    def _remember_closed(self, key, leg: Leg) -> None:
        self.closed[key] = leg
        self.closed.move_to_end(key)
        if len(self.closed) > self.max_closed:
            self.closed.popitem(last=False)
            self.evicted["closed_limit"] += 1

    def _close(self, leg: Leg, outcome: str | None, end_ns: int, now: int) -> None:
        key = (leg.trace_id, leg.role)
        if leg.inc is not None:
            leg.inc.keys.discard(key)
        leg.outcome, leg.end_ns, leg.stuck_at_ns = outcome, end_ns, None
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
                inst.ok_times_ns.append(now)

    def _leg_span(self, src: Source, inc: Incarnation, span, now: int) -> None:
        """A leg ended: one per leg, read off the protobuf like a stage span (ids stay bytes until needed)."""
        tid, sid, _, start, end = ids_and_times(span)
        attrs = attributes(span.attributes)
        role = attrs.get(c.A_ROLE) or src.role
        outcome = attrs.get(c.A_OUTCOME)
        if outcome is None:
            raise Rejection("missing_attribute", f"pd.request without {c.A_OUTCOME}")
        if role not in c.ROLES or outcome not in c.OUTCOMES:
            raise Rejection("bad_value", f"pd.request with role {role!r}, outcome {outcome!r}")
        if self._seen(sid):
            self.duplicates += 1
            return
        trace_id = tid.hex()
        key = (trace_id, role)
        leg = self.open.pop(key, None)
        if leg is None:
            leg = self.closed.get(key)
            if leg is not None and leg.outcome is not None:
                self.duplicates += 1  # this leg already ended (same leg, resent with a new id)
                return
            if leg is None:
                leg = Leg(trace_id=trace_id, role=role, cluster=src.cluster, pd_instance=src.pd_instance, inc=inc)
        self._fill(leg, attrs)
        leg.span_id = sid.hex()
        leg.arrive_ns = start
        tokens = attrs.get(c.A_OUTPUT_TOKENS)
        if is_int(tokens):
            leg.tokens = max(leg.tokens, tokens)
        self._close(leg, outcome, end, now)

    @staticmethod
    def _fill(leg: Leg, attrs: dict) -> None:
        rid = attrs.get(c.A_RID)
        if isinstance(rid, str) and rid:
            leg.rid = rid
        room = attrs.get(c.A_ROOM)
        if is_int(room):
            leg.room = room
        peer = attrs.get(c.A_PEER)
        if isinstance(peer, str) and peer:
            leg.peer = peer
        if attrs.get(c.A_PROBE) is True:
            leg.probe = True

    def _stage(self, src: Source, inc: Incarnation, span, stage: str, now: int, durations: dict) -> None:
        """A finished stage: the bulk of all spans, so read straight off the protobuf.

        Reading a protobuf field costs more than most of the rule below, so each
        is read once, and attributes are not decoded at all: the role comes from
        the resource, rid from inventories and leg spans; only a leg new to us
        has its bootstrap room looked up.
        """
        tid, sid, parent, start, end = ids_and_times(span)
        role = src.role
        step = _STEPS[role].get(stage)
        if step is None:
            raise Rejection("bad_value", f"stage {stage!r} is not a stage of role {role!r}")
        seen = self._seen_spans
        if sid in seen:
            self.duplicates += 1
            return
        seen[sid] = None
        if len(seen) > _SEEN_SPANS_MAX:
            seen.popitem(last=False)
        status = span.status
        error = (status.message or "error") if status.code == _STATUS_ERROR else None
        trace_id = tid.hex()
        key = (trace_id, role)
        leg = self.open.get(key) or self.closed.get(key)
        if leg is None:
            leg = self._new_leg(key, src, inc)
            if leg is not None:
                leg.room = room_of(span)
        if error is None:
            batch = durations[stage]
            batch[0].append((end - start) / 1e9)
            batch[1].append(trace_id)
        if leg is None:
            return
        if leg.span_id is None and parent:
            leg.span_id = parent.hex()
        here, following = step
        record_stage(leg, stage, start, end, error)
        if leg.end_ns is not None:
            return  # closed already: history only
        # The end of one stage is the start of the next: move an open leg on
        # unless a newer heartbeat already put it further along.
        if leg.stage is not None and _STAGE_INDEX[role].get(leg.stage, -1) > here:
            return
        if error is not None or following is None:
            leg.stage, leg.stage_since_ns, leg.stage_done = stage, start, True
        else:
            leg.stage, leg.stage_since_ns, leg.progress_ns = following, end, end
            leg.stuck_at_ns = None

    # ---- heartbeats ----------------------------------------------------------

    def _heartbeat(self, src: Source, inc: Incarnation, span: Heartbeat, now: int) -> None:
        attrs = span.attrs
        seq = attrs.get(c.H_SEQ)
        if not is_int(seq) or seq < 0:
            raise Rejection("missing_attribute", f"pd.heartbeat without a valid {c.H_SEQ}")
        inventory = self._read_inventory(src, attrs) if c.H_OPEN_TOTAL in attrs else None
        if seq <= inc.seq:
            self.duplicates += 1  # a replay or an old heartbeat arriving late
            return
        if abs(now - span.end_ns) > MAX_SKEW_NS:
            # Minutes of skew are corrected; a day is a broken clock or a forged time,
            # and taking it as the offset would make every age of this process wrong.
            raise Rejection("bad_value", f"pd.heartbeat time is more than {MAX_SKEW_NS // 10**9} s from the sidecar's")
        self.heartbeats_received += 1
        inc.seq = seq
        inc.last_heartbeat_ns = now
        inc.offsets.append(now - span.end_ns)
        interval = attrs.get(c.H_INTERVAL)
        if finite(interval) and 0 < interval <= 3600:
            inc.interval_s = float(interval)
        loop = attrs.get(c.H_LOOP)
        if isinstance(loop, int) and loop != inc.loop_iterations:
            inc.loop_iterations, inc.loop_changed_ns = loop, now
        for name, key in ((c.H_COMPLETED, "completed"), (c.H_FAILED, "failed"), (c.H_TOKENS, "tokens_generated")):
            value = attrs.get(name)
            if is_int(value):
                setattr(inc, key, value)
        extra = {k: v for k, v in attrs.items()
                 if (k.startswith("pdwatch.") or k.startswith("pd.engine.")) and finite(v)}
        if extra:
            inc.extra = dict(list(extra.items())[:64])
        counts = {}
        for stage in c.STAGES[src.role]:
            value = attrs.get(c.H_OPEN_COUNT_PREFIX + stage)
            if is_int(value) and value >= 0:
                counts[stage] = value
        if counts or inventory is not None:
            inc.open_counts = counts
        if inventory is not None:
            inc.open_total = inventory[0]
            self._apply_inventory(src, inc, span.start_ns, seq, inventory)

    def _read_inventory(self, src: Source, attrs: dict):
        """Validate the parallel lists before anything changes (a bad heartbeat changes nothing)."""
        total = attrs.get(c.H_OPEN_TOTAL)
        if not is_int(total) or total < 0:
            raise Rejection("bad_value", f"{c.H_OPEN_TOTAL} must be a non-negative integer")
        tids = attrs.get(c.H_OPEN_TRACE_IDS) or []
        stages = attrs.get(c.H_OPEN_STAGES) or []
        since = attrs.get(c.H_OPEN_SINCE) or []
        # Types first: a scalar where a list belongs has no length to compare.
        if not (isinstance(tids, list) and isinstance(stages, list) and isinstance(since, list)):
            raise Rejection("bad_value", "inventory trace ids, stages and entry times must be arrays")
        n = len(tids)
        optional = {}
        for name in (c.H_OPEN_RIDS, c.H_OPEN_TOKENS, c.H_OPEN_SPAN_IDS, c.H_OPEN_ROOMS, c.H_OPEN_PEERS,
                     c.H_OPEN_LAST_TOKEN, c.H_OPEN_PROBES):
            value = attrs.get(name)
            if value is not None:
                if not isinstance(value, list) or len(value) != n:
                    raise Rejection("bad_value", f"inventory list {name} has {len(value) if isinstance(value, list) else 'no'} entries, not {n}")
                optional[name] = value
        if len(stages) != n or len(since) != n:
            raise Rejection("bad_value", "inventory lists of unequal length")
        if n > total:
            raise Rejection("bad_value", f"inventory lists {n} legs but {c.H_OPEN_TOTAL}={total}")
        valid = _STAGE_INDEX[src.role]
        for i in range(n):
            if not _is_hex(tids[i], 32) or tids[i] == "0" * 32:
                raise Rejection("bad_id", f"inventory trace id #{i} is not 32 lowercase hex digits")
            if stages[i] not in valid:
                raise Rejection("bad_value", f"inventory stage #{i} {str(stages[i])[:32]!r} is not a {src.role} stage")
            if not is_int(since[i]) or since[i] < 0:
                raise Rejection("bad_value", f"inventory stage entry time #{i} must be a non-negative integer")
        rids = optional.get(c.H_OPEN_RIDS) or [""] * n
        tokens = optional.get(c.H_OPEN_TOKENS) or [0] * n
        span_ids = optional.get(c.H_OPEN_SPAN_IDS) or [None] * n
        rooms = optional.get(c.H_OPEN_ROOMS) or [-1] * n
        peers = optional.get(c.H_OPEN_PEERS) or [""] * n
        last_tokens = optional.get(c.H_OPEN_LAST_TOKEN) or [0] * n
        probes = optional.get(c.H_OPEN_PROBES) or [False] * n
        return total, tids, stages, since, rids, tokens, span_ids, rooms, peers, last_tokens, probes

    def _apply_inventory(self, src: Source, inc: Incarnation, hb_ns: int, seq: int, inventory) -> None:
        total, tids, stages, since, rids, tokens, span_ids, rooms, peers, last_tokens, probes = inventory
        role, order = src.role, _STAGE_INDEX[src.role]
        for tid, stage, t_in, rid, tok, sid, room, peer, last_tok, probe in zip(
                tids, stages, since, rids, tokens, span_ids, rooms, peers, last_tokens, probes):
            key = (tid, role)
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
            if isinstance(rid, str) and rid:
                leg.rid = rid
            if _is_hex(sid, 16):
                leg.span_id = sid
            if is_int(room) and room >= 0:
                leg.room = room
            if isinstance(peer, str) and peer:
                leg.peer = peer[:256]
            if probe is True:
                leg.probe = True
            if leg.stage != stage:
                if leg.stage is None or t_in >= leg.stage_since_ns or order[stage] > order.get(leg.stage, -1):
                    leg.stage, leg.stage_since_ns, leg.progress_ns = stage, t_in, t_in
                    leg.stage_done, leg.stuck_at_ns = False, None
            elif t_in > leg.stage_since_ns:
                leg.stage_since_ns = t_in
                leg.progress_ns = max(leg.progress_ns, t_in)
            if is_int(tok) and tok > leg.tokens:
                leg.tokens = tok
                # New tokens: the decode was alive when the last of them came. An
                # engine that does not say when (no last-token list) is taken as
                # alive at this heartbeat, which can only age it too little.
                alive_at = hb_ns
                if is_int(last_tok) and last_tok > 0:
                    alive_at = min(last_tok, hb_ns)
                leg.progress_ns = max(leg.progress_ns, alive_at)
            leg.listed_seq = seq
        # Legs this process no longer lists have ended; their leg span was lost
        # or is late. When the lists were cut, only legs older than the newest
        # listed one can be judged.
        cutoff = hb_ns if len(tids) >= total else min(hb_ns, since[-1] - 1 if since else -1)
        for key in [k for k in inc.keys]:
            leg = self.open.get(key)
            if leg is None or leg.inc is not inc:
                inc.keys.discard(key)
                continue
            if leg.listed_seq != seq and leg.stage_since_ns <= cutoff:
                del self.open[key]
                self.evicted["vanished"] += 1
                self._close(leg, None, hb_ns, hb_ns)

    # ---- forgetting ----------------------------------------------------------

    def expire_instances(self, now: int) -> int:
        """Forget instances no rank of which sent anything for the TTL; returns how many.

        An instance that was scaled away or renamed never sends the heartbeat
        that would end its legs: without this, its legs, counters and label
        sets would stay forever and its slot would count against the cap.
        """
        cutoff = now - self.instance_ttl_ns
        gone = [key for key, inst in self.instances.items()
                if inst.ranks and max(inc.last_seen_ns for inc in inst.ranks.values()) < cutoff]
        for key in gone:
            inst = self.instances.pop(key)
            for inc in inst.ranks.values():
                for leg_key in list(inc.keys):
                    leg = self.open.get(leg_key)
                    if leg is not None and leg.inc is inc:
                        del self.open[leg_key]
                        self.evicted["instance_gone"] += 1
                        self._close(leg, None, leg.stage_since_ns, now)
                inc.keys.clear()
            for counts in (self.finished, self.probes_finished):
                for fkey in [k for k in counts if k[0] == inst.cluster and k[2] == inst.name]:
                    del counts[fkey]
            if not any(other.cluster == inst.cluster for other in self.instances.values()):
                self.clusters.pop(inst.cluster, None)
                for skey in [k for k in self.stuck_detected if k[0] == inst.cluster]:
                    del self.stuck_detected[skey]
        self.instances_expired += len(gone)
        return len(gone)

    # ---- judging -------------------------------------------------------------

    def recent_evaluation(self, max_age_s: float = 1.0) -> Evaluation:
        """last_eval when nothing was ingested since and it is at most max_age_s old, else a new one.

        A scrape builds the tracker's metrics and then the diagnosis: with this
        the second reuses the first's walk over every open leg.
        """
        with self.lock:
            ev, now = self.last_eval, self.clock()
            if self._eval_after == self.ingests and 0 <= now - ev.at_ns <= max_age_s * 1e9:
                return ev
            return self.evaluate(now)

    def evaluate(self, now: int | None = None) -> Evaluation:
        """Apply the stuck rule to every open leg; remembers and returns the result."""
        with self.lock:
            now = self.clock() if now is None else now
            self._eval_after = self.ingests
            self.expire_instances(now)
            thresholds: dict[tuple[str, str, str], float] = {}
            groups: dict[tuple[str, str, str, str], list] = {}
            stuck: list[StuckLeg] = []
            for leg in self.open.values():
                stage = leg.stage
                if stage is None or leg.stage_done:
                    leg.stuck_at_ns = None
                    continue
                tkey = (leg.cluster, leg.role, stage)
                thr = thresholds.get(tkey)
                if thr is None:
                    thr = thresholds[tkey] = self.thresholds.threshold(tkey, now)
                offset = leg.inc.offset_ns() if leg.inc is not None else 0
                ref = max(leg.stage_since_ns, leg.progress_ns) if stage == "decode" else leg.stage_since_ns
                age = (now - offset - ref) / 1e9
                gkey = (leg.cluster, leg.role, stage, leg.pd_instance)
                group = groups.get(gkey)
                if group is None:
                    group = groups[gkey] = [0, 0.0]
                if age > group[1]:
                    group[1] = age
                if age <= thr:
                    leg.stuck_at_ns = None
                    continue
                group[0] += 1
                stuck.append(StuckLeg(leg, age, thr))
                if leg.stuck_at_ns is None:
                    leg.stuck_at_ns = now
                    if not leg.ever_stuck:
                        leg.ever_stuck = True
                        skey = (leg.cluster, leg.role, stage)
                        self.stuck_detected[skey] = self.stuck_detected.get(skey, 0) + 1
                        if self.on_stuck is not None:
                            self.on_stuck(leg, age, thr, now)
            for key in self.thresholds.keys():
                if key not in thresholds:
                    thresholds[key] = self.thresholds.threshold(key, now)
            for inst in self.instances.values():
                for stage in c.STAGES[inst.role]:
                    tkey = (inst.cluster, inst.role, stage)
                    if tkey not in thresholds:
                        thresholds[tkey] = self.thresholds.threshold(tkey, now)
            stuck.sort(key=lambda s: -s.age_s)
            flowing = {name: cl.last_ok_ns > 0 and now - cl.last_ok_ns <= self.flow_window_ns
                       for name, cl in self.clusters.items()}
            self.last_eval = Evaluation(now, stuck, {k: tuple(v) for k, v in groups.items()}, thresholds, flowing)
            return self.last_eval

    # ---- views ---------------------------------------------------------------

    def instance_up(self, inst: Instance, now: int) -> bool:
        """Every rank heartbeated within 3 of its intervals (contract section 5)."""
        if not inst.ranks:
            return False
        for inc in inst.ranks.values():
            if not inc.last_heartbeat_ns:
                return False
            if now - inc.last_heartbeat_ns > c.DOWN_AFTER_INTERVALS * inc.interval_s * 1e9:
                return False
        return True

    def loop_stalled(self, inst: Instance, now: int) -> bool:
        """A rank still heartbeats but its scheduler loop counter has not moved for 3 intervals."""
        for inc in inst.ranks.values():
            if inc.loop_iterations is None or not inc.last_heartbeat_ns:
                continue
            fresh = now - inc.last_heartbeat_ns <= c.DOWN_AFTER_INTERVALS * inc.interval_s * 1e9
            if fresh and now - inc.loop_changed_ns > c.DOWN_AFTER_INTERVALS * inc.interval_s * 1e9:
                return True
        return False
