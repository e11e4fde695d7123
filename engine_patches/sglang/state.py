"""The plugin's per-process state: the recorder and a few small bounded maps.

One `PluginState` per process (`state`). The recorder is created once, when the
scheduler has decided its role (`Scheduler.init_disaggregation`), from the
environment (`pdwatch.engine_patches.recorder.from_env`). Until then every hook is a
no-op. The maps bridge what SGLang keys differently: the router's traceparent
arrives before the `Req` exists, and KV-manager callbacks know the
bootstrap room, not the rid.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from pdwatch import contract as c

if TYPE_CHECKING:
    from pdwatch.engine_patches.recorder import Recorder

    from .guard import Plan

log = logging.getLogger("pdwatch.sglang")
# How long the final heartbeat may wait for the sidecar when the scheduler stops.
LEAVE_POST_S = 2.0

# Bounds for the bridging maps; an entry lives only while its leg is open, so
# these only fill when SGLang loses requests without streaming them.
MAX_PENDING = 65536
# The attribute under which the HTTP process notes a request's traceparent on
# its time stats, for the scheduler process to read.
TRACEPARENT_ATTR = "pdwatch_traceparent"
_ROLE = {"null": "unified", "prefill": "prefill", "decode": "decode"}

K = TypeVar("K")
V = TypeVar("V")


def _bounded_put(d: dict[K, V], key: K, value: V) -> None:
    if len(d) >= MAX_PENDING:
        d.pop(next(iter(d)))  # oldest insertion first
    d[key] = value


class PluginState:
    def __init__(self) -> None:
        self.rec: Recorder | None = None  # every rank: loop ticks, tokens, engine counters
        self.lc: Recorder | None = None  # the bookkeeping rank only: lifecycle calls
        self.role: str | None = None
        self.early_errors = 0  # hook errors before the recorder exists
        self.traceparents: dict[str, str] = {}
        self.room_rids: dict[int, str] = {}
        self.room_bytes: dict[int, int] = {}
        self.tokens_seen: dict[str, int] = {}
        self.stale_peers: dict[str, str] = {}  # old agent name -> the name that replaced it
        self._start_logged = False
        # What plugin() installed (guard.plan); None: everything (tests that hook by hand).
        self.plan: Plan | None = None

    # ---- start-up -----------------------------------------------------------

    def start_for_scheduler(self, scheduler: Any, recorder_factory: Callable[..., Recorder] | None = None) -> None:
        """Create this process's recorder from the scheduler's settings (once)."""
        if self.rec is not None:
            return
        from pdwatch.engine_patches.recorder import from_env

        plan = self.plan
        mode = getattr(scheduler.disaggregation_mode, "value", scheduler.disaggregation_mode)
        role = _ROLE[str(mode)]
        tp_rank, tp_size, owns = _parallel_ranks(scheduler)
        backend = getattr(scheduler, "transfer_backend", None)
        overrides = dict(
            transfer_backend=None if backend is None else str(getattr(backend, "value", backend)),
            tp_rank=tp_rank,
            tp_size=tp_size,
            owns_requests=owns,
            engine_version=_sglang_version(),
            gpu_uuids=tuple(gpu_uuids(_gpu_id())),
            peer_ids=peer_ids(scheduler, role),
            server_address=_server_address(),
            loop_idle_turn_s=idle_turn_s(scheduler),
            # The policy orders a prefill's waiting queue; a PD decode's `queued` legs wait for KV memory and
            # a batch slot, admitted as memory frees, not in the policy's order: it declares none.
            schedule_policy=schedule_policy(scheduler) if role != "decode" else None,
            gauges=lambda: kv_gauges(scheduler),
            # What the guard (guard.py) let plugin() install: active, partial, or inactive (heartbeats only).
            plugin_state=plan.state if plan is not None else c.PLUGIN_ACTIVE,
            plugin_refused=plan.refused if plan is not None else (),
        )
        rec = (recorder_factory or from_env)(role, **overrides)
        rec.hook_errors += self.early_errors
        self.role = role
        self.rec = rec
        # Inactive: the lifecycle is refused, no leg is opened, so no span and no inventory: heartbeats only.
        lifecycle = plan is None or plan.lifecycle
        self.lc = rec if rec.config.owns_requests and lifecycle else None
        log.info("pdwatch: recording %s leg telemetry (tp rank %d/%d, lifecycle spans: %s)",
                 role, tp_rank, tp_size, "yes" if self.lc is not None else "no")

    def log_start_failure(self) -> None:
        if not self._start_logged:
            self._start_logged = True
            log.warning("pdwatch: could not start the recorder; SGLang runs without it", exc_info=True)

    def leave(self) -> None:
        """The process leaves in order: stop recording, send the final heartbeat. It runs on the scheduler
        thread as its loop ends, and waits at most LEAVE_POST_S for the sidecar (SGLang SIGKILLs
        schedulers 15 s after asking them to stop)."""
        rec, self.rec, self.lc = self.rec, None, None
        if rec is not None:
            rec.shutdown(timeout_s=LEAVE_POST_S)
            log.info("pdwatch: final heartbeat sent (%s)", self.role)

    def reset(self) -> None:
        """Back to a fresh process (tests)."""
        rec = self.rec
        type(self).__init__(self)
        if rec is not None:
            rec.shutdown(timeout_s=1.0)

    # ---- bridging maps --------------------------------------------------------

    def keep_traceparent(self, rid: str, traceparent: str) -> None:
        _bounded_put(self.traceparents, rid, traceparent)

    def remember_room(self, room: int, rid: str) -> None:
        _bounded_put(self.room_rids, room, rid)

    def add_room_bytes(self, room: int, n: int) -> int:
        total = self.room_bytes.get(room, 0) + n
        if room not in self.room_bytes and len(self.room_bytes) >= MAX_PENDING:
            self.room_bytes.pop(next(iter(self.room_bytes)))
        self.room_bytes[room] = total
        return total

    def forget(self, req: Any) -> None:
        self.tokens_seen.pop(req.rid, None)
        self.traceparents.pop(req.rid, None)
        room = req.bootstrap_room
        if room is not None and self.room_rids.get(room) == req.rid:
            del self.room_rids[room]
            self.room_bytes.pop(room, None)

    # ---- NIXL peers ---------------------------------------------------------------

    @staticmethod
    def bytes_per_index(mgr: Any) -> int:
        """Bytes one KV page index moves across all layers (cached on the manager)."""
        cached: int | None = mgr.__dict__.get("_pdwatch_bytes_per_index")
        if cached is None:
            cached = int(sum(mgr.kv_args.kv_item_lens))
            mgr.__dict__["_pdwatch_bytes_per_index"] = cached
        return cached

    @staticmethod
    def stale_candidates(table: dict[str, Any], new: Any) -> list[str] | None:
        """Names in the peer table for the same decode GPU under another name.

        None when the peer is already known (SGLang ignores it). A decode that
        restarts registers a fresh NIXL agent name from the same endpoint, GPU
        and TP rank; SGLang keeps the old entry, and transfers aimed at it fail.
        """
        if new.agent_name in table:
            return None
        key = (new.endpoint, new.gpu_id, new.decode_tp_rank)
        return [
            name for name, old in table.items()
            if (old.endpoint, old.gpu_id, old.decode_tp_rank) == key
        ]

    def note_stale(self, old_names: list[str], new_name: str) -> None:
        for old in old_names:
            _bounded_put(self.stale_peers, old, new_name)

    def stale_note(self) -> str | None:
        if not self.stale_peers:
            return None
        pairs = list(self.stale_peers.items())[-3:]
        return "stale NIXL peers: " + ", ".join(f"{o} replaced by {n}" for o, n in pairs)


def _parallel_ranks(scheduler: Any) -> tuple[int, int, bool]:
    try:
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
        tp_rank, tp_size = int(par.tp_rank), int(par.tp_size)
        owns = int(getattr(par, "attn_tp_rank", tp_rank)) == 0
    except Exception:
        tp_rank = int(getattr(scheduler, "tp_rank", 0) or 0)
        tp_size = int(getattr(scheduler, "tp_size", 1) or 1)
        owns = tp_rank == 0
    return tp_rank, tp_size, owns


def _kv_manager(scheduler: Any, role: str) -> Any:
    """The scheduler's KV manager (built inside init_disaggregation, so there by the time this runs)."""
    queue = scheduler.disagg_decode_prealloc_queue if role == "decode" else \
        scheduler.disagg_prefill_bootstrap_queue if role == "prefill" else None
    return getattr(queue, "kv_manager", None)


