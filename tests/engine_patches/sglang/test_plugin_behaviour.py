"""The plugin loaded by SGLang's own loader, driven through real SGLang classes: the paths a live server does not reach.

The tests of record run a live SGLang PD stack (tests/live/test_sglang_pair.py):
legs walking every stage on both roles, the router's traceparent and the room
join, SGLang's probes, the heartbeat inventory, transfer bytes and peers, zero
hook errors, a restarted, a frozen and a wedged decode. What stays here is what
a live stack on this CPU cannot reach, or only in minutes:

- a request rejected at intake (the queue full), a bootstrap timeout (300 s in
  SGLang), a decode transfer failure through its abort path, user aborts and
  the decode waiting timeout (300 s): the failure outcomes and their reasons;
- a TP rank that does not own request bookkeeping (TP > 1 needs more cores);
- NIXL peers replaced and invalidated after a transport error;
- a hook that raises, a missing hook target, the plugin switched off, the
  recorder's identity from the environment;
- unified (non-PD) serving, retraction and re-bootstrap.

Real parts: SGLang's `load_plugins()` and `HookRegistry`, `Req`,
`PrefillBootstrapQueue`, `DecodePreallocQueue`, `DecodeTransferQueue`,
`DecodeRequest`, the FAKE-backend KV sender and receiver, `CommonKVManager`,
`NixlKVManager` with real NIXL agents, a one-rank gloo process group for the
poll all-reduce, and the pdwatch recorder with the OTel SDK's in-memory exporter.
Objects whose constructors need a model runner are made with `object.__new__`
plus the attributes the driven method reads. Where an SGLang original needs a
GPU forward pass or a published server config (the batch result processor, the
output streamer), the test calls the hook the way HookRegistry's wrapper does,
with the real SGLang objects SGLang would pass it.
"""

from __future__ import annotations

import threading
from array import array
from types import SimpleNamespace

import pytest
import torch
from opentelemetry.trace import StatusCode

from pdwatch import contract as c
from pdwatch.engine_patches.recorder import Recorder, RecorderConfig
from pdwatch.engine_patches.sglang import hooks
from pdwatch.engine_patches.sglang.state import state
from pdwatch.engine_patches.sglang.targets import for_version, installed_version
from pdwatch.testbed.processes import free_port as _free_port
from tests.support.otlp_spans import KeptSpans

ROOM = 9_001


@pytest.fixture(scope="module")
def gloo():
    """One-rank gloo group: SGLang's poll all-reduce runs for real and is the identity."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Recording:
    """The process recorder the plugin would create, exporting to memory."""

    def __init__(self, role_mode: str, *, backend: str = "nixl", tp_rank: int = 0, plan=None):
        from sglang.srt.disaggregation.utils import DisaggregationMode, TransferBackend
        from sglang.srt.managers.scheduler import Scheduler

        state.reset()
        state.plan = plan  # what plugin() installed (None: every hook, as the tests apply them)
        self.kept = KeptSpans()
        sched = object.__new__(Scheduler)
        sched.disaggregation_mode = DisaggregationMode(role_mode)
        sched.transfer_backend = TransferBackend(backend)
        sched.gpu_id = 0
        sched.tp_rank, sched.tp_size = tp_rank, 2

        def factory(role, **overrides):
            overrides.update(tp_rank=tp_rank, tp_size=2, owns_requests=tp_rank == 0)
            cfg = RecorderConfig(role=role, instance=f"{role}-0", heartbeat_s=60, **overrides)
            return Recorder(cfg, transport=self.kept.transport, environ={})

        state.start_for_scheduler(sched, recorder_factory=factory)
        self.rec = state.rec

    def spans(self, name=None):
        self.rec.flush()
        out = self.kept.get_finished_spans()
        return [s for s in out if name is None or s.name == name]

    def heartbeat(self) -> dict:
        self.rec.drain()
        return self.rec.heartbeat_attributes()


def make_req(rid, *, room=ROOM, fake=True, prompt=(1, 2, 3, 4)):
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(rid, "", array("q", prompt), SamplingParams(max_new_tokens=4),
               bootstrap_host=FAKE_BOOTSTRAP_HOST if fake else "10.0.0.2",
               bootstrap_port=8998, bootstrap_room=room)


def stream(reqs):
    """What HookRegistry's AFTER wrapper around SchedulerOutputStreamer.stream_output does."""
    return hooks.on_stream_output(None, None, reqs, False)


