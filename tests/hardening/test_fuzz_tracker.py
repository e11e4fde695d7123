"""Hypothesis against the tracker: arbitrary OTLP requests, well-formed protobuf
but anything inside (names, ids of any length, times from 0 to 2^64-1, NaN,
attributes of every type, inventory lists of unequal length, unknown stages,
any rank), go through the sidecar's own parser into the tracker. After each:
no exception, the invariants hold, and replaying the request changes nothing.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from pdwatch import contract as c
from pdwatch.sidecar.model import stage_history
from pdwatch.sidecar.otlp_body import PROTOBUF, parse_request
from pdwatch.sidecar.tracker import Tracker
from tests.support.tracking import ingest, new_tracker

from .conftest import FLOORS, FUZZ_EXAMPLES, T0, FakeClock, check_invariants, kvs, span

U64 = 2**64 - 1
I64 = st.integers(-(2**63), 2**63 - 1)
TRACE_POOL = [bytes(15) + bytes([i]) for i in range(1, 5)]
HEX_POOL = [t.hex() for t in TRACE_POOL]
STAGE_WORDS = [*c.ALL_STAGES, "Transfer", "warp", "", "pd.decode"]

scalar = st.one_of(st.text(max_size=12), I64, st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                   st.binary(max_size=8))
value = st.recursive(scalar, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                     max_leaves=8)
times = st.one_of(st.integers(0, U64), st.integers(T0 - 10**12, T0 + 10**12), st.just(0), st.just(U64))
ids16 = st.one_of(st.sampled_from(TRACE_POOL), st.binary(max_size=17), st.just(bytes(16)))
ids8 = st.one_of(st.integers(1, 6).map(lambda i: i.to_bytes(8, "big")), st.binary(max_size=9), st.just(bytes(8)))


@st.composite
def inventory(draw) -> dict:
    n = draw(st.integers(0, 5))
    lengths = draw(st.lists(st.integers(max(0, n - 1), n + 1), min_size=3, max_size=3))  # sometimes unequal
    out = {
        c.H_OPEN_TOTAL: draw(st.one_of(st.integers(-1, 8), value)),
        c.H_OPEN_TRACE_IDS: draw(st.one_of(
            st.lists(st.one_of(st.sampled_from(HEX_POOL), st.text(max_size=33), st.just("0" * 32)),
                     min_size=lengths[0], max_size=lengths[0]), value)),
        c.H_OPEN_STAGES: draw(st.lists(st.sampled_from(STAGE_WORDS), min_size=lengths[1], max_size=lengths[1])),
        c.H_OPEN_SINCE: draw(st.lists(st.one_of(times.filter(lambda t: t < 2**63), I64),
                                      min_size=lengths[2], max_size=lengths[2])),
    }
    for key in (c.H_OPEN_RIDS, c.H_OPEN_TOKENS, c.H_OPEN_SPAN_IDS, c.H_OPEN_ROOMS, c.H_OPEN_PEERS,
                c.H_OPEN_LAST_TOKEN):
        if draw(st.booleans()):
            out[key] = draw(st.lists(value, min_size=lengths[0], max_size=lengths[0]))
    return out


@st.composite
def attributes(draw, name: str) -> dict:
    keys = [c.A_ROLE, c.A_RID, c.A_ROOM, c.A_PEER, c.A_OUTCOME, c.A_OUTPUT_TOKENS, c.H_INTERVAL, c.H_LOOP,
            c.H_COMPLETED, "pdwatch.recorder.dropped", "pd.engine.x", c.H_OPEN_COUNT_PREFIX + "queued"]
    out = draw(st.dictionaries(st.sampled_from(keys), value, max_size=4))
    if name == c.SPAN_LEG and draw(st.booleans()):
        out[c.A_OUTCOME] = draw(st.sampled_from([*c.OUTCOMES, "exploded"]))
    if name == c.SPAN_HEARTBEAT:
        out[c.H_SEQ] = draw(st.one_of(st.integers(-2, 6), value))
        if draw(st.booleans()):
            out.update(draw(inventory()))
    return out


@st.composite
def spans(draw):
    name = draw(st.sampled_from([c.SPAN_LEG, c.SPAN_HEARTBEAT, *(c.stage_span_name(s) for s in c.ALL_STAGES),
                                 "pd.unknown", ""]))
    start = draw(times)
    end = draw(st.one_of(times, st.integers(0, 10**10).map(lambda d: min(U64, start + d))))
    return span(name, draw(ids16), draw(ids8), start, end, draw(attributes(name)),
                parent=draw(st.one_of(st.just(b""), ids8)))


@st.composite
def resources(draw) -> dict:
    out = {
        c.R_ROLE: draw(st.one_of(st.sampled_from(c.ROLES), value)),
        c.R_INSTANCE: draw(st.one_of(st.sampled_from(["p-0", "d-0", "d-1"]), value)),
        c.R_INSTANCE_ID: draw(st.sampled_from(["inc-a", "inc-b", "inc-c"])),
        c.R_CLUSTER: draw(st.sampled_from(["default", "other"])),
    }
    for key, strat in ((c.R_TP_RANK, st.one_of(st.integers(-1, 3), I64)), (c.R_TP_SIZE, st.integers(-1, 4)),
                       (c.R_START_NS, times.map(lambda t: t & (2**63 - 1))), (c.R_GPU_UUIDS, value)):
        if draw(st.booleans()):
            out[key] = draw(strat)
    return out


@st.composite
def requests(draw) -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    for _ in range(draw(st.integers(1, 3))):
        rs = req.resource_spans.add()
        rs.resource.attributes.extend(kvs(draw(resources())))
        rs.scope_spans.add().spans.extend(draw(st.lists(spans(), min_size=1, max_size=6)))
    return req


def snapshot(t: Tracker):
    """Every fact the tracker would report, without the counters that count the replay itself."""
    legs = {k: (x.stage, x.stage_since_ns, x.progress_ns, x.tokens, x.rid, x.room, x.peer, x.stage_done,
                len(stage_history(x)), x.inc.id if x.inc else None) for k, x in t.open.items()}
    closed = {k: (x.outcome, x.end_ns, len(stage_history(x))) for k, x in t.closed.items()}
    ranks = {k: {r: (inc.id, inc.seq, tuple(inc.offsets)) for r, inc in i.ranks.items()} for k, i in t.instances.items()}
    return legs, closed, ranks, dict(t.finished), {k: len(v) for k, v in t.samples._samples.items()}


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batch=st.lists(requests(), min_size=1, max_size=3))
def test_any_request_leaves_the_tracker_consistent_and_a_replay_changes_nothing(batch):
    clock = FakeClock()
    tracker = new_tracker(FLOORS, clock=clock, max_open_legs=6, max_closed_legs=4, max_instances=3)
    for req in batch:
        parsed = parse_request(req.SerializeToString(), PROTOBUF)
        rejected, messages = ingest(tracker, parsed)
        assert 0 <= rejected <= sum(len(ss.spans) for rs in parsed.resource_spans for ss in rs.scope_spans)
        assert all(isinstance(m, str) for m in messages)
        check_invariants(tracker)
        clock.advance(1)
    before = snapshot(tracker)
    for req in batch:
        ingest(tracker, parse_request(req.SerializeToString(), PROTOBUF))
    assert snapshot(tracker) == before
    check_invariants(tracker)
