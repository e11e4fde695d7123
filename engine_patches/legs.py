"""The recorder's view of open legs, rebuilt off the engine thread from records.

Applies hot-path records in order and says which spans they complete. Knows
nothing about OpenTelemetry: `otlp` turns the finished pieces into spans.
"""

from __future__ import annotations

import hashlib
import heapq
import os
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdwatch import contract as c

if TYPE_CHECKING:
    from opentelemetry.util.types import AttributeValue

MAX_ERROR = 256  # characters of an error kept per leg: enough to read, bounded


@dataclass(slots=True)
class Leg:
    rid: str
    trace_id: int
    span_id: int
    parent_span_id: int | None  # from traceparent; None = root of its trace
    arrive_ns: int
    room: int | None = None
    peer: str | None = None
    prompt_tokens: int = -1  # -1: unknown
    stage: str | None = None
    stage_since_ns: int = 0
    # Transfer detail (bytes, backend), kept until the transfer stage ends: SGLang queues KV
    # chunks while the leg is still in prefill, before it enters transfer.
    xfer_attrs: dict[str, int | str] = field(default_factory=dict)
    tokens: int = 0
    last_token_ns: int = 0
    probe: bool = False  # the engine's own warm-up or health check
    error: str = ""  # the latest error the engine recorded for the leg without ending it


@dataclass(slots=True)
class StageDone:
    leg: Leg
    stage: str
    start_ns: int
    end_ns: int
    attrs: dict[str, int | str]
    error: str | None  # reason when the stage ended in failure


@dataclass(slots=True)
class LegDone:
    leg: Leg
    end_ns: int
    outcome: str
    reason: str | None
    output_tokens: int


Piece = StageDone | LegDone  # what a record completes: span pieces for otlp.py

# Ids come from a generator of pdwatch's own: engines seed the global one
# (SGLang's --random-seed), which would give every process the same ids.
_id_random = random.Random()
os.register_at_fork(after_in_child=_id_random.seed)  # a forked child must not repeat its parent's ids


def new_trace_id() -> int:
    return _id_random.getrandbits(128) or 1


def new_span_id() -> int:
    return _id_random.getrandbits(64) or 1


def trace_id_for(traceparent: str | None, room: int | None) -> tuple[int, int | None]:
    """Contract section 2: traceparent, else the room's hash, else random."""
    parsed = c.parse_traceparent(traceparent)
    if parsed is not None:
        return parsed
    if room is not None:
        return c.room_trace_id(room), None
    return new_trace_id(), None


def room_from_key(key: str) -> int:
    """A room for an engine that has none (vLLM), from a string both legs know (there, the prefill's
    request id): a non-negative 63-bit integer from its SHA-256, so the contract's room hash joins the
    legs. Runs on the recorder's worker thread (Recorder.arrive's room_key)."""
    digest = hashlib.sha256(key.encode("utf-8", "replace")).digest()
    return int.from_bytes(digest[:8], "big") & 0x7FFF_FFFF_FFFF_FFFF