def peer_ids(scheduler: Any, role: str) -> tuple[str, ...]:
    """pd.peer_ids: the NIXL agent name prefill writes to (decode) or its own (prefill), and, on a
    prefill, the bootstrap address host:port its decodes name it by (contract section 3)."""
    out: list[str] = []
    try:
        mgr = _kv_manager(scheduler, role)
        agent = getattr(getattr(mgr, "agent", None), "name", None)
        if agent:
            out.append(str(agent))
        if role == "prefill" and mgr is not None and mgr.bootstrap_host and mgr.bootstrap_port:
            out.append(f"{mgr.bootstrap_host}:{mgr.bootstrap_port}")
    except Exception:
        log.debug("pdwatch: peer ids unreadable", exc_info=True)
    return tuple(out)


# SGLang's IdleSleeper (--sleep-on-idle) polls its sockets for at most 1 s per idle loop turn.
IDLE_SLEEPER_POLL_S = 1.0


def kv_gauges(scheduler: Any) -> dict[str, float]:
    """The KV pool's usage as SGLang computes it for its own logs and prefill delayer (held by running
    requests; cached prefixes it could evict count as free). Read at each heartbeat on the recorder's
    thread: a racy read of a few sizes, never a write. An SGLang without the observer says nothing."""
    observer = getattr(scheduler, "pool_stats_observer", None)
    if observer is None:
        return {}
    return {c.H_KV_USED: float(observer.get_pool_stats().get_max_pool_usage())}


