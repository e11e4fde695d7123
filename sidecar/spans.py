"""From one OTLP request to typed records, in one pass: what the tracker applies.

Each resource becomes a `Batch`: who sent it (`Source`), its stage records,
leg records and heartbeats, and the spans that could not be used, each with
a reason from a fixed set (the label values of `pdwatch_spans_rejected_total`).
Everything the contract requires of a span's own content is checked here;
what depends on the tracker's state (a replaced process, a replayed span, a
late heartbeat) is the tracker's to judge. The tracker reads no protobuf
field itself.

Stage spans are the bulk: their records are plain tuples and their attributes
are not decoded at all. The one the tracker may need, the bootstrap room, it
reads through `room_of` when a stage span opens a leg (once per leg, not per
stage), so a stage record carries its span for that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeGuard

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from pdwatch import contract as c

from .model import Process

# Every reason a span may be rejected for; a closed set keeps the label bounded.
REASONS = (
    "unknown_span",  # a pd.* name that is not the contract's
    "missing_attribute",  # a resource or span attribute the contract requires is absent
    "bad_value",  # an attribute of the wrong type or out of range
    "bad_id",  # trace or span id of the wrong length, or zero
    "instance_limit",  # more engine instances than the sidecar tracks
    "stale_incarnation",  # from a process that has since been replaced
)

STAGE_SPANS = {c.stage_span_name(s): s for s in c.ALL_STAGES}
_STAGES_OF = {role: frozenset(stages) for role, stages in c.STAGES.items()}
# Ranks per engine instance (tensor parallel size); more is a malformed resource.
MAX_RANKS = 1024
MAX_PEER_IDS = 64
MAX_TEXT = 256  # peers, errors: enough to read, bounded in memory
MAX_POLICY = 64  # a schedule policy's name
MAX_REFUSED = 64  # pd.plugin.refused entries kept: one per hook target
MAX_VERSION = 64  # a plugin version's text
ZERO16, ZERO8 = bytes(16), bytes(8)
_STATUS_ERROR = Status.STATUS_CODE_ERROR


class Rejection(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(slots=True)
class Source(Process):
    """Who sent a batch of spans: one engine process (resource attributes, contract section 3)."""

    cluster: str
    pd_instance: str
    role: str
    incarnation: str  # service.instance.id
    tp_rank: int
    peer_ids: tuple[str, ...] = ()
    schedule_policy: str = ""  # v1.2: pd.schedule_policy, "" when the engine does not say


# One finished stage: (trace id, span id, parent span id, stage, start ns, end ns, error, span), the error
# being the status message when the stage ended in failure, the span there for `room_of`. A plain tuple,
# not a named one: stage records are the bulk of all records, and each is made once and unpacked once.
StageRecord = tuple[bytes, bytes, bytes, str, int, int, str | None, Span]


@dataclass(slots=True)
class LegRecord:
    trace_id: bytes
    span_id: bytes
    role: str
    outcome: str
    start_ns: int
    end_ns: int
    rid: str = ""
    room: int | None = None
    peer: str | None = None
    probe: bool = False
    output_tokens: int | None = None
    prompt_tokens: int | None = None
    error: str | None = None  # pdwatch.error: an error the engine recorded for the leg without ending it


class Entry(NamedTuple):
    """One open leg of a heartbeat inventory (contract section 4's parallel lists, one row)."""

    trace_id: str
    stage: str
    since_ns: int
    rid: str
    tokens: int
    span_id: str | None
    room: int  # -1: unknown
    peer: str
    last_token_ns: int
    error: str
    prompt_tokens: int  # -1: unknown
    probe: bool


@dataclass(slots=True)
class Inventory:
    total: int
    entries: list[Entry]

    @property
    def complete(self) -> bool:
        return len(self.entries) >= self.total


@dataclass(slots=True)
class HeartbeatRecord:
    start_ns: int
    end_ns: int
    seq: int
    interval_s: float | None
    loop_iterations: int | None
    loop_idle_turn_s: float | None  # pd.loop.idle_turn_s (or its pre-v1.2 name): the engine's own word on its idle loop
    final: bool  # pd.heartbeat.final (v1.2): the process is leaving in order; its inventory is what it leaves open
    counters: dict[str, int]  # completed, failed, tokens_generated
    open_counts: dict[str, int]
    extra: dict[str, float]  # pd.recorder.*, pdwatch.* and pd.engine.* numbers
    inventory: Inventory | None
    # v1.2, each None when the heartbeat does not say: pd.plugin.state, pd.plugin.refused, and the
    # recorder's counters (pd.recorder.*: attribute name -> monotonic count).
    plugin_state: str | None = None
    plugin_refused: tuple[str, ...] | None = None
    recorder: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class Batch:
    """One resource's spans, decoded."""

    source: Source | None  # None: the resource was refused, or is not an engine's
    stages: list[StageRecord] = field(default_factory=list)
    legs: list[LegRecord] = field(default_factory=list)
    heartbeats: list[HeartbeatRecord] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (reason, message) per span


@dataclass(slots=True)
class Decoded:
    batches: list[Batch]
    spans: int  # every span of the request
    foreign: int  # spans that are not pdwatch's: forwarded, never rejected
    heartbeats: int  # pd.heartbeat spans (the forwarder leaves them out)


# ---- attribute values -------------------------------------------------------------------------

def any_value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "string_value":
        return v.string_value
    if kind == "int_value":
        return v.int_value
    if kind == "double_value":
        return v.double_value
    if kind == "bool_value":
        return v.bool_value
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if kind == "bytes_value":
        return v.bytes_value
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in v.kvlist_value.values}
    return None