def scheduler_forming(batch):
    """A Scheduler whose batch-forming internals (model-runner bound) hand out `batch`.

    The public methods the plugin hooks, `get_new_batch_prefill` and
    `get_new_prebuilt_batch`, are SGLang's own and run unchanged around it.
    """
    from sglang.srt.managers.scheduler import Scheduler

    sched = object.__new__(Scheduler)
    sched.prefill_delayer = None
    sched._get_new_batch_prefill_raw = lambda prefill_delayer_single_pass, running_batch: (batch, running_batch)
    sched._get_new_prebuilt_batch = lambda running_batch: batch
    sched.kv_checksum_computer = None
    sched.chunked_req = None
    sched.future_map = None
    sched.ngram_embedding_manager = SimpleNamespace(prepare_for_forward=lambda b, chunked_req=None: b)
    return sched


def prefill_queue(streamed):
    """A real PrefillBootstrapQueue with the FAKE backend and the smallest scheduler."""
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator, TransferBackend

    q = object.__new__(PrefillBootstrapQueue)
    q.queue = []
    q.transfer_backend = TransferBackend.FAKE
    q.kv_manager = None
    q.bootstrap_port = 8998
    q.max_input_len = 1024
    q.pp_size = 1
    q.pp_poll_sync_work_list = []
    q.scheduler_stage_metrics = None
    q.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(8)
    q.scheduler = SimpleNamespace(
        output_streamer=SimpleNamespace(stream_output=lambda reqs, *a, **k: (streamed.extend(reqs), stream(reqs))),
        token_to_kv_pool_allocator=SimpleNamespace(page_size=1),
        attn_cp_cpu_group=None,
        attn_tp_cpu_group=None,
        processed_tokens_counter=0,
        retire_unadmitted_request=lambda req: None,
        tree_cache=SimpleNamespace(),
    )
    return q


# ---- loading -------------------------------------------------------------------

def test_sglang_loader_registers_every_target(sglang_plugin):
    import pkgutil

    from sglang.srt.plugins.hook_registry import HookRegistry

    assert sglang_plugin.status == "registered"
    for t in for_version(installed_version()):
        assert t.path in HookRegistry._patched, t.path
        owner = pkgutil.resolve_name(t.path.rsplit(".", 1)[0])
        patched = owner.__dict__[t.method]
        assert getattr(patched, "__wrapped__", None) is not None, f"{t.path} is not wrapped"


# ---- prefill leg ----------------------------------------------------------------

def test_prefill_rejected_at_intake_ends_aborted(sglang_plugin, gloo):
    r = Recording("prefill")
    streamed = []
    q = prefill_queue(streamed)
    big = make_req("p-big", prompt=tuple(range(2000)))  # over max_input_len: SGLang aborts it
    q.add(big, 8)
    assert q.queue == [] and streamed == [big]
    (leg,) = r.spans("pd.request")
    assert leg.attributes["pd.outcome"] == "aborted"
    assert "exceeds the maximum number of tokens" in leg.status.description


def _common_mgr(records=None):
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    mgr = object.__new__(CommonKVManager)
    mgr.failure_lock = threading.Lock()
    mgr.failure_records = {} if records is None else records
    return mgr


def test_prefill_bootstrap_timeout_through_the_real_failure_handler(sglang_plugin, gloo):
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator
    from sglang.srt.managers.scheduler import Scheduler

    r = Recording("prefill")
    streamed = []
    q = prefill_queue(streamed)
    req = make_req("p-2", room=ROOM + 2)
    q.add(req, 8)
    mgr = _common_mgr()
    req.disagg_kv_sender.kv_mgr = mgr
    # Real CommonKVManager.record_failure, as CommonKVSender._check_bootstrap_timeout calls it.
    mgr.record_failure(ROOM + 2, f"Request {ROOM + 2} timed out after 300.0s in KVPoll.Bootstrapping")

    sched = object.__new__(Scheduler)
    sched.disagg_prefill_pending_chunk_rids = set()
    sched.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(4)
    sched.output_streamer = q.scheduler.output_streamer
    sched.metrics_reporter = SimpleNamespace(enable_metrics=False)
    sched.tree_cache = SimpleNamespace(finish=lambda *a: None)
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(tp_rank=0):
        sched.handle_bootstrap_failure(req)  # the real method, wrapped by the plugin

    assert streamed == [req]  # SGLang streamed the abort
    (leg,) = r.spans("pd.request")
    assert leg.attributes["pd.outcome"] == "timeout"
    assert "timed out after 300.0s" in leg.status.description
    (boot,) = r.spans("pd.bootstrap")
    assert boot.status.status_code is StatusCode.ERROR
    hb = r.heartbeat()
    assert hb["pd.engine.kv_timeouts"] == 1 and hb["pd.failed"] == 1


