"""Hook bodies: translate SGLang objects into recorder calls.

Each hook runs on an SGLang thread (mostly the scheduler's), so it reads a
field or two and makes one recorder call per request; span building happens on
the recorder's worker. Every body catches everything and counts it in
`recorder.hook_errors`: SGLang's HookRegistry lets an exception from a hook
propagate into the scheduler. AFTER and BEFORE hooks return None (a non-None
return would replace SGLang's result or arguments). AROUND hooks call the
original outside their try blocks, so SGLang's own exceptions pass unchanged.

Lifecycle calls go to `state.lc`, set only on the rank that owns request
bookkeeping; loop ticks and tokens go to `state.rec` on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

from .state import MAX_PENDING, TRACEPARENT_ATTR, state

if TYPE_CHECKING:
    from pdwatch.engine_patches.recorder import Recorder

T = TypeVar("T")  # what the original returns, passed on by an AROUND hook

KV_FAILED = KVPoll.Failed
# Outcome classes for a leg that SGLang ended with an abort-type finish.
_TIMEOUT_WORDS = ("timed out", "timeout")


def _counted_error() -> None:
    rec = state.rec
    if rec is not None:
        rec.hook_errors += 1
    else:
        state.early_errors += 1


def classify(message: str | None, default: str = "aborted") -> str:
    """pd.outcome for a leg SGLang ended with this abort / failure message."""
    text = (message or "").lower()
    if any(w in text for w in _TIMEOUT_WORDS):
        return "timeout"
    if text.startswith("abort"):  # e.g. "Aborted by decode-side abort notification."
        return "aborted"
    if "fail" in text:
        return "failed"
    return default


def _failure_reason(kv_conn: Any, room: int | None) -> str | None:
    """The KV manager's recorded failure for a room (NIXL / Mooncake / common)."""
    mgr = getattr(kv_conn, "kv_mgr", None)
    records: dict[int, str] | None = getattr(mgr, "failure_records", None)
    if records is None or room is None:
        return None
    return records.get(room)


def is_probe(rid: str, bootstrap_host: Any) -> bool:
    """SGLang's own warm-ups and health checks: a fake bootstrap host, or the health-check rid prefix."""
    return bootstrap_host == FAKE_BOOTSTRAP_HOST or rid.startswith(HEALTH_CHECK_RID_PREFIX)


def _arrive(lc: Recorder, req: Any, stage: str) -> None:
    rid = req.rid
    room = req.bootstrap_room
    host = req.bootstrap_host
    port = req.bootstrap_port
    tp = state.traceparents.pop(rid, None)
    ids = req.origin_input_ids
    probe = is_probe(rid, host)
    # A decode knows its peer by the prefill's bootstrap address, host:port. A prefill leg's
    # request names the prefill's own address; its peer is the decode agent NIXL names later.
    peer = (f"{host}:{port}" if host and port else host) if state.role == "decode" else None
    lc.arrive(rid, bootstrap_room=room, traceparent=tp,
              prompt_tokens=len(ids) if ids is not None else None, peer=peer, probe=probe)
    if room is not None and not probe:
        state.remember_room(room, rid)
    lc.enter(rid, stage)


def _rejected(lc: Recorder, req: Any) -> None:
    """A request SGLang refused at intake (over capacity, priority, queue limit).

    SGLang has already streamed the abort, before this AFTER hook opened the
    leg; close it with SGLang's own message.
    """
    msg = getattr(req.finished_reason, "message", None) or "rejected at intake"
    lc.finish(req.rid, classify(msg), reason=msg)
    state.forget(req)


# ---- process and loop -------------------------------------------------------