_SCALARS = frozenset(("string_value", "int_value", "double_value", "bool_value"))


def attributes(kvs: Any) -> dict[str, Any]:
    out = {}
    for kv in kvs:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = getattr(v, kind) if kind in _SCALARS else any_value(v)
    return out


def is_int(value: Any) -> TypeGuard[int]:
    """An integer value; a bool is not one, although Python makes it an int."""
    return isinstance(value, int) and not isinstance(value, bool)


def finite(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_hex(value: Any, length: int) -> bool:
    if not isinstance(value, str) or len(value) != length:
        return False
    try:
        int(value, 16)
    except ValueError:
        return False
    return value == value.lower()


def _str(attrs: dict[str, Any], key: str, *, required: bool = True, default: str = "") -> str:
    value = attrs.get(key)
    if value is None or value == "":
        if required:
            raise Rejection("missing_attribute", f"missing attribute {key}")
        return default
    if not isinstance(value, str):
        raise Rejection("bad_value", f"attribute {key} must be a string")
    return value


def _int(attrs: dict[str, Any], key: str, default: int) -> int:
    value = attrs.get(key)
    if value is None:
        return default
    if not is_int(value):
        raise Rejection("bad_value", f"attribute {key} must be an integer")
    return int(value)


def _strings(attrs: dict[str, Any], key: str, limit: int) -> tuple[str, ...]:
    value = attrs.get(key) or ()
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)):
        raise Rejection("bad_value", f"resource {key} must be a string or an array of strings")
    return tuple(v[:MAX_TEXT] for v in value[:limit] if isinstance(v, str) and v)


# ---- resources ----------------------------------------------------------------------------------

def is_engine_resource(attrs: dict[str, Any]) -> bool:
    """A resource that speaks the contract names itself; one without pd.role or pd.instance is not ours."""
    return c.R_ROLE in attrs or c.R_INSTANCE in attrs