# ---- decode leg ----------------------------------------------------------------------

def decode_queues(streamed):
    from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeTransferQueue
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator, TransferBackend

    streamer = SimpleNamespace(stream_output=lambda reqs, *a, **k: (streamed.extend(reqs), stream(reqs)))
    pre = object.__new__(DecodePreallocQueue)
    pre.queue, pre.retracted_queue, pre.pending_reqs = [], [], []
    pre.transfer_backend = TransferBackend.FAKE
    pre.kv_manager = None
    pre._num_published_destinations = 0
    pre._check_if_req_exceed_kv_capacity = lambda req: False  # needs a KV pool allocator
    pre.token_to_kv_pool_allocator = SimpleNamespace(get_kvcache=lambda: None)  # not a DeepSeek-V4 pool
    pre.scheduler = SimpleNamespace(output_streamer=streamer, retire_unadmitted_request=lambda req: None)
    xfer = object.__new__(DecodeTransferQueue)
    xfer.queue = []
    xfer.enable_host_receive = False
    xfer.enable_staging = False
    pre.transfer_queue = xfer
    pre.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(4)
    xfer.scheduler = SimpleNamespace(disagg_decode_prealloc_queue=pre, output_streamer=streamer)
    return pre, xfer


def test_decode_transfer_failure_through_the_real_abort_path(sglang_plugin):
    r = Recording("decode")
    pre, xfer = decode_queues([])
    req = make_req("d-2", room=ROOM + 5)
    pre.add(req)
    dreq = pre.queue.pop()
    # The real method, wrapped by the plugin: the KV address goes to the (FAKE) prefill, the leg enters transfer.
    pre._send_kv_metadata(dreq, torch.arange(8), 1)
    xfer.extend([dreq])
    mgr = _common_mgr()
    dreq.kv_receiver.kv_mgr = mgr
    mgr.record_failure(ROOM + 5, "NIXL transfer failed: remote disconnect (agent decode-0-old)")
    xfer._abort_failed_transfer(dreq)  # the real method, wrapped by the plugin
    (leg,) = r.spans("pd.request")
    assert leg.attributes["pd.outcome"] == "failed"
    assert "remote disconnect" in leg.status.description
    (stage,) = r.spans("pd.transfer")
    assert stage.status.status_code is StatusCode.ERROR
    assert r.heartbeat()["pd.engine.kv_transfer_failures"] == 1


def test_user_abort_and_waiting_timeout_outcomes(sglang_plugin):
    from sglang.srt.disaggregation.utils import prepare_abort

    r = Recording("decode")
    pre, _ = decode_queues([])
    a, b = make_req("d-a", room=1), make_req("d-b", room=2)
    pre.add(a)
    pre.add(b)
    hooks.on_abort_request(None, None, SimpleNamespace(rid="d-a"))
    prepare_abort(a, "Abort requested by the client")
    prepare_abort(b, "Request waiting timeout reached.")
    stream([a, b])
    out = {s.attributes["pd.rid"]: s.attributes["pd.outcome"] for s in r.spans("pd.request")}
    assert out == {"d-a": "aborted", "d-b": "timeout"}
    assert r.heartbeat()["pd.engine.abort_requests"] == 1


# ---- ranks and heartbeats ---------------------------------------------------------------

def test_non_owner_rank_sends_no_lifecycle_but_counts_loop_and_tokens(sglang_plugin):
    r = Recording("decode", tp_rank=1)
    req = make_req("d-9")
    hooks.on_decode_prealloc_add(None, SimpleNamespace(queue=[]), req)
    for _ in range(5):
        hooks.on_loop_iteration(None)
    req.output_ids.extend([1, 2])
    stream([req])
    hb = r.heartbeat()
    assert hb["pd.loop.iterations"] == 5 and hb["pd.tokens.generated"] == 2
    assert "pd.open.total" not in hb
    assert r.spans("pd.request") == []