def on_scheduler_ready(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    try:
        state.start_for_scheduler(self)
    except Exception:
        _counted_error()
        state.log_start_failure()


def on_shutdown(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    try:
        state.leave()
    except Exception:
        _counted_error()


def on_loop_iteration(self: Any, *args: Any, **kwargs: Any) -> None:
    rec = state.rec
    if rec is not None:
        rec.loop_iterations += 1  # Recorder.loop_tick, inlined: once per loop pass


# ---- the router's traceparent, from the HTTP process to the scheduler -----------
# SGLang 0.5.23 keeps a request's trace headers only with --enable-trace, and
# then inside its own tracing context. The HTTP process notes the traceparent
# on the request's time stats, which SGLang pickles to the scheduler; pdwatch's
# __getstate__ hook adds the note to what is pickled.

def on_request_state(result: Any, self: Any, obj: Any, request: Any = None, *args: Any, **kwargs: Any) -> None:
    """HTTP process: the traceparent header, noted on each new request's time stats."""
    if request is None:
        return
    try:
        tp = request.headers.get("traceparent")
        if not tp:
            return
        rids = obj.rid if isinstance(obj.rid, list) else (obj.rid,)
        states = self.rid_to_state
        for rid in rids:
            st = states.get(rid)
            if st is not None:
                setattr(st.time_stats, TRACEPARENT_ATTR, tp)
    except Exception:
        state.early_errors += 1


def on_time_stats_pickled(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    """HTTP process: the note travels with the time stats (their __getstate__ drops unknown fields)."""
    try:
        tp = self.__dict__.get(TRACEPARENT_ATTR)
        if tp and isinstance(result, dict):
            result[TRACEPARENT_ATTR] = tp
    except Exception:
        state.early_errors += 1


def on_generate_request(self: Any, recv_req: Any, *args: Any, **kwargs: Any) -> None:
    """Scheduler: keep the note until the leg arrives (the Req does not exist yet)."""
    if state.lc is None:
        return
    try:
        tp = getattr(recv_req.time_stats, TRACEPARENT_ATTR, None)
        if tp:
            state.keep_traceparent(recv_req.rid, tp)
    except Exception:
        _counted_error()


def on_unified_arrival(result: Any, self: Any, req: Any, is_retracted: bool = False, *args: Any, **kwargs: Any) -> None:
    lc = state.lc
    if lc is None or state.role != "unified":
        return
    try:
        if is_retracted:
            lc.enter(req.rid, "queued")
            return
        _arrive(lc, req, "queued")
        queue = self.waiting_queue
        if not queue or queue[-1] is not req:
            _rejected(lc, req)
    except Exception:
        _counted_error()


def on_prefill_batch(plan: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    lc = state.lc
    if lc is None or plan is None:
        return
    try:
        batch = plan.batch_to_run
        if batch is not None:
            for req in batch.reqs:
                lc.enter(req.rid, "prefill")
    except Exception:
        _counted_error()


def on_prefill_batch_returned(batch: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    """Releases before 0.5.16, whose get_new_batch_prefill returns the ScheduleBatch itself (or None)."""
    lc = state.lc
    if lc is None or batch is None:
        return
    try:
        for req in batch.reqs:
            lc.enter(req.rid, "prefill")
    except Exception:
        _counted_error()


def on_abort_request(result: Any, self: Any, recv_req: Any, *args: Any, **kwargs: Any) -> None:
    lc = state.lc
    if lc is None:
        return
    try:
        lc.counter("abort_requests", 1)
    except Exception:
        _counted_error()


def on_stream_output(result: Any, self: Any, reqs: Iterable[Any], *args: Any, **kwargs: Any) -> None:
    rec = state.rec
    if rec is None:
        return
    try:
        lc = state.lc
        seen = state.tokens_seen
        count_tokens = state.role != "prefill"
        for req in reqs:
            rid = req.rid
            if count_tokens:
                n = len(req.output_ids)
                prev = seen.get(rid)
                if prev is None:
                    prev = 0
                    if n > 0:
                        if lc is not None and state.role == "unified":
                            lc.enter(rid, "decode")  # unified: the first token ends prefill
                        if len(seen) >= MAX_PENDING:
                            seen.pop(next(iter(seen)))  # a request SGLang lost without a finish
                if n > prev:
                    seen[rid] = n
                    rec.token(rid, n - prev)
            reason = req.finished_reason
            if reason is not None and lc is not None:
                msg = getattr(reason, "message", None)
                if msg is None:  # FINISH_LENGTH, FINISH_MATCHED_*: a normal end
                    lc.finish(rid, "ok")
                else:
                    lc.finish(rid, classify(msg), reason=msg)
                state.forget(req)
            elif reason is not None:
                seen.pop(rid, None)
    except Exception:
        _counted_error()


# ---- prefill role -------------------------------------------------------------

def on_prefill_bootstrap_add(result: Any, self: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    lc = state.lc
    if lc is None:
        return
    try:
        _arrive(lc, req, "bootstrap")
        queue = self.queue
        if not queue or queue[-1] is not req:
            _rejected(lc, req)
    except Exception:
        _counted_error()


def on_prefill_bootstrapped(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    """Prefill: the requests the bootstrap queue popped go to the waiting queue."""
    lc = state.lc
    if lc is None or not result:
        return
    try:
        for req in result:
            lc.enter(req.rid, "queued")
    except Exception:
        _counted_error()


def on_prefill_batch_result(original: Callable[..., T], self: Any, *args: Any, **kwargs: Any) -> T:
    lc = state.lc
    before = -1
    if lc is not None:
        try:
            before = len(self.disagg_prefill_inflight_queue)
        except Exception:
            _counted_error()
    result = original(self, *args, **kwargs)
    if before >= 0 and lc is not None:
        try:
            # The backend is the recorder's (transfer_backend); bytes and the peer come per chunk.
            for req in self.disagg_prefill_inflight_queue[before:]:
                lc.enter(req.rid, "transfer")
        except Exception:
            _counted_error()
    return result


def _finish_failed(lc: Recorder, req: Any, conn: Any, what: str) -> None:
    room = req.bootstrap_room
    detail = _failure_reason(conn, room)
    stale = state.stale_note()
    reason = f"{what}: {detail}" if detail else what
    if stale:
        reason = f"{reason} ({stale})"
    lc.finish(req.rid, classify(detail, "failed"), reason=reason)
    state.forget(req)


def on_prefill_bootstrap_failure(self: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    lc = state.lc
    if lc is None:
        return
    try:
        _finish_failed(lc, req, req.disagg_kv_sender, "bootstrap failed")
    except Exception:
        _counted_error()


def on_prefill_transfer_failure(self: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    lc = state.lc
    if lc is None:
        return
    try:
        _finish_failed(lc, req, req.disagg_kv_sender, "kv transfer failed")
    except Exception:
        _counted_error()


# ---- decode role ----------------------------------------------------------------

def on_decode_prealloc_add(result: Any, self: Any, req: Any, is_retracted: bool = False, is_rebootstrap: bool = False,
                           *args: Any, **kwargs: Any) -> None:
    lc = state.lc
    if lc is None:
        return
    try:
        if is_retracted:
            lc.enter(req.rid, "queued")  # retracted: waits to be resumed into a batch
            return
        if is_rebootstrap:
            lc.enter(req.rid, "bootstrap")  # the same leg handshakes again (weight update)
            return
        _arrive(lc, req, "bootstrap")
        queue = self.queue
        if not queue or queue[-1].req is not req:
            _rejected(lc, req)
    except Exception:
        _counted_error()


def on_decode_metadata_sent(result: Any, self: Any, decode_req: Any, *args: Any, **kwargs: Any) -> None:
    """Decode: KV memory is preallocated and its address sent to the prefill; the KV may now come."""
    lc = state.lc
    if lc is None:
        return
    try:
        lc.enter(decode_req.req.rid, "transfer")  # the backend is the recorder's (transfer_backend)
    except Exception:
        _counted_error()


def on_decode_transfer_queued(result: Any, self: Any, decode_reqs: Any, *args: Any, **kwargs: Any) -> None:
    """Decode, releases without a per-request metadata send (<= 0.5.16): the preallocated requests, their
    addresses just sent to the prefill, join the transfer queue. Called every loop turn, mostly empty."""
    lc = state.lc
    if lc is None or not decode_reqs:
        return
    try:
        for decode_req in decode_reqs:
            lc.enter(decode_req.req.rid, "transfer")
    except Exception:
        _counted_error()


def on_decode_transferred(result: Any, self: Any, decode_req: Any, *args: Any, **kwargs: Any) -> None:
    """Decode: the request's KV arrived and is committed to it; it goes to the waiting queue."""
    lc = state.lc
    if lc is None:
        return
    try:
        lc.enter(decode_req.req.rid, "queued")
    except Exception:
        _counted_error()


def on_decode_transfer_failure(self: Any, decode_req: Any, *args: Any, **kwargs: Any) -> None:
    lc = state.lc
    if lc is None:
        return
    try:
        _finish_failed(lc, decode_req.req, decode_req.kv_receiver, "kv transfer failed")
    except Exception:
        _counted_error()


def on_decode_batch(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    """Decode: the prebuilt batch's requests start decoding (self: the ScheduleBatch)."""
    lc = state.lc
    if lc is None:
        return
    try:
        for req in self.reqs:
            lc.enter(req.rid, "decode")
    except Exception:
        _counted_error()


# ---- KV managers and NIXL ---------------------------------------------------------

def _leg_error(room: int | None, reason: object) -> None:
    """A KV failure the engine recorded for a room: an error of the open leg until the leg ends."""
    lc = state.lc
    rid = state.room_rids.get(room) if room is not None else None
    if lc is not None and rid is not None:
        lc.leg_error(rid, f"KV failure: {reason}")


def on_kv_failure(result: Any, self: Any, bootstrap_room: int | None, failure_reason: object, *args: Any, **kwargs: Any) -> None:
    rec = state.rec
    if rec is None:
        return
    try:
        text = str(failure_reason).lower()
        timed_out = any(w in text for w in _TIMEOUT_WORDS)
        rec.counter("kv_timeouts" if timed_out else "kv_transfer_failures", 1)
        _leg_error(bootstrap_room, failure_reason)
    except Exception:
        _counted_error()


def on_kv_concluded(result: Any, self: Any, *args: Any, bootstrap_room: int | None = None, **kwargs: Any) -> None:
    """A room's transfer concluded; a Failed conclusion (the most common NIXL failure, which never
    goes through record_failure) is the leg's error until the scheduler polls it and ends the leg."""
    if state.lc is None or result != KV_FAILED:
        return
    try:
        _leg_error(bootstrap_room, self.failure_records.get(bootstrap_room) or kwargs.get("failure_reason"))
    except Exception:
        _counted_error()


def on_nixl_peer_added(original: Callable[..., T], self: Any, decode_kv_args: Any, *args: Any, **kwargs: Any) -> T:
    replaced: list[str] | None = None
    try:
        replaced = state.stale_candidates(self.decode_kv_args_table, decode_kv_args)
    except Exception:
        _counted_error()
    result = original(self, decode_kv_args, *args, **kwargs)
    try:
        rec = state.rec
        name = decode_kv_args.agent_name
        if rec is not None and replaced is not None and name in self.decode_kv_args_table:
            rec.counter("kv_peers_added", 1)
            if replaced:
                state.note_stale(replaced, name)
                rec.counter("kv_stale_peers", len(replaced))
    except Exception:
        _counted_error()
    return result


def on_nixl_peers_invalidated(self: Any, room_transfer_infos: Any, *args: Any, **kwargs: Any) -> None:
    rec = state.rec
    if rec is None or not room_transfer_infos:
        return
    try:
        table = self.decode_kv_args_table
        dropped = sum(
            1 for name in list(room_transfer_infos)
            if name in table and not self.agent.check_remote_metadata(name)
        )
        if dropped:
            rec.counter("kv_peers_removed", dropped)
    except Exception:
        _counted_error()


def on_nixl_transfer_request(result: Any, self: Any, bootstrap_room: int, kv_indices: Any, *args: Any, **kwargs: Any) -> None:
    lc = state.lc
    if lc is None:
        return
    try:
        infos = self.transfer_infos.get(bootstrap_room)
        if infos is None:
            return  # dummy rank or already cleared: nothing is sent
        per_index = state.bytes_per_index(self)
        nbytes = state.add_room_bytes(bootstrap_room, len(kv_indices) * per_index)
        rid = state.room_rids.get(bootstrap_room)
        if rid is not None:
            lc.transfer_info(rid, nbytes=nbytes, backend="nixl", peer=",".join(infos))
        lc.counter("kv_transfer_bytes", len(kv_indices) * per_index)
    except Exception:
        _counted_error()
