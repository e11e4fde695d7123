"""Recorder settings: argument, then environment variable, then default."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from opentelemetry.util.re import parse_env_headers

from pdwatch import contract as c


def _env_float(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if not value > 0:
        raise ValueError(f"{name}={raw!r} must be positive")
    return value


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < 1:
        raise ValueError(f"{name}={raw!r} must be at least 1")
    return value


def _compression(raw: str) -> str:
    value = raw.strip().lower()
    if value not in ("none", "gzip"):
        raise ValueError(f"OTLP compression {raw!r} is not none or gzip")
    return value


@dataclass(frozen=True)
class RecorderConfig:
    """What a recorder needs to know about the engine process it lives in.

    Fields left as None are resolved by `resolved()` from the environment
    (PDWATCH_CLUSTER, PDWATCH_INSTANCE, PDWATCH_HEARTBEAT_S,
    PDWATCH_INVENTORY_MAX, OTEL_EXPORTER_OTLP_ENDPOINT and the OTLP exporter's
    header, certificate and compression variables) or defaults.
    """

    role: str
    cluster: str | None = None
    instance: str | None = None
    service_name: str = "sglang"
    engine_version: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    gpu_uuids: tuple[str, ...] = ()
    # The names under which PD peers know this process (its KV agent names, its
    # bootstrap address host:port): pd.peer_ids, what the sidecar's peer_gone rule matches.
    peer_ids: tuple[str, ...] = ()
    # host:port the engine serves on: the stable default pd.instance (never a PID).
    server_address: str | None = None
    # Only the rank that owns request bookkeeping sends lifecycle spans and
    # the open-leg inventory; None means "rank 0 does".
    owns_requests: bool | None = None
    heartbeat_s: float | None = None
    inventory_max: int | None = None
    # OTLP/HTTP base URL; spans go to <endpoint>/v1/traces.
    endpoint: str | None = None
    # Sent with every export (a sidecar's token, say); None: the OTLP exporter's
    # OTEL_EXPORTER_OTLP_TRACES_HEADERS, else OTEL_EXPORTER_OTLP_HEADERS.
    headers: Mapping[str, str] | None = None
    # CA file for an https endpoint; None: OTEL_EXPORTER_OTLP_[TRACES_]CERTIFICATE, else the system's.
    certificate: str | None = None
    # none or gzip; None: OTEL_EXPORTER_OTLP_[TRACES_]COMPRESSION, else none (gzip costs the engine CPU).
    compression: str | None = None
    # Hot-path buffer between the engine thread and the span builder.
    buffer_max: int = 65536
    # Legs the recorder tracks at once; beyond it the oldest is forgotten, counted.
    max_open_legs: int = 65536
    # How often the worker wakes to drain, export and maybe heartbeat. Rarely: each
    # wake-up takes the GIL from a busy scheduler thread (see export_queue.py):
    # on the live pair the plugin's latency cost read +1.45 % at 0.25 s and
    # +0.92 % at 1 s (bench/sglang_live_cost.py). Tokens carry the time of the
    # drain that saw them, and spans reach the sidecar, late by at most this:
    # well inside the stuck floors (seconds). The buffer holds this long of records.
    drain_interval_s: float = 1.0
    # The longest the engine's scheduler loop stands still while idle, if the engine knows it (0: it
    # spins); sent in heartbeats (pd.loop.idle_turn_s). None: unknown, the sidecar learns it.
    loop_idle_turn_s: float | None = None
    # The order in which the engine takes legs from its waiting queue, as it names it (fcfs, lpm, priority,
    # ...): pd.schedule_policy (contract v1.2), which the sidecar's overtaken rule reads. None: not said.
    schedule_policy: str | None = None
    # How much of the engine the integration observes (pd.plugin.state, contract v1.2): active (every
    # hook installed), partial (some refused), inactive (no hook: only heartbeats are sent). A recorder
    # fed by its engine directly (the testbed's emulated engines) is active.
    plugin_state: str = c.PLUGIN_ACTIVE
    # The hook targets the integration refused to install, each "Class.method: why" (pd.plugin.refused).
    plugin_refused: tuple[str, ...] = ()
    # The engine's KV transfer backend (nixl, mooncake, ...), a property of the process: written on
    # every transfer stage span that did not record one, so hooks need not record it per request.
    transfer_backend: str | None = None
    # Numbers the engine can tell about itself at each heartbeat (attribute name -> value), read on the
    # recorder's thread, never the engine's: the SGLang plugin's KV pool usage (contract.H_KV_USED).
    gauges: Callable[[], Mapping[str, float]] | None = None
    export_timeout_s: float = 2.0
    # Spans allowed to wait for export; more are dropped, counted.
    max_export_queue: int = 8192
    pid: int = field(default_factory=os.getpid)
    host: str = field(default_factory=socket.gethostname)

    def resolved(self, environ: Mapping[str, str] | None = None) -> RecorderConfig:
        env = os.environ if environ is None else environ
        if self.role not in c.ROLES:
            raise ValueError(f"role must be one of {', '.join(c.ROLES)}, not {self.role!r}")
        if self.plugin_state not in c.PLUGIN_STATES:
            raise ValueError(f"plugin_state must be one of {', '.join(c.PLUGIN_STATES)}, not {self.plugin_state!r}")
        endpoint = self.endpoint or env.get(c.ENV_OTLP_ENDPOINT) or c.DEFAULT_SIDECAR_URL
        return replace(
            self,
            cluster=self.cluster or env.get(c.ENV_CLUSTER) or "default",
            instance=self.instance or env.get(c.ENV_INSTANCE) or self.server_address or f"{self.host}:{self.role}",
            owns_requests=(self.tp_rank == 0) if self.owns_requests is None else self.owns_requests,
            heartbeat_s=self.heartbeat_s or _env_float(env, c.ENV_HEARTBEAT, c.DEFAULT_HEARTBEAT_S),
            inventory_max=self.inventory_max
            or _env_int(env, c.ENV_INVENTORY_MAX, c.DEFAULT_INVENTORY_MAX),
            endpoint=endpoint.rstrip("/"),
            headers=self.headers if self.headers is not None else parse_env_headers(
                env.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS") or env.get("OTEL_EXPORTER_OTLP_HEADERS") or "",
                liberal=True),
            certificate=self.certificate or env.get("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE")
            or env.get("OTEL_EXPORTER_OTLP_CERTIFICATE"),
            compression=_compression(self.compression or env.get("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION")
                                     or env.get("OTEL_EXPORTER_OTLP_COMPRESSION") or "none"),
        )
