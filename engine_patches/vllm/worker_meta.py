"""What the adapter's WORKER-role connector tells the SCHEDULER-role one, once a step.

vLLM carries a connector's own worker metadata from each Worker to the
EngineCore with the step's output (`KVConnectorOutput.kv_connector_worker_meta`)
and merges the workers' with `aggregate`. The adapter uses it for what only a
Worker sees: the requests whose KV lease expired before the decode read them,
and the errors the Worker's own hooks caught (a Worker has no recorder: the
EngineCore's counts them in pd.recorder.hook_errors).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata


@dataclass
class PdwatchWorkerMeta(KVConnectorWorkerMetadata):  # type: ignore[misc]  # vLLM is untyped here
    # Prefill request ids whose blocks a Worker freed when their lease ran out, unread by any decode.
    lease_expired: set[str] = field(default_factory=set)
    # Exceptions the Worker's hooks caught since its last metadata.
    hook_errors: int = 0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, PdwatchWorkerMeta):
            return self
        return PdwatchWorkerMeta(lease_expired=self.lease_expired | other.lease_expired,
                                 hook_errors=self.hook_errors + other.hook_errors)
