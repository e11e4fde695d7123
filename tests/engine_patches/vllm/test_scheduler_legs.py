"""vLLM's own Scheduler, with the adapter's NixlConnector in it, walks a prefill leg and a decode leg
through the contract's stages; the spans reach a real OTLP receiver on loopback.

Nothing of vLLM is stood in for but the model runner: each step's output is what a runner reports
(a sampled token per scheduled request, the workers' transfer results). Runs in vLLM's own
environment (docs/vllm.md), not in `make test` yet.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator

import pytest
from vllm import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request

from pdwatch import contract as c
from pdwatch.testbed.processes import free_port
from tests.support.otlp_receiver import OtlpReceiver
from tests.support.vllm_scheduler import build_scheduler

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE}-00f067aa0ba902b7-01"


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


@pytest.fixture
def adapter(monkeypatch, receiver):
    """The adapter enabled, its state fresh, its recorder exporting to the receiver."""
    monkeypatch.setenv(c.ENV_VLLM, "1")
    monkeypatch.setenv(c.ENV_OTLP_ENDPOINT, receiver.url)
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", str(free_port()))
    from pdwatch.engine_patches.vllm import connector, state

    importlib.reload(connector)  # installs the overrides now that PDWATCH_VLLM is set
    state.state.reset()
    connector.state.plan = None
    yield connector
    if state.state.rec is not None:
        state.state.rec.shutdown(timeout_s=2.0)
    state.state.reset()


def scheduler(tmp_path, monkeypatch, kv_role: str, instance: str) -> Scheduler:
    monkeypatch.setenv(c.ENV_INSTANCE, instance)
    return build_scheduler(tmp_path, kv_role)


def request(rid: str, max_tokens: int, params: dict, prompt: int = 40) -> Request:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args={"kv_transfer_params": params})
    return Request(request_id=rid, prompt_token_ids=list(range(3, 3 + prompt)), sampling_params=sampling,
                   pooling_params=None, trace_headers={"traceparent": TRACEPARENT})


def runner_output(scheduled, kv: KVConnectorOutput | None = None) -> ModelRunnerOutput:
    ids = [r.req_id for r in scheduled.scheduled_new_reqs] + list(scheduled.scheduled_cached_reqs.req_ids)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[7] for _ in ids], kv_connector_output=kv)


def stage_names(receiver: OtlpReceiver, role: str) -> list[str]:
    out = []
    for stage in c.STAGES[role]:
        for s in receiver.named(c.stage_span_name(stage)):
            if s.attrs.get(c.A_ROLE) == role:
                out.append((s.start_ns, stage))
    return [name for _t, name in sorted(out)]


def test_a_prefill_leg_walks_queued_prefill_transfer_and_ends_when_its_blocks_are_read(
        adapter, receiver, tmp_path, monkeypatch):
    sched = scheduler(tmp_path, monkeypatch, "kv_producer", "prefill-0")
    try:
        sched.add_request(request("p-1", 1, {"do_remote_decode": True, "do_remote_prefill": False}))
        out = sched.schedule()
        sched.update_from_output(out, runner_output(out))  # its one token: the prefill finishes, blocks held
        out = sched.schedule()
        sched.update_from_output(out, runner_output(out, KVConnectorOutput(finished_sending={"p-1"})))
        rec = adapter.state.rec
        assert rec is not None and rec.hook_errors == 0
        rec.flush()
    finally:
        sched.shutdown()
    assert stage_names(receiver, "prefill") == ["queued", "prefill", "transfer"]
    [leg] = receiver.named(c.SPAN_LEG)
    assert leg.trace_id == TRACE and leg.attrs[c.A_OUTCOME] == "ok", leg.attrs
    assert leg.resource[c.R_INSTANCE] == "prefill-0" and leg.resource[c.R_SERVICE_NAME] == "vllm"


def test_a_decode_leg_walks_bootstrap_transfer_queued_decode_with_its_tokens(
        adapter, receiver, tmp_path, monkeypatch):
    sched = scheduler(tmp_path, monkeypatch, "kv_consumer", "decode-0")
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill-engine",
              "remote_request_id": "p-1", "remote_block_ids": [[0, 1, 2]], "remote_host": "127.0.0.1",
              "remote_port": free_port(), "remote_num_tokens": 40, "tp_size": 1}
    try:
        sched.add_request(request("d-1", 4, params))
        out = sched.schedule()  # blocks allocated for the READ: waiting for the remote KV
        sched.update_from_output(out, runner_output(out, KVConnectorOutput(finished_recving={"d-1"})))
        for _ in range(6):
            out = sched.schedule()
            if not out.total_num_scheduled_tokens:
                continue
            sched.update_from_output(out, runner_output(out))
        rec = adapter.state.rec
        assert rec is not None and rec.hook_errors == 0
        rec.flush()
    finally:
        sched.shutdown()
    assert stage_names(receiver, "decode") == ["bootstrap", "transfer", "queued", "decode"]
    [leg] = receiver.named(c.SPAN_LEG)
    assert leg.trace_id == TRACE and leg.attrs[c.A_OUTCOME] == "ok", leg.attrs
    assert leg.attrs[c.A_OUTPUT_TOKENS] == 4 and leg.attrs[c.A_ROLE] == "decode"


def test_a_lease_that_expires_unread_ends_the_prefill_leg_timeout(adapter, receiver, tmp_path, monkeypatch):
    from pdwatch.engine_patches.vllm.worker_meta import PdwatchWorkerMeta

    sched = scheduler(tmp_path, monkeypatch, "kv_producer", "prefill-0")
    try:
        sched.add_request(request("p-2", 1, {"do_remote_decode": True, "do_remote_prefill": False}))
        out = sched.schedule()
        sched.update_from_output(out, runner_output(out))
        # The Worker freed the blocks when their lease ran out, and said so in its worker metadata.
        out = sched.schedule()
        sched.update_from_output(out, runner_output(out, KVConnectorOutput(
            finished_sending={"p-2"}, kv_connector_worker_meta=PdwatchWorkerMeta(lease_expired={"p-2"}))))
        rec = adapter.state.rec
        assert rec is not None and rec.hook_errors == 0
        rec.flush()
    finally:
        sched.shutdown()
    [leg] = receiver.named(c.SPAN_LEG)
    assert leg.attrs[c.A_OUTCOME] == "timeout" and leg.status_code == 2, leg.attrs  # status ERROR
    [message] = [s.status.message for _res, s in receiver.spans() if s.name == c.SPAN_LEG]
    assert "lease expired" in message, message


def test_the_prefill_says_when_its_lease_ends_and_a_decode_after_it_names_the_read(
        adapter, receiver, tmp_path, monkeypatch):
    """vLLM's own scheduler output carries the prefill's kv_transfer_params to the client: the lease's end is
    in them. A decode that takes them after that instant reads freed blocks; its leg says so, and ends ok."""
    import time

    from pdwatch.engine_patches.vllm.hooks import READ_AFTER_LEASE
    from pdwatch.engine_patches.vllm.targets import LEASE_EXPIRES_KEY

    sched = scheduler(tmp_path, monkeypatch, "kv_producer", "prefill-0")
    try:
        sched.add_request(request("p-3", 1, {"do_remote_decode": True, "do_remote_prefill": False}))
        out = sched.schedule()
        t0 = time.time()
        outputs = sched.update_from_output(out, runner_output(out))
        [answer] = [o for eco in outputs.values() for o in eco.outputs]
        lease_s = sched.connector.connector_scheduler._kv_lease_duration
        assert t0 + lease_s <= answer.kv_transfer_params[LEASE_EXPIRES_KEY] <= time.time() + lease_s
        assert answer.kv_transfer_params["remote_request_id"] == "p-3"  # vLLM's own keys as they were
    finally:
        sched.shutdown()  # the connector's shutdown: the final heartbeat, the recorder stops
    adapter.state.reset()  # a fresh process: the decode
    sched = scheduler(tmp_path, monkeypatch, "kv_consumer", "decode-0")
    base = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill-engine",
            "remote_block_ids": [[0, 1, 2]], "remote_host": "127.0.0.1", "remote_port": free_port(),
            "remote_num_tokens": 40, "tp_size": 1}
    try:
        for rid, expires in (("d-late", time.time() - 5), ("d-in-time", time.time() + 30)):
            sched.add_request(request(rid, 1, {**base, "remote_request_id": f"p-{rid}", LEASE_EXPIRES_KEY: expires}))
        rec = adapter.state.rec
        rec.drain()
        hb = rec.heartbeat_attributes()
        assert dict(zip(hb[c.H_OPEN_RIDS], hb[c.H_OPEN_ERRORS])) == {"d-late": READ_AFTER_LEASE, "d-in-time": ""}
        assert rec.hook_errors == 0
    finally:
        sched.shutdown()


def test_errors_a_workers_hooks_caught_reach_the_enginecores_recorder(adapter, receiver, tmp_path, monkeypatch):
    """A Worker has no recorder: what its hooks caught rides to the EngineCore in the step's worker metadata."""
    from pdwatch.engine_patches.vllm import hooks
    from pdwatch.engine_patches.vllm.worker_meta import PdwatchWorkerMeta

    adapter.state.early_errors = 2  # as a Worker's counted_error() leaves them
    meta = hooks.on_worker_meta(lambda: None, object())
    assert isinstance(meta, PdwatchWorkerMeta) and meta.hook_errors == 2 and adapter.state.early_errors == 0
    assert hooks.on_worker_meta(lambda: None, object()) is None  # nothing new: no metadata of ours
    merged = meta.aggregate(PdwatchWorkerMeta(hook_errors=1))
    sched = scheduler(tmp_path, monkeypatch, "kv_producer", "prefill-0")
    try:
        out = sched.schedule()
        sched.update_from_output(out, runner_output(out, KVConnectorOutput(kv_connector_worker_meta=merged)))
        assert adapter.state.rec.hook_errors == 3
    finally:
        sched.shutdown()


def test_a_request_that_wakes_an_idle_enginecore_turns_its_loop(adapter, receiver, tmp_path, monkeypatch):
    """An idle EngineCore steps no more (it waits on its input queue); the request that wakes it is a turn
    of its loop, counted before its leg opens, so no heartbeat lists the leg beside an idle spell's count."""
    sched = scheduler(tmp_path, monkeypatch, "kv_producer", "prefill-0")
    try:
        rec = adapter.state.rec
        before = rec.loop_iterations
        sched.add_request(request("p-9", 1, {"do_remote_decode": True, "do_remote_prefill": False}))
        assert rec.loop_iterations == before + 1 and rec.hook_errors == 0
    finally:
        sched.shutdown()
