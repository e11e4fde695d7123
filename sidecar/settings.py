"""The sidecar's settings: one typed object, each field from flag, else
environment variable, else default, validated once at start.

Every setting is listed in `FIELDS`, which also builds `pdwatch serve --help`,
so the flags, the variables and the docs cannot drift apart.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping

from pdwatch import contract as c


def _positive(kind: Callable[[str], Any]):
    def parse(raw: str):
        value = kind(raw)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("must be a finite number")
        if value <= 0:
            raise ValueError("must be positive")
        return value

    parse.__name__ = kind.__name__
    return parse


def _non_negative(kind: Callable[[str], Any]):
    def parse(raw: str):
        value = kind(raw)
        if value < 0:
            raise ValueError("must be zero or more")
        return value

    parse.__name__ = kind.__name__
    return parse


def _port(raw: str) -> int:
    value = int(raw)
    if not 0 <= value <= 65535:
        raise ValueError("must be 0..65535")
    return value


def _choice(*allowed: str):
    def parse(raw: str) -> str:
        if raw not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}")
        return raw

    parse.__name__ = "|".join(allowed)
    return parse


def _text(raw: str) -> str:
    return raw


@dataclass(frozen=True)
class Field:
    name: str  # attribute of Settings
    env: str
    parse: Callable[[str], Any]
    help: str


# Floors get one field each, named like the contract's variables.
_FLOOR_FIELDS = [
    Field(f"floor_{stage}_s", f"PDWATCH_FLOOR_{stage.upper()}_S", _positive(float),
          f"stuck floor of stage {stage}, seconds")
    for stage in c.ALL_STAGES
]

FIELDS: list[Field] = [
    Field("host", "PDWATCH_HOST", _text, "address to bind (loopback by default)"),
    Field("port", "PDWATCH_PORT", _port, "port to bind (4318 is OTLP/HTTP's, so engines reach it by default)"),
    Field("token", "PDWATCH_TOKEN", _text,
          "bearer token required by ingest and the API when set (/metrics and /healthz stay open)"),
    *_FLOOR_FIELDS,
    Field("flow_window_s", "PDWATCH_FLOW_WINDOW_S", _positive(float),
          "a cluster flows when some leg finished ok within this many seconds"),
    Field("forward_otlp_endpoint", "PDWATCH_FORWARD_OTLP_ENDPOINT", _text,
          "OTLP/HTTP base URL of a trace store to forward lifecycle and pd.stuck spans to"),
    Field("nvml", "PDWATCH_NVML", _choice("auto", "off"), "auto: sample GPUs when NVML loads; off: never"),
    Field("gpu_interval_s", "PDWATCH_GPU_INTERVAL_S", _positive(float), "GPU sampling interval, seconds"),
    Field("gpu_map", "PDWATCH_GPU_MAP", _text,
          "GPUs to attribute by configuration when no instance claims them, e.g. 0=default/decode/decode-0"),
    Field("max_body_bytes", "PDWATCH_MAX_BODY_BYTES", _positive(int), "largest OTLP body, after decompression"),
    Field("max_open_legs", "PDWATCH_MAX_OPEN_LEGS", _positive(int),
          "open legs tracked at once; the oldest is evicted beyond it, counted"),
    Field("max_closed_legs", "PDWATCH_MAX_CLOSED_LEGS", _positive(int),
          "finished legs remembered for /api/v1/requests and de-duplication"),
    Field("max_instances", "PDWATCH_MAX_INSTANCES", _positive(int),
          "engine instances tracked; spans from more are rejected, counted"),
    Field("instance_ttl_s", "PDWATCH_INSTANCE_TTL_S", _positive(float),
          "an instance none of whose ranks sent anything for this long is forgotten with its open legs, counted"),
    Field("max_rss_bytes", "PDWATCH_MAX_RSS_BYTES", _non_negative(int),
          "resident memory above which ingest answers 503 with Retry-After until it falls again; 0 = no limit"),
    Field("evaluate_interval_s", "PDWATCH_EVALUATE_INTERVAL_S", _positive(float),
          "how often the stuck rule runs, seconds"),
    Field("log_level", "PDWATCH_LOG_LEVEL", _choice("debug", "info", "warning", "error"), "log level"),
]


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 4318
    token: str | None = None
    floor_bootstrap_s: float = c.DEFAULT_FLOORS_S["bootstrap"]
    floor_queued_s: float = c.DEFAULT_FLOORS_S["queued"]
    floor_prefill_s: float = c.DEFAULT_FLOORS_S["prefill"]
    floor_transfer_s: float = c.DEFAULT_FLOORS_S["transfer"]
    floor_decode_s: float = c.DEFAULT_FLOORS_S["decode"]
    flow_window_s: float = c.DEFAULT_FLOW_WINDOW_S
    forward_otlp_endpoint: str | None = None
    nvml: str = "auto"
    gpu_interval_s: float = 1.0
    gpu_map: str = ""
    max_body_bytes: int = 16 * 1024 * 1024
    max_open_legs: int = 200_000
    max_closed_legs: int = 50_000
    max_instances: int = 1024
    instance_ttl_s: float = 3600.0
    max_rss_bytes: int = 4 << 30
    evaluate_interval_s: float = 0.5
    log_level: str = "info"
    # Not settable from outside: tests inject a clock.
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def floors(self) -> dict[str, float]:
        return {stage: getattr(self, f"floor_{stage}_s") for stage in c.ALL_STAGES}

    def __repr__(self) -> str:  # the token must never reach a log line
        shown = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        if shown["token"]:
            shown["token"] = "<set>"
        return "Settings(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"

    @classmethod
    def from_sources(cls, flags: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> "Settings":
        """Flag value if given, else environment variable, else the default; raises ValueError naming the source."""
        flags = flags or {}
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in FIELDS:
            raw, source = flags.get(f.name), f"--{f.name.replace('_', '-')}"
            if raw is None:
                raw, source = env.get(f.env), f.env
                if raw is not None and raw.strip() == "":
                    raw = None
            if raw is None:
                continue
            try:
                values[f.name] = f.parse(str(raw))
            except ValueError as exc:
                raise ValueError(f"{source}={raw!r}: {exc}") from None
        return cls(**values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Settings()
    for f in FIELDS:
        default = getattr(defaults, f.name)
        shown = "unset" if default in (None, "") else default
        parser.add_argument(
            f"--{f.name.replace('_', '-')}", dest=f.name, default=None, metavar=f.parse.__name__.strip('_').upper(),
            help=f"{f.help} [env {f.env}, default {shown}]",
        )