class LegTable:
    """Open legs of one engine process plus its monotonic progress counters."""

    def __init__(self, role: str, max_open: int, transfer_backend: str | None = None):
        self.role = role
        self._backend = {c.A_XFER_BACKEND: transfer_backend} if transfer_backend else {}
        self.stages = c.STAGES[role]
        self.max_open = max_open
        self.open: dict[str, Leg] = {}
        self.completed = 0
        self.failed = 0
        self.tokens_generated = 0
        self.evicted = 0
        self.unknown_stage = 0

    # Each apply_* returns the span pieces the record completed (maybe none).

    def arrive(self, rid: str, ts: int, room: int | None, traceparent: str | None, prompt_tokens: int | None,
               peer: str | None, probe: bool = False) -> list[Piece]:
        done: list[Piece] = []
        old = self.open.get(rid)
        if old is not None:
            # A reused rid means the engine forgot the first one: close it.
            done.extend(self.finish(rid, ts, "aborted", "rid reused", None))
        if len(self.open) >= self.max_open:
            oldest = min(self.open.values(), key=lambda leg: leg.arrive_ns)
            del self.open[oldest.rid]
            self.evicted += 1
        # A probe shares its fixed room with every other probe: a trace of its own.
        trace_id, parent = trace_id_for(None, None) if probe else trace_id_for(traceparent, room)
        self.open[rid] = Leg(
            rid=rid,
            trace_id=trace_id,
            span_id=new_span_id(),
            parent_span_id=parent,
            arrive_ns=ts,
            room=room,
            peer=peer,
            prompt_tokens=-1 if prompt_tokens is None else int(prompt_tokens),
            probe=bool(probe),
        )
        return done

    def _leg(self, rid: str, ts: int) -> Leg:
        leg = self.open.get(rid)
        if leg is None:
            # Hooks attached mid-flight see legs they never saw arrive.
            self.arrive(rid, ts, None, None, None, None)
            leg = self.open[rid]
        return leg

    def enter(self, rid: str, ts: int, stage: str) -> list[Piece]:
        if stage not in self.stages:
            self.unknown_stage += 1
            return []
        leg = self._leg(rid, ts)
        if leg.stage == stage:
            return []
        done = self._close_stage(leg, ts, None)
        leg.stage = stage
        leg.stage_since_ns = ts
        return done

    def transfer_info(self, rid: str, ts: int, nbytes: int | None, backend: str | None, peer: str | None) -> None:
        leg = self._leg(rid, ts)
        if nbytes is not None:
            leg.xfer_attrs[c.A_XFER_BYTES] = int(nbytes)
        if backend:
            leg.xfer_attrs[c.A_XFER_BACKEND] = str(backend)
        if peer:
            leg.peer = str(peer)

    def error(self, rid: str, text: object) -> None:
        leg = self.open.get(rid)
        if leg is not None:
            leg.error = str(text)[:MAX_ERROR]

    def token(self, rid: str, ts: int, n: int) -> None:
        leg = self.open.get(rid)
        self.tokens_generated += n
        if leg is not None:
            leg.tokens += n
            leg.last_token_ns = ts

    def finish(self, rid: str, ts: int, outcome: str, reason: str | None, output_tokens: int | None) -> list[Piece]:
        leg = self.open.pop(rid, None)
        if leg is None:
            return []
        if outcome not in c.OUTCOMES:
            reason = reason or f"unknown outcome {outcome!r}"
            outcome = "failed"
        error = None if outcome == "ok" else (reason or outcome)
        done = self._close_stage(leg, ts, error)
        if outcome == "ok":
            self.completed += 1
        else:
            self.failed += 1
        out = leg.tokens if output_tokens is None else int(output_tokens)
        done.append(LegDone(leg, ts, outcome, reason, out))
        return done

    def _close_stage(self, leg: Leg, ts: int, error: str | None) -> list[Piece]:
        if leg.stage is None:
            return []
        attrs = {**self._backend, **leg.xfer_attrs} if leg.stage == "transfer" else {}
        return [StageDone(leg, leg.stage, leg.stage_since_ns, ts, attrs, error)]

    def inventory(self, limit: int) -> dict[str, AttributeValue]:
        """Heartbeat attributes describing what is open, oldest stage entry first."""
        counts = dict.fromkeys(self.stages, 0)
        for leg in self.open.values():
            if leg.stage is not None:
                counts[leg.stage] += 1
        listed = heapq.nsmallest(
            limit, (leg for leg in self.open.values() if leg.stage is not None), key=lambda leg: leg.stage_since_ns
        )
        attrs: dict[str, AttributeValue] = {c.H_OPEN_TOTAL: sum(counts.values())}
        for stage, n in counts.items():
            attrs[c.H_OPEN_COUNT_PREFIX + stage] = n
        attrs[c.H_OPEN_TRACE_IDS] = [f"{leg.trace_id:032x}" for leg in listed]
        attrs[c.H_OPEN_RIDS] = [leg.rid for leg in listed]
        attrs[c.H_OPEN_STAGES] = [leg.stage for leg in listed]
        attrs[c.H_OPEN_SINCE] = [leg.stage_since_ns for leg in listed]
        attrs[c.H_OPEN_TOKENS] = [leg.tokens for leg in listed]
        attrs[c.H_OPEN_SPAN_IDS] = [f"{leg.span_id:016x}" for leg in listed]
        attrs[c.H_OPEN_ROOMS] = [-1 if leg.room is None else leg.room for leg in listed]
        attrs[c.H_OPEN_PEERS] = [leg.peer or "" for leg in listed]
        attrs[c.H_OPEN_LAST_TOKEN] = [leg.last_token_ns for leg in listed]
        attrs[c.H_OPEN_ERRORS] = [leg.error for leg in listed]
        attrs[c.H_OPEN_PROMPT_TOKENS] = [leg.prompt_tokens for leg in listed]
        attrs[c.H_OPEN_PROBES] = [leg.probe for leg in listed]
        return attrs