def read_source(attrs: dict[str, Any]) -> Source:
    role = _str(attrs, c.R_ROLE)
    if role not in c.ROLES:
        raise Rejection("bad_value", f"resource {c.R_ROLE}={role!r} is not one of {', '.join(c.ROLES)}")
    start_ns = _int(attrs, c.R_START_NS, 0)
    if start_ns < 0:
        raise Rejection("bad_value", f"resource {c.R_START_NS} is negative")
    tp_rank = _int(attrs, c.R_TP_RANK, 0)
    tp_size = _int(attrs, c.R_TP_SIZE, 1)
    # Each rank is a tracked process: a bound keeps one instance from growing without end.
    if not (0 <= tp_rank < MAX_RANKS and 1 <= tp_size <= MAX_RANKS):
        raise Rejection("bad_value", f"resource {c.R_TP_RANK}={tp_rank}, {c.R_TP_SIZE}={tp_size}: "
                                     f"ranks run 0..{MAX_RANKS - 1}")
    pid = attrs.get(c.R_PID)
    if pid is not None and not is_int(pid):
        raise Rejection("bad_value", f"attribute {c.R_PID} must be an integer")
    return Source(
        cluster=_str(attrs, c.R_CLUSTER, required=False, default="default"),
        pd_instance=_str(attrs, c.R_INSTANCE),
        role=role,
        incarnation=_str(attrs, c.R_INSTANCE_ID),
        tp_rank=tp_rank,
        tp_size=tp_size,
        start_ns=start_ns,
        pid=pid,
        host=_str(attrs, c.R_HOST, required=False),
        gpu_uuids=_strings(attrs, c.R_GPU_UUIDS, MAX_RANKS),
        service=_str(attrs, c.R_SERVICE_NAME, required=False),
        version=_str(attrs, c.R_ENGINE_VERSION, required=False),
        peer_ids=_strings(attrs, c.R_PEER_IDS, MAX_PEER_IDS),
        schedule_policy=_str(attrs, c.R_SCHEDULE_POLICY, required=False)[:MAX_POLICY],
        # The plugin's version when the recorder is pdwatch's (another distribution's version is not it).
        plugin_version=_str(attrs, c.R_DISTRO_VERSION, required=False)[:MAX_VERSION]
        if attrs.get(c.R_DISTRO_NAME) == c.DISTRIBUTION else "",
    )


# ---- spans --------------------------------------------------------------------------------------

def check_ids(span: Span) -> None:
    tid, sid, parent = span.trace_id, span.span_id, span.parent_span_id
    if len(tid) != 16 or tid == ZERO16:
        raise Rejection("bad_id", f"{span.name[:64]}: trace id must be 16 non-zero bytes")
    if len(sid) != 8 or sid == ZERO8:
        raise Rejection("bad_id", f"{span.name[:64]}: span id must be 8 non-zero bytes")
    if parent and len(parent) != 8:
        raise Rejection("bad_id", f"{span.name[:64]}: parent span id must be 8 bytes")


_ROOM_AT = 3  # where engine_patches/otlp.py puts pd.bootstrap_room among a stage span's attributes
_INT = "int_value"


def room_of(span: Span) -> int | None:
    """pd.bootstrap_room of a stage span, without decoding its other attributes.

    Asked by the tracker only for a stage span that opens a leg: read for every
    stage span, it was a fifth of decoding. pdwatch's recorder writes the room
    fourth, after role, stage and rid, so that place is read first; any other
    order still works through the walk."""
    kvs = span.attributes
    kv = kvs[_ROOM_AT] if len(kvs) > _ROOM_AT else None
    if kv is None or kv.key != c.A_ROOM:
        kv = next((x for x in kvs if x.key == c.A_ROOM), None)
        if kv is None:
            return None
    v = kv.value
    room = v.int_value  # 0 when the value is not an int: only then is its type asked
    return room if room or v.WhichOneof("value") == _INT else None