def idle_turn_s(scheduler: Any) -> float:
    """The longest the scheduler loop stands still while idle: it spins, or the idle sleeper's poll."""
    return IDLE_SLEEPER_POLL_S if getattr(scheduler, "idle_sleeper", None) is not None else 0.0


def schedule_policy(scheduler: Any) -> str | None:
    """pd.schedule_policy: the order the scheduler really takes its waiting queue in. SGLang's own
    (`--schedule-policy`) as its SchedulePolicy settled it (lpm without a radix cache runs fcfs), or
    `priority` when --enable-priority-scheduling sorts the queue by priority first; None when unreadable."""
    try:
        if getattr(scheduler, "enable_priority_scheduling", False):
            return "priority"
        policy = getattr(getattr(scheduler, "policy", None), "policy", None)  # built before init_disaggregation
        value = getattr(policy, "value", None) or getattr(scheduler, "schedule_policy", None)
        return str(value) if value else None
    except Exception:
        log.debug("pdwatch: schedule policy unreadable", exc_info=True)
        return None


def _server_address() -> str | None:
    """host:port of this server's HTTP API: the stable default pd.instance."""
    try:
        from sglang.srt.runtime_context import get_serving

        serving = get_serving()
        return f"{serving.host}:{serving.port}"
    except Exception:
        return None


def _gpu_id() -> int | None:
    """The device this scheduler drives (0.5.23 keeps it in the runtime context, not on the Scheduler)."""
    try:
        from sglang.srt.runtime_context import get_device

        gpu_id = get_device().gpu_id
        return None if gpu_id is None else int(gpu_id)
    except Exception:
        return None


def _sglang_version() -> str:
    try:
        import sglang

        return str(sglang.__version__)
    except Exception:
        return ""


def gpu_uuids(gpu_id: int | None) -> list[str]:
    """NVML-style UUIDs (GPU-...) of the device this process drives, when CUDA is there."""
    if os.environ.get(c.ENV_GPU_UUIDS):
        return [u.strip() for u in os.environ[c.ENV_GPU_UUIDS].split(",") if u.strip()]
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        index = torch.cuda.current_device() if gpu_id is None else int(gpu_id)
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        return [uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"]
    except Exception:
        return []


state = PluginState()
