"""The adapter's hooks, one per row of the table (targets.py). Most run after the
vLLM connector method their row names, on the EngineCore's scheduler thread, and
only append to the recorder; one runs in the API server (on_add_request, before
AsyncLLM.add_request) and two in the Worker (on_leases_reaped, on_worker_meta).

An `after` hook is called as hook(result, connector, *args, **kwargs) and an
`around` one as hook(call, connector, *args, **kwargs); the caller
(connector.py, or plugin() for the API server's) catches and counts whatever a
hook raises. A Worker has no recorder: its hook errors are counted in
state.early_errors and carried to the EngineCore's recorder in the step's
worker metadata (worker_meta.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from .state import state
from .targets import LEASE_EXPIRES_KEY, TRACEPARENT_KEY

# vLLM's finished statuses (RequestStatus names) and the contract's pd.outcome for each.
_OUTCOME = {
    "FINISHED_STOPPED": "ok",
    "FINISHED_LENGTH_CAPPED": "ok",
    "FINISHED_REPETITION": "ok",
    "FINISHED_ABORTED": "aborted",
    "FINISHED_IGNORED": "failed",  # refused: the prompt does not fit
    "FINISHED_ERROR": "failed",
}


LEASE_EXPIRED = "KV lease expired: the prefill freed the blocks before the decode read them"
READ_AFTER_LEASE = ("the prefill's KV lease had expired when this decode took the request: it reads blocks the "
                    "prefill freed (potentially invalid KV)")
# Clocks of two hosts differ: a decode names a read after the lease only this far past its end.
LEASE_SKEW_S = 1.0


def counted_error() -> None:
    rec = state.rec
    if rec is not None:
        rec.hook_errors += 1
    else:
        state.early_errors += 1


def on_connector_built(result: Any, self: Any, vllm_config: Any, role: Any, *args: Any, **kwargs: Any) -> None:
    name = getattr(role, "name", str(role))
    if name == "SCHEDULER":
        state.start(self, vllm_config)
    elif name == "WORKER" and self.connector_worker is not None:
        for row in state.worker_rows:
            _wrap_worker(self.connector_worker, row.method, globals()[row.hook])


def _wrap_worker(worker: Any, name: str, hook: Callable[..., None]) -> None:
    """Wrap one method of this worker object (not its class): after it, the hook, errors counted."""
    original = getattr(worker, name)

    def method(*args: Any, **kwargs: Any) -> Any:
        try:
            before = _before(worker, name)
        except Exception:  # the engine must never suffer for pdwatch
            counted_error()
            before = None
        result = original(*args, **kwargs)
        try:
            hook(result, worker, *args, before=before, **kwargs)
        except Exception:
            counted_error()
        return result

    setattr(worker, name, method)


def _before(worker: Any, name: str) -> Any:
    """What a worker hook needs of the state before the call: the leases still held."""
    if name == "_reap_expired_send_leases":
        pending = worker._reqs_to_send
        return tuple(pending) if pending else ()
    return None


def on_leases_reaped(result: Any, worker: Any, done_sending: set[str], *args: Any, before: Any = (),
                     **kwargs: Any) -> None:
    """Leases held before the reap that it freed: vLLM moved them to done_sending unread."""
    if not before:
        return
    held = worker._reqs_to_send
    expired = {rid for rid in before if rid not in held and rid in done_sending}
    if expired:
        state.lease_expired |= expired


def on_worker_meta(call: Callable[[], Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    result = call()
    if result is not None or not (state.lease_expired or state.early_errors):
        return result  # vLLM's own metadata, if it ever has some, goes first
    from .worker_meta import PdwatchWorkerMeta

    expired, state.lease_expired = state.lease_expired, set()
    errors, state.early_errors = state.early_errors, 0
    return PdwatchWorkerMeta(lease_expired=expired, hook_errors=errors)


def on_new_request(result: Any, self: Any, request: Any, *args: Any, **kwargs: Any) -> None:
    rec = state.rec
    if rec is not None:
        # The EngineCore's loop turned to take this request in. An idle EngineCore blocks on its input
        # queue and steps no more, so its counter stood still the whole idle spell; without this turn
        # the first heartbeat listing the new leg read as a loop frozen that long (seen live).
        rec.loop_tick()
    lc = state.lc
    if lc is None:
        return
    rid = request.request_id
    params = request.kv_transfer_params or {}
    headers = request.trace_headers
    traceparent = headers.get("traceparent") if headers else None
    if traceparent is None:
        extra = request.sampling_params.extra_args if request.sampling_params is not None else None
        traceparent = extra.get(TRACEPARENT_KEY) if extra else None
    expires = None
    if state.role == "decode":
        prefill_rid, peer, stage = params.get("remote_request_id"), params.get("remote_engine_id"), "bootstrap"
        expires = params.get(LEASE_EXPIRES_KEY)
    else:
        prefill_rid, peer, stage = rid, None, "queued"  # nothing to handshake before: the decode pulls later
    # Both legs know the prefill's request id: the room is its hash (legs.room_from_key), taken on the
    # recorder's worker thread, and the leg enters its first stage in the same record.
    lc.arrive(rid, room_key=str(prefill_rid) if prefill_rid else None, traceparent=traceparent,
              prompt_tokens=request.num_prompt_tokens, peer=str(peer) if peer else None, stage=stage)
    if isinstance(expires, (int, float)) and time.time() > expires + LEASE_SKEW_S:
        lc.leg_error(rid, READ_AFTER_LEASE)  # vLLM reads them all the same and answers 200
    state.note(rid, stage)


def on_add_request(self: Any, request_id: str, prompt: Any, params: Any, arrival_time: Any = None,
                   lora_request: Any = None, tokenization_kwargs: Any = None, trace_headers: Any = None,
                   *args: Any, **kwargs: Any) -> None:
    """API server, before vLLM's add_request: keep the traceparent where the EngineCore will find it."""
    traceparent = trace_headers.get("traceparent") if trace_headers else None
    if traceparent and hasattr(params, "extra_args"):
        params.extra_args = {**(params.extra_args or {}), TRACEPARENT_KEY: traceparent}


