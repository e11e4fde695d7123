"""Every SGLang function the plugin hooks, in one table.

The plugin registers from this table, the start-up guard resolves it against
the running SGLang, and the contract test reads the installed source with
`ast` against it. `params` are the parameters the hook reads by name; `attrs`
are attributes the hook reads off SGLang objects (checked to appear in the
target's module source). Written for sglang 0.5.23.
"""

from __future__ import annotations

from typing import NamedTuple

SCHED = "sglang.srt.managers.scheduler.Scheduler"
PREFILL = "sglang.srt.disaggregation.prefill"
DECODE = "sglang.srt.disaggregation.decode"
STREAMER = "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
COMMON_MGR = "sglang.srt.disaggregation.common.conn.CommonKVManager"
NIXL_MGR = "sglang.srt.disaggregation.nixl.conn.NixlKVManager"


class Target(NamedTuple):
    path: str  # module.Class.method, as HookRegistry takes it
    hook_type: str  # "before" | "after" | "around"
    hook: str  # name of the function in engine_patches.sglang.hooks
    transition: str  # what the hook records
    params: tuple[str, ...] = ()
    attrs: tuple[str, ...] = ()

    @property
    def module(self) -> str:
        return self.path.rsplit(".", 2)[0]

    @property
    def cls(self) -> str:
        return self.path.rsplit(".", 2)[1]

    @property
    def method(self) -> str:
        return self.path.rsplit(".", 2)[2]


TARGETS: tuple[Target, ...] = (
    # -- process and loop ----------------------------------------------------
    Target(f"{SCHED}.init_disaggregation", "after", "on_scheduler_ready",
           "creates the process recorder (role, TP rank/size, GPU UUIDs)",
           ("self",), ("disaggregation_mode", "gpu_id")),
    Target(f"{SCHED}.ingest_requests", "before", "on_loop_iteration",
           "one scheduler loop iteration (heartbeat pd.loop.iterations)", ("self",)),
    Target(f"{SCHED}.handle_generate_request", "before", "on_generate_request",
           "keeps the router's traceparent before SGLang drops it", ("self", "recv_req"),
           ("external_trace_header",)),
    Target(f"{SCHED}._add_request_to_queue", "after", "on_unified_arrival",
           "unified: arrival, enters queued (or ends aborted when refused)",
           ("self", "req", "is_retracted"), ("waiting_queue",)),
    Target(f"{SCHED}.get_new_batch_prefill", "after", "on_prefill_batch",
           "prefill/unified: queued -> prefill (forward)", ("self",),
           ("batch_to_run",)),
    Target(f"{SCHED}.abort_request", "after", "on_abort_request",
           "abort requested (counted; the leg ends where its output is streamed)", ("self", "recv_req")),
    Target(f"{STREAMER}.stream_output", "after", "on_stream_output",
           "tokens streamed; a finished request ends its leg (ok / aborted / failed / timeout)",
           ("self", "reqs"), ("finished_reason",)),
    # -- prefill role ----------------------------------------------------------
    Target(f"{PREFILL}.PrefillBootstrapQueue.add", "after", "on_prefill_bootstrap_add",
           "prefill: arrival, enters bootstrap (or ends aborted when rejected at intake)",
           ("self", "req"), ("queue", "bootstrap_room", "bootstrap_host", "origin_input_ids")),
    Target(f"{PREFILL}.PrefillBootstrapQueue.pop_bootstrapped", "after", "on_prefill_bootstrapped",
           "prefill: bootstrap -> queued", ("self",)),
    Target(f"{PREFILL}.SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill",
           "around", "on_prefill_batch_result",
           "prefill: prefill -> transfer (joins the inflight queue)", ("self",),
           ("disagg_prefill_inflight_queue",)),
    Target(f"{PREFILL}.SchedulerDisaggregationPrefillMixin.handle_bootstrap_failure", "before",
           "on_prefill_bootstrap_failure", "prefill: bootstrap failed or timed out", ("self", "req"),
           ("disagg_kv_sender", "failure_records")),
    Target(f"{PREFILL}.SchedulerDisaggregationPrefillMixin.handle_inflight_transfer_failure", "before",
           "on_prefill_transfer_failure", "prefill: KV transfer failed", ("self", "req"),
           ("disagg_kv_sender", "failure_records")),
    # -- decode role -----------------------------------------------------------
    Target(f"{DECODE}.DecodePreallocQueue.add", "after", "on_decode_prealloc_add",
           "decode: arrival, enters bootstrap (handshake + prealloc); retracted: queued; rebootstrap: bootstrap again",
           ("self", "req", "is_retracted", "is_rebootstrap"), ("queue", "retracted_queue")),
    Target(f"{DECODE}.DecodeTransferQueue.extend", "after", "on_decode_transfer_extend",
           "decode: bootstrap -> transfer (KV memory preallocated)", ("self", "decode_reqs")),
    Target(f"{DECODE}.DecodeTransferQueue.add", "after", "on_decode_transfer_add",
           "decode: bootstrap -> transfer (single request)", ("self", "decode_req")),
    Target(f"{DECODE}.DecodeTransferQueue.pop_transferred", "after", "on_decode_transferred",
           "decode: transfer -> queued (waiting queue)", ("self",)),
    Target(f"{DECODE}.DecodeTransferQueue._abort_failed_transfer", "before", "on_decode_transfer_failure",
           "decode: KV transfer failed or timed out", ("self", "decode_req"), ("kv_receiver",)),
    Target(f"{DECODE}.SchedulerDisaggregationDecodeMixin.get_new_prebuilt_batch", "after",
           "on_decode_batch", "decode: queued -> decode (running batch)", ("self",), ("reqs",)),
    # -- KV managers (any backend) and NIXL ----------------------------------
    Target(f"{COMMON_MGR}.record_failure", "after", "on_kv_failure",
           "KV failure recorded for a room (counted; timeouts apart)",
           ("self", "bootstrap_room", "failure_reason"), ("failure_records",)),
    Target(f"{NIXL_MGR}._add_remote_peer", "around", "on_nixl_peer_added",
           "NIXL peer added; a decode agent back under a new name is a stale peer",
           ("self", "decode_kv_args"), ("decode_kv_args_table", "agent_name", "endpoint", "gpu_id", "decode_tp_rank")),
    Target(f"{NIXL_MGR}._reload_invalidated_peers", "before", "on_nixl_peers_invalidated",
           "NIXL dropped peers after a transport error (peers removed)",
           ("self", "room_transfer_infos"), ("check_remote_metadata",)),
    Target(f"{NIXL_MGR}.add_transfer_request", "after", "on_nixl_transfer_request",
           "prefill: KV chunk queued for NIXL (bytes, backend, peer)",
           ("self", "bootstrap_room", "kv_indices"), ("transfer_infos", "kv_item_lens")),
)

BY_HOOK = {t.hook: t for t in TARGETS}