def _leg(span: Span, role: str) -> LegRecord:
    attrs = attributes(span.attributes)
    leg_role = attrs.get(c.A_ROLE) or role
    outcome = attrs.get(c.A_OUTCOME)
    if outcome is None:
        raise Rejection("missing_attribute", f"pd.request without {c.A_OUTCOME}")
    if leg_role not in c.ROLES or outcome not in c.OUTCOMES:
        raise Rejection("bad_value", f"pd.request with role {leg_role!r}, outcome {outcome!r}")
    rid, room, peer = attrs.get(c.A_RID), attrs.get(c.A_ROOM), attrs.get(c.A_PEER)
    tokens, prompt = attrs.get(c.A_OUTPUT_TOKENS), attrs.get(c.A_PROMPT_TOKENS)
    error = attrs.get(c.A_LEG_ERROR)
    return LegRecord(
        trace_id=span.trace_id, span_id=span.span_id, role=leg_role, outcome=outcome,
        start_ns=span.start_time_unix_nano, end_ns=span.end_time_unix_nano,
        rid=rid if isinstance(rid, str) else "",
        room=room if is_int(room) else None,
        peer=peer[:MAX_TEXT] if isinstance(peer, str) and peer else None,
        probe=attrs.get(c.A_PROBE) is True,
        output_tokens=tokens if is_int(tokens) and tokens >= 0 else None,
        prompt_tokens=prompt if is_int(prompt) and prompt >= 0 else None,
        error=error[:MAX_TEXT] if isinstance(error, str) and error else None,
    )


# A leg span's attributes by key, for the fast path below; the order is the recorder's.
_LEG_KEYS = {k: i for i, k in enumerate((c.A_ROLE, c.A_RID, c.A_OUTCOME, c.A_OUTPUT_TOKENS, c.A_PROMPT_TOKENS,
                                         c.A_PROBE, c.A_ROOM, c.A_PEER, c.A_LEG_ERROR))}


def _leg_fast(span: Span, role: str) -> LegRecord | None:
    """`_leg` for a well-formed leg span, reading each attribute once by the type it must have.

    None when anything is out of the ordinary (ids, times, a role or outcome that is not a plain
    valid string): `_leg` then decides, with its reason. Where a typed read would tell no different
    from the dict `_leg` builds, it is used as is: a string read from a value of another type is "",
    a bool read from one is False, and only an int of 0 needs its type asked.
    """
    tid, sid, parent = span.trace_id, span.span_id, span.parent_span_id
    start, end = span.start_time_unix_nano, span.end_time_unix_nano
    if not (len(tid) == 16 and tid != ZERO16 and len(sid) == 8 and sid != ZERO8
            and (not parent or len(parent) == 8) and end >= start):
        return None
    leg_role: str | None = role
    outcome = rid = peer = error = ""
    room = tokens = prompt = None
    probe = False
    keys = _LEG_KEYS
    for kv in span.attributes:
        i = keys.get(kv.key)
        if i is None:
            continue
        v = kv.value
        if i == 0:
            leg_role = v.string_value or None  # "" of another type may be a value `_leg` refuses
        elif i == 1:
            rid = v.string_value
        elif i == 2:
            outcome = v.string_value
        elif i == 5:
            probe = v.bool_value
        elif i == 7:
            peer = v.string_value
        elif i == 8:
            error = v.string_value
        else:
            n = v.int_value
            if n == 0 and v.WhichOneof("value") != _INT:
                n = None
            if i == 3:
                tokens = n
            elif i == 4:
                prompt = n
            else:
                room = n
    if leg_role is None or leg_role not in c.ROLES or outcome not in c.OUTCOMES:
        return None
    return LegRecord(
        tid, sid, leg_role, outcome, start, end, rid, room, peer[:MAX_TEXT] or None, probe,
        tokens if tokens is not None and tokens >= 0 else None,
        prompt if prompt is not None and prompt >= 0 else None,
        error[:MAX_TEXT] or None,
    )


_OPTIONAL_LISTS = (
    (c.H_OPEN_RIDS, ""), (c.H_OPEN_TOKENS, 0), (c.H_OPEN_SPAN_IDS, None), (c.H_OPEN_ROOMS, -1),
    (c.H_OPEN_PEERS, ""), (c.H_OPEN_LAST_TOKEN, 0), (c.H_OPEN_ERRORS, ""), (c.H_OPEN_PROMPT_TOKENS, -1),
    (c.H_OPEN_PROBES, False),
)


