"""Every SGLang function the plugin hooks, in one table.

The plugin registers from this table, the start-up guard resolves it against
the running SGLang, and the contract test reads the installed source with
`ast` against it. `params` are the parameters the hook reads by name; `attrs`
are the attributes the hook reads off SGLang objects, each as `Class.attr`,
checked to be a field, property, method or `self.attr` assignment of that
SGLang class or one of its bases. Written for sglang 0.5.23; older releases have rows of their own.

Each target belongs to a group, and the group says what refusing it costs
(`GROUP_NEED`): without the `process` group there is no recorder at all;
without every `lifecycle` target the plugin would record legs that enter
stages and never leave them, so the whole lifecycle is refused and the plugin
only heartbeats (`inactive`); any other group can be refused alone (`partial`).
`versions` keeps a target to a range of SGLang releases: one table, a row per
range where releases differ (see `for_version`).
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from ..hook_table import ESSENTIAL as ESSENTIAL
from ..hook_table import GAP as GAP
from ..hook_table import LIFECYCLE as LIFECYCLE
from ..hook_table import OPTIONAL as OPTIONAL
from ..hook_table import Target as Target

SCHED = "sglang.srt.managers.scheduler.Scheduler"
PREFILL = "sglang.srt.disaggregation.prefill"
DECODE = "sglang.srt.disaggregation.decode"
DECODE_BATCH = "sglang.srt.disaggregation.decode_schedule_batch_mixin.ScheduleBatchDisaggregationDecodeMixin"
STREAMER = "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
COMMON_MGR = "sglang.srt.disaggregation.common.conn.CommonKVManager"
TOKENIZER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
TIME_STATS = "sglang.srt.observability.req_time_stats.APIServerReqTimeStats"
# What every arriving leg reads off SGLang's Req.
_REQ_ARRIVAL = ("Req.rid", "Req.bootstrap_room", "Req.bootstrap_host", "Req.bootstrap_port",
                "Req.origin_input_ids")
NIXL_MGR = "sglang.srt.disaggregation.nixl.conn.NixlKVManager"
TARGETS: tuple[Target, ...] = (
    # -- process and loop ----------------------------------------------------
    Target(f"{SCHED}.init_disaggregation", "after", "on_scheduler_ready",
           "creates the process recorder (role, TP rank/size, GPU UUIDs, peer ids: KV agent, bootstrap address, "
           "how long the idle loop may stand still)",
           ("self",), ("Scheduler.disaggregation_mode", "Scheduler.idle_sleeper", "Scheduler.disagg_decode_prealloc_queue",
                       "Scheduler.disagg_prefill_bootstrap_queue", "DecodePreallocQueue.kv_manager",
                       "PrefillBootstrapQueue.kv_manager", "NixlKVManager.agent", "CommonKVManager.bootstrap_host",
                       "CommonKVManager.bootstrap_port"), group="process"),
    Target(f"{SCHED}.ingest_requests", "before", "on_loop_iteration",
           "one scheduler loop iteration (heartbeat pd.loop.iterations)", ("self",), group="process",
           versions=">0.5.16"),
    # Before ingest_requests, every event loop (normal, PD prefill, PD decode) called this once a turn.
    Target(f"{SCHED}.process_input_requests", "before", "on_loop_iteration",
           "one scheduler loop iteration (heartbeat pd.loop.iterations)", ("self",), group="process",
           versions="<=0.5.16"),
    # SIGTERM to an SGLang server drains its requests in the HTTP process, then sends every scheduler
    # a ShutdownReq, which ends its loop; the schedulers still alive 15 s later are SIGKILLed.
    Target(f"{SCHED}.handle_shutdown", "after", "on_shutdown",
           "the process leaves in order: the recorder's final heartbeat (pd.heartbeat.final) lists what it "
           "still holds", ("self",), group="shutdown", versions=">=0.5.16"),
    Target(f"{SCHED}.handle_shutdown", "after", GAP, "no ShutdownReq handler: no orderly stop to hook, no final "
           "heartbeat (the sidecar ages the instance out)", group="shutdown", versions="<0.5.16"),
    # -- the router's traceparent: HTTP process -> scheduler --------------------
    Target(f"{TOKENIZER}._init_req_state", "after", "on_request_state",
           "HTTP process: notes the request's traceparent header on its time stats",
           ("self", "obj", "request"),
           ("TokenizerManager.rid_to_state", "ReqState.time_stats", "GenerateReqInput.rid"), group="traceparent"),
    Target(f"{TIME_STATS}.__getstate__", "after", "on_time_stats_pickled",
           "HTTP process: the traceparent note is pickled to the scheduler with the time stats", ("self",),
           group="traceparent"),
    Target(f"{SCHED}.handle_generate_request", "before", "on_generate_request",
           "scheduler: keeps the traceparent until the leg arrives", ("self", "recv_req"),
           ("TokenizedGenerateReqInput.time_stats", "TokenizedGenerateReqInput.rid"), group="traceparent"),
    Target(f"{SCHED}._add_request_to_queue", "after", "on_unified_arrival",
           "unified: arrival, enters queued (or ends aborted when refused)",
           ("self", "req", "is_retracted"), ("Scheduler.waiting_queue", *_REQ_ARRIVAL)),
    Target(f"{SCHED}.get_new_batch_prefill", "after", "on_prefill_batch",
           "prefill/unified: queued -> prefill (forward)", ("self",),
           ("NextBatchPlan.batch_to_run", "ScheduleBatch.reqs", "Req.rid"), versions=">=0.5.16"),
    Target(f"{SCHED}.get_new_batch_prefill", "after", "on_prefill_batch_returned",
           "prefill/unified: queued -> prefill (forward; the ScheduleBatch itself, before NextBatchPlan)",
           ("self",), ("ScheduleBatch.reqs", "Req.rid"), versions="<0.5.16"),
    Target(f"{SCHED}.abort_request", "after", "on_abort_request",
           "abort requested (counted; the leg ends where its output is streamed)", ("self", "recv_req"),
           group="aborts"),
    Target(f"{STREAMER}.stream_output", "after", "on_stream_output",
           "tokens streamed; a finished request ends its leg (ok / aborted / failed / timeout)",
           ("self", "reqs"), ("Req.rid", "Req.output_ids", "Req.finished_reason", "Req.bootstrap_room"),
           versions=">=0.5.13"),
    Target(f"{STREAMER}.stream_output", "after", GAP, "no SchedulerOutputStreamer (the scheduler streams "
           "itself): where legs end is not adapted", versions="<0.5.13"),
    # -- prefill role ----------------------------------------------------------
    Target(f"{PREFILL}.PrefillBootstrapQueue.add", "after", "on_prefill_bootstrap_add",
           "prefill: arrival, enters bootstrap (or ends aborted when rejected at intake)",
           ("self", "req"), ("PrefillBootstrapQueue.queue", *_REQ_ARRIVAL)),
    Target(f"{PREFILL}.PrefillBootstrapQueue.pop_bootstrapped", "after", "on_prefill_bootstrapped",
           "prefill: bootstrap -> queued", ("self",), ("Req.rid",)),
    Target(f"{PREFILL}.SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill",
           "around", "on_prefill_batch_result",
           "prefill: prefill -> transfer (joins the inflight queue)", ("self",),
           ("Scheduler.disagg_prefill_inflight_queue", "Req.rid")),
    Target(f"{PREFILL}.SchedulerDisaggregationPrefillMixin.handle_bootstrap_failure", "before",
           "on_prefill_bootstrap_failure", "prefill: bootstrap failed or timed out", ("self", "req"),
           ("Req.disagg_kv_sender", "CommonKVSender.kv_mgr", "CommonKVManager.failure_records"), versions=">=0.5.13"),
    Target(f"{PREFILL}.SchedulerDisaggregationPrefillMixin.handle_bootstrap_failure", "before", GAP,
           "no bootstrap-failure handler: failed bootstraps end elsewhere, not adapted", versions="<0.5.13"),
    Target(f"{PREFILL}.SchedulerDisaggregationPrefillMixin.handle_inflight_transfer_failure", "before",
           "on_prefill_transfer_failure", "prefill: KV transfer failed", ("self", "req"),
           ("Req.disagg_kv_sender", "CommonKVSender.kv_mgr", "CommonKVManager.failure_records"), versions=">=0.5.16"),
    # Before it, the inflight queue aborted a failed transfer inline and streamed it with the done ones
    # (prepare_abort, then stream_output): the leg ends there, failed, with SGLang's message; no row.
    # -- decode role -----------------------------------------------------------
    Target(f"{DECODE}.DecodePreallocQueue.add", "after", "on_decode_prealloc_add",
           "decode: arrival, enters bootstrap (handshake + prealloc); retracted: queued; rebootstrap: bootstrap again",
           ("self", "req", "is_retracted", "is_rebootstrap"),
           ("DecodePreallocQueue.queue", "DecodeRequest.req", *_REQ_ARRIVAL), versions=">=0.5.16"),
    # No rebootstrap before 0.5.16; the hook's is_rebootstrap defaults to False.
    Target(f"{DECODE}.DecodePreallocQueue.add", "after", "on_decode_prealloc_add",
           "decode: arrival, enters bootstrap (handshake + prealloc); retracted: queued",
           ("self", "req", "is_retracted"),
           ("DecodePreallocQueue.queue", "DecodeRequest.req", *_REQ_ARRIVAL), versions="<0.5.16"),
    # Per request, not per loop turn (nor DecodeTransferQueue.extend, which runs on every turn,
    # mostly empty): both the device and the host preallocation paths send the address here.
    Target(f"{DECODE}.DecodePreallocQueue._send_kv_metadata", "after", "on_decode_metadata_sent",
           "decode: bootstrap -> transfer (KV memory preallocated, its address sent to the prefill)",
           ("self", "decode_req"), ("DecodeRequest.req", "Req.rid"), versions=">0.5.16"),
    # Before it, pop_preallocated sent each address inline and the scheduler moved what it returned
    # into the transfer queue with extend, once a loop turn (mostly empty: the hook returns at once).
    Target(f"{DECODE}.DecodeTransferQueue.extend", "after", "on_decode_transfer_queued",
           "decode: bootstrap -> transfer (the preallocated requests join the transfer queue, their KV "
           "addresses just sent to the prefill)", ("self", "decode_reqs"), ("DecodeRequest.req", "Req.rid"),
           versions="<=0.5.16"),
    # Also per request: pop_transferred and get_new_prebuilt_batch run on every
    # decode loop turn (about 80 a request here), and a wrapped call costs ~1 us there live.
    Target(f"{DECODE}.DecodeTransferQueue._commit_transfer_to_req", "after", "on_decode_transferred",
           "decode: transfer -> queued (the KV arrived, committed to the request)", ("self", "decode_req"),
           ("DecodeRequest.req", "Req.rid")),
    Target(f"{DECODE}.DecodeTransferQueue._abort_failed_transfer", "before", "on_decode_transfer_failure",
           "decode: KV transfer failed or timed out", ("self", "decode_req"),
           ("DecodeRequest.req", "DecodeRequest.kv_receiver", "CommonKVReceiver.kv_mgr",
            "CommonKVManager.failure_records"), versions=">0.5.16"),
    # Before it, pop_transferred aborted a failed transfer inline and streamed the abort at once
    # (prepare_abort, then stream_output): the leg ends there, failed, with SGLang's message, and no
    # row is needed; what is lost is the failure record's reason and the stale-peer note.
    Target(f"{DECODE_BATCH}.process_prebuilt", "after", "on_decode_batch",
           "decode: queued -> decode (the prebuilt batch, about to join the running batch)", ("self",),
           ("ScheduleBatch.reqs",)),
    # -- KV managers (any backend) and NIXL ----------------------------------
    Target(f"{COMMON_MGR}.record_failure", "after", "on_kv_failure",
           "KV failure recorded for a room (counted; timeouts apart; the open leg's error)",
           ("self", "bootstrap_room", "failure_reason"), ("CommonKVManager.failure_records",), group="kv_failures"),
    Target(f"{COMMON_MGR}.conclude_transfer", "after", "on_kv_concluded",
           "a room's transfer concluded Failed: the open leg's error until the scheduler ends it",
           ("self",), ("CommonKVManager.failure_records",), kwonly=("bootstrap_room", "status", "failure_reason"),
           group="kv_concluded", versions=">0.5.16"),
    Target(f"{COMMON_MGR}.conclude_transfer", "after", GAP, "no conclude_transfer: a Failed conclusion is not "
           "the open leg's error", group="kv_concluded", versions="<=0.5.16"),
    Target(f"{NIXL_MGR}._add_remote_peer", "around", "on_nixl_peer_added",
           "NIXL peer added; a decode agent back under a new name is a stale peer",
           ("self", "decode_kv_args"),
           ("NixlKVManager.decode_kv_args_table", "KVArgsRegisterInfo.agent_name", "KVArgsRegisterInfo.endpoint",
            "KVArgsRegisterInfo.gpu_id", "KVArgsRegisterInfo.decode_tp_rank"), group="nixl_peers"),
    Target(f"{NIXL_MGR}._reload_invalidated_peers", "before", "on_nixl_peers_invalidated",
           "NIXL dropped peers after a transport error (peers removed)",
           ("self", "room_transfer_infos"), ("NixlKVManager.decode_kv_args_table", "NixlKVManager.agent"),
           group="nixl_invalidated", versions=">0.5.16"),
    # Before it, NIXL never dropped a peer after a transport error: nothing to count, no row.
    Target(f"{NIXL_MGR}.add_transfer_request", "after", "on_nixl_transfer_request",
           "prefill: KV chunk queued for NIXL (bytes, backend, peer)",
           ("self", "bootstrap_room", "kv_indices"),
           ("NixlKVManager.transfer_infos", "CommonKVManager.kv_args", "KVArgs.kv_item_lens"), group="nixl_bytes"),
)

# What refusing a group costs. essential: no recorder, so nothing at all (not even heartbeats);
# lifecycle: heartbeats only (inactive); optional: the group alone (partial).
GROUP_NEED = {
    "process": ESSENTIAL,
    "lifecycle": LIFECYCLE,
    "shutdown": OPTIONAL,  # no final heartbeat: the sidecar ages the instance out instead
    "traceparent": OPTIONAL,  # legs not joined to the router's trace
    "aborts": OPTIONAL,
    "kv_failures": OPTIONAL,
    "kv_concluded": OPTIONAL,
    "nixl_peers": OPTIONAL,
    "nixl_invalidated": OPTIONAL,
    "nixl_bytes": OPTIONAL,
}
# Releases `make test-matrix` checks this table against (check + contract test); live PD runs: 0.5.23
# (make test) and 0.5.16 (make test-matrix).
# Elsewhere `pdwatch check` calls each target untested, whatever it finds.
TESTED = ("0.5.11", "0.5.13", "0.5.16", "0.5.23")


def for_version(version: str | None, table: tuple[Target, ...] | None = None) -> tuple[Target, ...]:
    """The rows of `table` (default TARGETS) for one SGLang release; no version, or one that does not
    parse (a source checkout): the rows of the newest release tested, the one the table is written for."""
    table = TARGETS if table is None else table
    try:
        v = Version(version or TESTED[-1])
    except InvalidVersion:
        v = Version(TESTED[-1])
    return tuple(t for t in table if not t.versions or SpecifierSet(t.versions).contains(v, prereleases=True))


def installed_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None