# ---- NIXL peers --------------------------------------------------------------------------

def _agent(name):
    import os

    from nixl._api import nixl_agent, nixl_agent_config

    # Loopback only (as the testbed does): UCX over TCP on lo.
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("UCX_TLS", "tcp,self,sm")
    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


class NixlPeers:
    """A real NixlKVManager's peer table over real NIXL agents (UCX on loopback)."""

    def __init__(self):
        from sglang.srt.disaggregation.nixl.conn import NixlKVManager
        from sglang.srt.disaggregation.utils import DisaggregationMode

        mgr = object.__new__(NixlKVManager)
        mgr.decode_kv_args_table = {}
        mgr.agent = _agent("prefill-0")
        mgr.disaggregation_mode = DisaggregationMode.DECODE  # skips the prefill-side xfer preparation
        mgr.dcp_size, mgr.dcp_rank = 1, 0
        self.mgr = mgr
        self.decode_agents = {}  # kept alive: a peer's metadata points at its listening endpoint

    def register(self, name):
        from sglang.srt.disaggregation.nixl.conn import KVArgsRegisterInfo

        self.decode_agents.setdefault(name, _agent(name))
        info = KVArgsRegisterInfo(
            room="None", endpoint="10.0.0.2", dst_port=17000, agent_name=name,
            agent_metadata=self.decode_agents[name].get_agent_metadata(), dst_kv_ptrs=[], dst_kv_mem_kinds=[],
            dst_aux_ptrs=[], dst_state_data_ptrs=[], gpu_id=0, decode_tp_size=1, decode_tp_rank=0,
            dst_kv_item_len=0, dst_kv_item_lens=[],
        )
        self.mgr._add_remote_peer(info)  # the real method, wrapped by the plugin


def test_nixl_stale_peer_added_counted_and_named_on_failure(sglang_plugin):
    r = Recording("prefill")
    peers = NixlPeers()
    mgr, register = peers.mgr, peers.register
    register("decode-0-a")
    register("decode-0-a")  # SGLang ignores a known name: not counted again
    register("decode-0-b")  # the decode restarted: new agent name, old entry stays
    assert set(mgr.decode_kv_args_table) == {"decode-0-a", "decode-0-b"}
    hb = r.heartbeat()
    assert hb["pd.engine.kv_peers_added"] == 2 and hb["pd.engine.kv_stale_peers"] == 1

    # A transfer to the stale peer fails: the leg's failure names it.
    q = prefill_queue([])
    req = make_req("p-7", room=77)
    q.add(req, 8)
    cmgr = _common_mgr({77: "remote disconnect"})
    req.disagg_kv_sender.kv_mgr = cmgr
    hooks.on_prefill_transfer_failure(None, req)
    (leg,) = r.spans("pd.request")
    assert "decode-0-a replaced by decode-0-b" in leg.status.description


def test_nixl_peer_dropped_after_transport_error_counts_as_removed(sglang_plugin):
    import threading as th

    r = Recording("prefill")
    peers = NixlPeers()
    peers.register("decode-1-a")
    mgr = peers.mgr
    mgr.agent.remove_remote_agent("decode-1-a")  # what NIXL does after a remote-disconnect error
    mgr._peer_reload_lock, mgr._peer_reload_times = th.Lock(), {}
    mgr.prep_handles, mgr.prep_handles_slice_dst, mgr._prepared_state_plans = {}, {}, {}
    mgr._prepare_payload_xfer = mgr._prepare_state_xfer = lambda info: None  # need registered KV memory
    mgr._reload_invalidated_peers({"decode-1-a": object()})  # the real method, wrapped by the plugin
    assert mgr.agent.check_remote_metadata("decode-1-a")  # SGLang reloaded it
    assert r.heartbeat()["pd.engine.kv_peers_removed"] == 1


# ---- safety ----------------------------------------------------------------------------------

