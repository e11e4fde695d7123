"""The adapter's per-process state: the EngineCore's recorder and each open leg's stage.

One `AdapterState` per process (`state`). The recorder is created when vLLM
builds the connector in its SCHEDULER role (the EngineCore), from the
environment (`pdwatch.engine_patches.recorder.from_env`); until then every hook
is a no-op, and in the API server and the Worker it stays so. `stages` is the
scheduler thread's own note of where each open leg is, so a hook decides from a
dict lookup whether a transition is new.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from pdwatch import contract as c

if TYPE_CHECKING:
    from pdwatch.engine_patches.hook_table import Plan, Target
    from pdwatch.engine_patches.recorder import Recorder

log = logging.getLogger("pdwatch.vllm")
LEAVE_POST_S = 2.0  # how long the final heartbeat may wait for the sidecar when the EngineCore stops
MAX_OPEN = 65536  # the stages map's bound: an entry lives while its leg is open
_ROLE = {"kv_producer": "prefill", "kv_consumer": "decode"}


class AdapterState:
    def __init__(self) -> None:
        self.rec: Recorder | None = None  # the EngineCore's: loop turns, heartbeats
        self.lc: Recorder | None = None  # the same, where the lifecycle is hooked: leg calls
        self.role: str | None = None
        self.stages: dict[str, str] = {}
        self.early_errors = 0  # hook errors before the recorder exists
        self.plan: Plan | None = None  # what the connector installed; None: everything (tests)
        self.worker_rows: list[Target] = []  # the table's rows on the Worker's connector worker
        self.lease_expired: set[str] = set()  # Worker: expired since the last step's worker metadata
        self.lease_s: float | None = None  # the prefill's KV lease (vLLM's scheduler-side setting)

    def start(self, connector: Any, vllm_config: Any) -> None:
        """Create the EngineCore's recorder from vLLM's config (once)."""
        if self.rec is not None:
            return
        from pdwatch.engine_patches.recorder import from_env

        kv = vllm_config.kv_transfer_config
        role = _ROLE.get(str(getattr(kv, "kv_role", "")))
        if role is None:
            log.warning("pdwatch: kv_role %r is neither kv_producer nor kv_consumer; nothing recorded",
                        getattr(kv, "kv_role", None))
            return
        plan = self.plan
        parallel = vllm_config.parallel_config
        policy = str(getattr(vllm_config.scheduler_config, "policy", "") or "")
        rec = from_env(
            role,
            service_name="vllm",
            engine_version=_vllm_version(),
            tp_rank=0,
            tp_size=int(getattr(parallel, "tensor_parallel_size", 1) or 1),
            owns_requests=True,
            # A decode knows its prefill by the prefill's engine id (kv_transfer_params remote_engine_id).
            peer_ids=(str(connector.engine_id),),
            # A decode's queued legs wait for KV memory and a batch slot, not in the policy's order.
            schedule_policy=(c.SCHEDULE_FCFS if policy == "fcfs" else None) if role == "prefill" else None,
            transfer_backend="nixl",
            plugin_state=plan.state if plan is not None else c.PLUGIN_ACTIVE,
            plugin_refused=plan.refused if plan is not None else (),
        )
        rec.hook_errors += self.early_errors
        lease = getattr(getattr(connector, "connector_scheduler", None), "_kv_lease_duration", None)
        self.lease_s = float(lease) if isinstance(lease, (int, float)) and lease > 0 else None
        self.role = role
        self.rec = rec
        self.lc = rec if plan is None or plan.lifecycle else None
        log.info("pdwatch: recording %s leg telemetry (engine %s, lifecycle spans: %s)", role, connector.engine_id,
                 "yes" if self.lc is not None else "no")

    def note(self, rid: str, stage: str) -> None:
        stages = self.stages
        if rid not in stages and len(stages) >= MAX_OPEN:
            stages.pop(next(iter(stages)))
        stages[rid] = stage

    def leave(self) -> None:
        """The EngineCore stops in order: stop recording, send the final heartbeat."""
        rec, self.rec, self.lc = self.rec, None, None
        if rec is not None:
            rec.shutdown(timeout_s=LEAVE_POST_S)
            log.info("pdwatch: final heartbeat sent (%s)", self.role)

    def reset(self) -> None:
        """Back to a fresh process (tests)."""
        type(self).__init__(self)


def _vllm_version() -> str:
    from .targets import installed_version

    return installed_version() or ""


state = AdapterState()