def _inventory(attrs: dict[str, Any], role: str) -> Inventory:
    """The parallel lists, checked whole before anything is used (a bad heartbeat changes nothing)."""
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
    if len(stages) != n or len(since) != n:
        raise Rejection("bad_value", "inventory lists of unequal length")
    if n > total:
        raise Rejection("bad_value", f"inventory lists {n} legs but {c.H_OPEN_TOTAL}={total}")
    columns: list[list[Any]] = []
    for name, missing in _OPTIONAL_LISTS:
        value = attrs.get(name)
        if value is None:
            columns.append([missing] * n)
            continue
        if not isinstance(value, list) or len(value) != n:
            got = len(value) if isinstance(value, list) else "no"
            raise Rejection("bad_value", f"inventory list {name} has {got} entries, not {n}")
        columns.append(value)
    valid = _STAGES_OF[role]
    entries = []
    for i, (tid, stage, t_in, rid, tok, sid, room, peer, last, err, prompt, probe) in enumerate(
            zip(tids, stages, since, *columns)):
        if not is_hex(tid, 32) or tid == "0" * 32:
            raise Rejection("bad_id", f"inventory trace id #{i} is not 32 lowercase hex digits")
        if stage not in valid:
            raise Rejection("bad_value", f"inventory stage #{i} {str(stage)[:32]!r} is not a {role} stage")
        if not is_int(t_in) or t_in < 0:
            raise Rejection("bad_value", f"inventory stage entry time #{i} must be a non-negative integer")
        entries.append(Entry(
            trace_id=tid, stage=stage, since_ns=t_in,
            rid=rid if isinstance(rid, str) else "",
            tokens=tok if is_int(tok) and tok >= 0 else 0,
            span_id=sid if is_hex(sid, 16) else None,
            room=room if is_int(room) and room >= 0 else -1,
            peer=peer[:MAX_TEXT] if isinstance(peer, str) else "",
            last_token_ns=last if is_int(last) and last > 0 else 0,
            error=err[:MAX_TEXT] if isinstance(err, str) else "",
            prompt_tokens=prompt if is_int(prompt) and prompt >= 0 else -1,
            probe=probe is True,
        ))
    return Inventory(total, entries)


_COUNTERS = ((c.H_COMPLETED, "completed"), (c.H_FAILED, "failed"), (c.H_TOKENS, "tokens_generated"))


def _heartbeat(span: Span, role: str) -> HeartbeatRecord:
    attrs = attributes(span.attributes)
    seq = attrs.get(c.H_SEQ)
    if not is_int(seq) or seq < 0:
        raise Rejection("missing_attribute", f"pd.heartbeat without a valid {c.H_SEQ}")
    inventory = _inventory(attrs, role) if c.H_OPEN_TOTAL in attrs else None
    interval = attrs.get(c.H_INTERVAL)
    loop = attrs.get(c.H_LOOP)
    idle_turn = attrs.get(c.H_LOOP_IDLE_TURN, attrs.get(c.H_LOOP_IDLE_TURN_V11))  # the old name still read
    counts: dict[str, int] = {}
    for stage in c.STAGES[role]:
        value = attrs.get(c.H_OPEN_COUNT_PREFIX + stage)
        if is_int(value) and value >= 0:
            counts[stage] = value
    extra = {k: v for k, v in attrs.items()
             if k.startswith((c.H_RECORDER_HEALTH_PREFIX, c.H_RECORDER_PREFIX, c.H_ENGINE_PREFIX)) and finite(v)}
    state = attrs.get(c.H_PLUGIN_STATE)
    refused = attrs.get(c.H_PLUGIN_REFUSED)
    return HeartbeatRecord(
        start_ns=span.start_time_unix_nano, end_ns=span.end_time_unix_nano, seq=seq,
        interval_s=float(interval) if finite(interval) and 0 < interval <= 3600 else None,
        loop_iterations=loop if is_int(loop) else None,
        loop_idle_turn_s=float(idle_turn) if finite(idle_turn) and 0 <= idle_turn <= 3600 else None,
        final=attrs.get(c.H_FINAL) is True,
        counters={key: attrs[name] for name, key in _COUNTERS if is_int(attrs.get(name))},
        open_counts=counts,
        extra=dict(list(extra.items())[:64]),
        inventory=inventory,
        # A state the contract does not name is not taken: the instance then reads as not saying.
        plugin_state=state if state in c.PLUGIN_STATES else None,
        plugin_refused=tuple(v[:MAX_TEXT] for v in refused[:MAX_REFUSED] if isinstance(v, str) and v)
        if isinstance(refused, list) else None,
        recorder={name: attrs[name] for name in c.H_RECORDER_HEALTH if is_int(attrs.get(name)) and attrs[name] >= 0},
    )