def test_a_raising_hook_never_reaches_the_scheduler(sglang_plugin, gloo):
    r = Recording("prefill")
    q = prefill_queue([])
    req = make_req("p-3")
    q.add(req, 8)
    poisoned = make_req("p-4")
    q.add(poisoned, 8)
    del poisoned.rid  # the hook's read of req.rid raises AttributeError
    popped = q.pop_bootstrapped()  # the real method returns normally
    assert popped == [req, poisoned]
    assert r.rec.hook_errors >= 1
    assert r.heartbeat()[c.H_HOOK_ERRORS] == r.rec.hook_errors
    assert r.heartbeat()["pd.recorder.hook_errors"] == r.rec.hook_errors  # the contract's name (v1.2)


def test_a_running_plugin_says_it_is_active(sglang_plugin):
    """Every target of the installed release there: the plan installs them all and says active."""
    r = Recording("decode")
    hb = r.heartbeat()
    assert hb["pd.plugin.state"] == "active" and "pd.plugin.refused" not in hb


def test_an_inactive_plugin_heartbeats_and_records_no_leg(sglang_plugin):
    """A lifecycle target refused: the plan keeps heartbeats only; they say inactive and why."""
    from pdwatch.engine_patches.sglang import guard, targets

    table = targets.for_version(targets.installed_version())
    lost = next(t for t in table if t.hook == "on_decode_transferred")
    plan = guard.plan(table, {lost.path: [f"{lost.path}: method gone"]})
    r = Recording("decode", plan=plan)
    assert state.rec is not None and state.lc is None
    hooks.on_decode_prealloc_add(None, None, make_req("inactive-1", fake=False))
    hb = r.heartbeat()
    assert hb["pd.plugin.state"] == "inactive"
    assert "DecodeTransferQueue._commit_transfer_to_req: method gone" in hb["pd.plugin.refused"]
    assert not [s for s in r.spans() if s.attributes.get("pd.rid") == "inactive-1"]


def test_missing_target_disables_the_plugin_and_registers_nothing(sglang_plugin, monkeypatch, caplog):
    from sglang.srt.plugins.hook_registry import HookRegistry

    import pdwatch.engine_patches.sglang as pd_plugin
    from pdwatch.engine_patches.sglang import targets

    # An essential target (the process group: no recorder without it), so nothing is installed at all.
    ghost = targets.Target("sglang.srt.managers.scheduler.Scheduler.no_such_method", "after",
                           "on_abort_request", "a target from another SGLang version", ("self",), group="process")
    monkeypatch.setattr(targets, "TARGETS", targets.TARGETS + (ghost,))
    monkeypatch.setattr(state, "plan", None)
    before = {k: list(v) for k, v in HookRegistry._hooks.items()}
    with caplog.at_level("WARNING", logger="pdwatch.sglang"):
        pd_plugin.plugin()
    assert pd_plugin.status == "disabled"
    assert any("Scheduler.no_such_method" in p for p in pd_plugin.problems)
    assert sum("no_such_method" in rec.getMessage() for rec in caplog.records) == 1
    assert {k: list(v) for k, v in HookRegistry._hooks.items()} == before
    monkeypatch.undo()
    pd_plugin.status = "registered"


# ---- unified (no PD) ----------------------------------------------------------------------

def test_unified_leg_queued_prefill_decode(sglang_plugin):
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.schedule_batch import FINISH_MATCHED_TOKEN

    r = Recording("null")
    req = make_req("u-1", room=None)
    sched = scheduler_forming(batch=SimpleNamespace(reqs=[req]))
    sched.disaggregation_mode = DisaggregationMode.NULL
    sched.enable_priority_scheduling = False
    sched.abort_on_priority_when_disabled = False
    sched.waiting_queue = []
    sched.processed_tokens_counter = 0
    sched._abort_on_queued_limit = lambda req: False
    sched._prefetch_kvcache = lambda req: None
    sched._add_request_to_queue(req)  # the real method, wrapped by the plugin
    assert sched.waiting_queue == [req]
    assert r.heartbeat()["pd.open.stages"] == ["queued"]
    sched.get_new_batch_prefill(None)
    assert r.heartbeat()["pd.open.stages"] == ["prefill"]
    req.output_ids.append(5)
    stream([req])
    assert r.heartbeat()["pd.open.stages"] == ["decode"]
    req.output_ids.append(2)
    req.finished_reason = FINISH_MATCHED_TOKEN(matched=2)
    stream([req])
    stages = [s.name for s in sorted(r.spans(), key=lambda s: s.start_time) if s.name != "pd.request"]
    assert stages == ["pd.queued", "pd.prefill", "pd.decode"]
    (leg,) = r.spans("pd.request")
    assert leg.attributes["pd.outcome"] == "ok" and leg.attributes["pd.output_tokens"] == 2