def on_blocks_allocated(result: Any, self: Any, request: Any, blocks: Any, num_external_tokens: int,
                        *args: Any, **kwargs: Any) -> None:
    lc = state.lc
    if lc is None or state.role != "decode":
        return
    rid = request.request_id
    if state.stages.get(rid) != "bootstrap":
        return
    # Nothing to read (a full local prefix hit, or no remote prefill): the leg waits for a batch.
    stage = "transfer" if num_external_tokens > 0 else "queued"
    lc.enter(rid, stage)
    state.stages[rid] = stage


def on_step(result: Any, self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> None:
    rec = state.rec
    if rec is None:
        return
    rec.loop_tick()
    lc = state.lc
    stages = state.stages
    if lc is None or not stages:
        return
    working = "decode" if state.role == "decode" else "prefill"
    preempted = scheduler_output.preempted_req_ids
    if preempted:
        for rid in preempted:
            if rid in stages:
                lc.enter(rid, "queued")
                stages[rid] = "queued"
    # A decode step makes one token for each request it schedules.
    decoding = working == "decode"
    for new in scheduler_output.scheduled_new_reqs:
        rid = new.req_id
        _working(lc, stages, rid, working)
        if decoding and stages.get(rid) == "decode":
            lc.token(rid)
    cached = scheduler_output.scheduled_cached_reqs
    for rid in cached.resumed_req_ids:
        _working(lc, stages, rid, working)
    if decoding:
        for rid in cached.req_ids:
            if stages.get(rid) == "decode":
                lc.token(rid)


def _working(lc: Any, stages: dict[str, str], rid: str, stage: str) -> None:
    now = stages.get(rid)
    if now is not None and now != stage:
        lc.enter(rid, stage)
        stages[rid] = stage


def on_transfer_results(result: Any, self: Any, connector_output: Any, *args: Any, **kwargs: Any) -> None:
    meta = getattr(connector_output, "kv_connector_worker_meta", None)
    worker_errors = getattr(meta, "hook_errors", 0)
    if worker_errors and state.rec is not None:
        state.rec.hook_errors += worker_errors  # the Workers' hooks', counted where a recorder reports them
    lc = state.lc
    if lc is None:
        return
    stages = state.stages
    expired = getattr(meta, "lease_expired", None) or ()
    # The prefill's blocks were read (the workers say done sending), or their lease ran out: its leg ends.
    for rid in _ids(connector_output.finished_sending):
        if stages.get(rid) == "transfer":
            del stages[rid]
            if rid in expired:
                # An error the engine met on the leg (its transfer stage carries it), and the leg's end.
                lc.leg_error(rid, LEASE_EXPIRED)
                lc.finish(rid, "timeout", reason=LEASE_EXPIRED)
            else:
                lc.finish(rid, "ok")
    failed = connector_output.failed_recving or ()
    for rid in failed:
        if rid in stages:
            lc.leg_error(rid, "KV READ failed")
    # A decode's READ is done (failed ones are in this set too): it waits for a batch.
    for rid in _ids(connector_output.finished_recving):
        if stages.get(rid) == "transfer":
            lc.enter(rid, "queued")
            stages[rid] = "queued"


def _ids(ids: Iterable[str] | None) -> Iterable[str]:
    return ids or ()


def on_request_finished(result: Any, self: Any, request: Any, block_ids: Any, *args: Any, **kwargs: Any) -> None:
    lc = state.lc
    if lc is None:
        return
    rid = request.request_id
    stages = state.stages
    if rid not in stages:
        return
    status = getattr(request.status, "name", None) or str(request.status)  # str() only where no name: it is slow
    outcome = _OUTCOME.get(status, "failed")
    delay_free = bool(result and result[0])
    if state.role == "prefill" and delay_free and outcome == "ok":
        # Its blocks stay for the decode's READ, until the workers report them read or the lease ends;
        # the decode learns when that is from the kv_transfer_params (LEASE_EXPIRES_KEY).
        lc.enter(rid, "transfer")
        stages[rid] = "transfer"
        params = result[1]
        if state.lease_s and isinstance(params, dict):
            params[LEASE_EXPIRES_KEY] = time.time() + state.lease_s
        return
    del stages[rid]
    lc.finish(rid, outcome, reason=None if outcome == "ok" else f"vLLM status {status}",
              output_tokens=request.num_output_tokens)


def on_shutdown(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    if self.connector_scheduler is not None:
        state.leave()