def decode(request: ExportTraceServiceRequest) -> Decoded:
    """Every resource of a request as a Batch; foreign spans (not pdwatch's) only counted."""
    batches: list[Batch] = []
    total = foreign = heartbeats = 0
    for rs in request.resource_spans:
        spans = [span for ss in rs.scope_spans for span in ss.spans]
        if not spans:
            continue
        total += len(spans)
        attrs = attributes(rs.resource.attributes)
        if not is_engine_resource(attrs):
            # Another instrumentation's spans (SGLang's own --enable-trace spans, say) on the same
            # endpoint: not ours to judge, so neither applied nor rejected; forwarded as they came.
            foreign += len(spans)
            heartbeats += sum(1 for s in spans if s.name == c.SPAN_HEARTBEAT)
            continue
        try:
            source = read_source(attrs)
        except Rejection as rej:
            batches.append(Batch(None, rejected=[(rej.reason, rej.message)] * len(spans)))
            heartbeats += sum(1 for s in spans if s.name == c.SPAN_HEARTBEAT)
            continue
        batch = Batch(source)
        batches.append(batch)
        role, valid = source.role, _STAGES_OF[source.role]
        stages, legs = batch.stages, batch.legs
        for span in spans:
            name = span.name
            stage = STAGE_SPANS.get(name)
            if stage is not None and stage in valid:
                # The bulk: a stage span of this role whose ids and times hold is kept as it is read;
                # any that fails a check goes the long way below, which names the reason.
                tid, sid, parent = span.trace_id, span.span_id, span.parent_span_id
                start, end = span.start_time_unix_nano, span.end_time_unix_nano
                if (len(tid) == 16 and tid != ZERO16 and len(sid) == 8 and sid != ZERO8
                        and (not parent or len(parent) == 8) and end >= start):
                    error = None
                    if span.HasField("status"):  # absent unless the stage failed: no Status object to make
                        status = span.status
                        if status.code == _STATUS_ERROR:
                            error = status.message or "error"
                    stages.append((tid, sid, parent, stage, start, end, error, span))
                    continue
            elif name == c.SPAN_LEG:
                leg = _leg_fast(span, role)
                if leg is not None:
                    legs.append(leg)
                    continue
            if name == c.SPAN_HEARTBEAT:
                heartbeats += 1
            try:
                if stage is None and name != c.SPAN_LEG and name != c.SPAN_HEARTBEAT:
                    if name.startswith(c.STAGE_SPAN_PREFIX):
                        raise Rejection("unknown_span", f"span {name[:64]!r} is not a pdwatch span")
                    foreign += 1
                    continue
                tid, sid, parent = span.trace_id, span.span_id, span.parent_span_id
                if len(tid) != 16 or tid == ZERO16 or len(sid) != 8 or sid == ZERO8 or (parent and len(parent) != 8):
                    check_ids(span)  # raises with the precise reason
                start, end = span.start_time_unix_nano, span.end_time_unix_nano
                if end < start:
                    raise Rejection("bad_value", f"{name[:64]}: ends before it starts")
                if stage is not None:
                    if stage not in valid:
                        raise Rejection("bad_value", f"stage {stage!r} is not a stage of role {role!r}")
                    status = span.status
                    error = (status.message or "error") if status.code == _STATUS_ERROR else None
                    stages.append((tid, sid, parent, stage, start, end, error, span))
                elif name == c.SPAN_LEG:
                    legs.append(_leg(span, role))
                else:
                    batch.heartbeats.append(_heartbeat(span, role))
            except Rejection as rej:
                batch.rejected.append((rej.reason, rej.message))
    return Decoded(batches, total, foreign, heartbeats)