def test_off_unless_enabled(sglang_plugin, monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry

    import pdwatch.engine_patches.sglang as pd_plugin

    monkeypatch.delenv("PDWATCH_SGLANG", raising=False)
    before = {k: list(v) for k, v in HookRegistry._hooks.items()}
    pd_plugin.plugin()
    assert pd_plugin.status == "off"
    assert {k: list(v) for k, v in HookRegistry._hooks.items()} == before
    pd_plugin.status = "registered"


def test_recorder_from_the_environment_carries_sglang_identity(sglang_plugin, monkeypatch):
    """What the init_disaggregation hook does in a server: role, TP, version from SGLang."""
    import sglang
    from sglang.srt.disaggregation.utils import DisaggregationMode, TransferBackend
    from sglang.srt.managers.scheduler import Scheduler

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{_free_port()}")
    monkeypatch.setenv("PDWATCH_INSTANCE", "decode-3")
    monkeypatch.setenv("PDWATCH_GPU_UUIDS", "GPU-11111111-2222-3333-4444-555555555555")
    state.reset()
    sched = object.__new__(Scheduler)
    sched.disaggregation_mode = DisaggregationMode.DECODE
    sched.transfer_backend = TransferBackend.NIXL
    sched.gpu_id = 0
    hooks.on_scheduler_ready(None, sched)  # the AFTER hook on Scheduler.init_disaggregation
    try:
        cfg = state.rec.config
        assert (cfg.role, cfg.instance, cfg.engine_version) == ("decode", "decode-3", sglang.__version__)
        assert cfg.gpu_uuids == ("GPU-11111111-2222-3333-4444-555555555555",)
        assert state.lc is state.rec and cfg.transfer_backend == "nixl"
        hooks.on_scheduler_ready(None, sched)  # once per process
        assert state.rec.config is cfg
    finally:
        state.reset()


def test_the_schedule_policy_is_the_one_sglang_settled_on(sglang_plugin):
    """pd.schedule_policy from SGLang's own SchedulePolicy, which runs lpm as fcfs without a radix cache."""
    from sglang.srt.managers.schedule_policy import CacheAgnosticPolicy, CacheAwarePolicy
    from sglang.srt.managers.scheduler import Scheduler

    from pdwatch.engine_patches.sglang.state import schedule_policy

    def scheduler(asked, settled, priority=False):
        sched = object.__new__(Scheduler)
        sched.schedule_policy, sched.enable_priority_scheduling = asked, priority
        sched.policy = SimpleNamespace(policy=settled)
        return sched

    assert schedule_policy(scheduler("fcfs", CacheAgnosticPolicy.FCFS)) == "fcfs"
    assert schedule_policy(scheduler("lpm", CacheAwarePolicy.LPM)) == "lpm"
    assert schedule_policy(scheduler("lpm", CacheAgnosticPolicy.FCFS)) == "fcfs"  # no radix cache: it runs fcfs
    assert schedule_policy(scheduler("fcfs", CacheAgnosticPolicy.FCFS, priority=True)) == "priority"
    assert schedule_policy(object.__new__(Scheduler)) is None  # nothing to read: nothing said


def test_decode_retraction_and_rebootstrap_keep_the_leg(sglang_plugin):
    r = Recording("decode")
    pre, _ = decode_queues([])
    req = make_req("d-r", room=31)
    pre.add(req)
    pre.queue.clear()
    hooks.on_decode_batch(None, SimpleNamespace(reqs=[req]))
    pre.add(req, is_retracted=True)  # real: parks it in the retracted queue
    assert pre.retracted_queue == [req]
    assert r.heartbeat()["pd.open.stages"] == ["queued"]
    pre.add(req, is_rebootstrap=True)  # real: a new FAKE receiver, handshake again
    assert r.heartbeat()["pd.open.stages"] == ["bootstrap"]
    assert r.spans("pd.request") == []  # still one open leg, never closed as a reused rid
    assert [s.name for s in r.spans()] == ["pd.bootstrap", "pd.decode", "pd.queued"]
