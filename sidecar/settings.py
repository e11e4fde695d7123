"""The sidecar's settings, declared once: each field's type, default, bounds and help.

pydantic-settings reads a field from the environment variable the contract
names for it (its validation_alias: section 11's names and pdwatch's own); `add_arguments`
turns the same fields into `pdwatch serve` flags, which win over the
environment; `markdown_table` writes the docs table. So flags, variables,
defaults, validation and docs cannot drift apart.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from pdwatch import contract as c


def _floor(stage: str) -> Any:
    return Field(c.DEFAULT_FLOORS_S[stage], validation_alias=c.floor_env(stage), gt=0, allow_inf_nan=False,
                 description=f"stuck floor of stage {stage}, seconds")


class Settings(BaseSettings):
    """Every setting of `pdwatch serve`; see docs/sidecar.md for what each one does."""

    # Each field reads the variable the contract names (validation_alias); flags and code use the field's name.
    model_config = SettingsConfigDict(env_prefix=c.ENV_PREFIX, case_sensitive=False, frozen=True, populate_by_name=True,
                                      env_ignore_empty=True, extra="forbid")

    host: str = Field(c.DEFAULT_HOST, validation_alias=c.ENV_HOST, description="address to bind (loopback by default)")
    port: int = Field(c.DEFAULT_PORT, validation_alias=c.ENV_PORT, ge=0, le=65535,
                      description="port to bind (4318 is OTLP/HTTP's, so engines reach it by default)")
    token: str | None = Field(None, validation_alias=c.ENV_TOKEN, repr=False, description=(
        "bearer token required by ingest, the API, /ui and /docs when set (/metrics and /healthz stay open)"))
    floor_bootstrap_s: float = _floor("bootstrap")
    floor_queued_s: float = _floor("queued")
    floor_prefill_s: float = _floor("prefill")
    floor_transfer_s: float = _floor("transfer")
    floor_decode_s: float = _floor("decode")
    flow_window_s: float = Field(c.DEFAULT_FLOW_WINDOW_S, validation_alias=c.ENV_FLOW_WINDOW, gt=0, allow_inf_nan=False,
                                 description="a cluster flows when some leg finished ok within this many seconds")
    forward_otlp_endpoint: str | None = Field(None, validation_alias=c.ENV_FORWARD, description=(
        "OTLP/HTTP base URL of a trace store to forward lifecycle, foreign and pd.stuck spans to"))
    forward_otlp_headers: str = Field("", validation_alias=c.ENV_FORWARD_HEADERS, repr=False, description=(
        "headers sent with each forwarded request, written as OTEL_EXPORTER_OTLP_HEADERS is: key=value pairs, "
        "comma-separated, values URL-encoded (a token for a gateway, a tenant id)"))
    forward_otlp_certificate: str | None = Field(None, validation_alias=c.ENV_FORWARD_CERTIFICATE, description=(
        "CA certificate file (PEM) the forwarder trusts for an https:// endpoint; unset: the system's"))
    nvml: Literal["auto", "off"] = Field("auto", validation_alias=c.ENV_NVML, description="auto: sample GPUs when NVML loads; off: never")
    gpu_interval_s: float = Field(1.0, validation_alias=c.ENV_GPU_INTERVAL, gt=0, allow_inf_nan=False, description="GPU sampling interval, seconds")
    gpu_map: str = Field("", validation_alias=c.ENV_GPU_MAP, description=(
        "GPUs to attribute by configuration when no instance claims them, e.g. 0=default/decode/decode-0"))
    max_body_bytes: int = Field(c.DEFAULT_MAX_BODY_BYTES, validation_alias=c.ENV_MAX_BODY, gt=0, description="largest OTLP body, after decompression")
    max_open_legs: int = Field(200_000, validation_alias=c.ENV_MAX_OPEN_LEGS, gt=0, description="open legs tracked at once; newcomers past it are refused, counted")
    max_closed_legs: int = Field(50_000, validation_alias=c.ENV_MAX_CLOSED_LEGS, gt=0,
                                 description="finished legs remembered for /api/v1/requests and de-duplication")
    max_instances: int = Field(1024, validation_alias=c.ENV_MAX_INSTANCES, gt=0, description="engine instances tracked; spans from more are rejected, counted")
    down_forget_s: float = Field(c.DEFAULT_DOWN_FORGET_S, validation_alias=c.ENV_DOWN_FORGET, gt=0,
                                 allow_inf_nan=False, description=(
        "a down instance (silent without a final heartbeat) is forgotten after this long, its open legs "
        "ending lost (a killed pod rescheduled elsewhere reports to another sidecar)"))
    overtaken_k: int = Field(c.DEFAULT_OVERTAKEN_K, validation_alias=c.ENV_OVERTAKEN_K, ge=1,
                             le=c.OVERTAKEN_PASSAGES_KEPT, description=(
        "overtaken evidence (contract section 5b): how many later legs of its instance, with at least its prompt "
        "tokens, must have gone through a leg's stage while it waited"))
    overtaken_m: float = Field(c.DEFAULT_OVERTAKEN_M, validation_alias=c.ENV_OVERTAKEN_M, gt=0, allow_inf_nan=False,
                               description=(
        "overtaken evidence: the leg is stuck once it waited longer than max(2 heartbeat intervals, this many "
        "times the longest of those passages)"))
    instance_ttl_s: float = Field(3600.0, validation_alias=c.ENV_INSTANCE_TTL, gt=0, allow_inf_nan=False, description=(
        "an instance none of whose ranks sent anything for this long is forgotten with its open legs, counted"))
    max_rss_bytes: int = Field(4 << 30, validation_alias=c.ENV_MAX_RSS, ge=0, description=(
        "resident memory above which ingest answers 503 with Retry-After until it falls again; 0 = no limit"))
    evaluate_interval_s: float = Field(0.5, validation_alias=c.ENV_EVALUATE_INTERVAL, gt=0, allow_inf_nan=False,
                                       description="how often the judge runs (stuck rule, evidence, diagnosis), seconds")
    capture: Literal["off", "py-spy"] = Field("off", validation_alias=c.ENV_CAPTURE, description=(
        "py-spy: take the Python stacks of an engine's ranks (same host, reported PIDs) when it first has "
        "stuck legs or its loop freezes; off: never"))
    capture_every_s: float = Field(600.0, validation_alias=c.ENV_CAPTURE_EVERY, gt=0, allow_inf_nan=False,
                                   description="at most one stack capture per instance this often, seconds")
    capture_timeout_s: float = Field(10.0, validation_alias=c.ENV_CAPTURE_TIMEOUT, gt=0, allow_inf_nan=False, description="longest one py-spy dump may take")
    capture_hosts: str = Field("", validation_alias=c.ENV_CAPTURE_HOSTS, description=(
        "comma-separated host.name values whose engines' PIDs this sidecar may read; empty: its own hostname"))
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", validation_alias=c.ENV_LOG_LEVEL, description="log level")

    @field_validator("forward_otlp_endpoint")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value and not value.strip().startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        return value.strip() if value else None

    @property
    def floors(self) -> dict[str, float]:
        return {stage: float(getattr(self, f"floor_{stage}_s")) for stage in c.ALL_STAGES}

    def __repr_args__(self) -> Any:  # the token must never reach a log line
        yield from super().__repr_args__()
        yield "token", "<set>" if self.token else None
        yield "forward_otlp_headers", "<set>" if self.forward_otlp_headers else ""

    @classmethod
    def from_sources(cls, flags: Mapping[str, Any] | None = None) -> Settings:
        """Flags that were given, else the environment, else defaults; a ValueError names the source."""
        given = {k: v for k, v in (flags or {}).items() if v is not None and k in cls.model_fields}
        try:
            return cls(**given)
        except ValidationError as exc:
            raise ValueError("; ".join(_explain(error, given) for error in exc.errors())) from None


def variable_of(model: type[BaseSettings], field: str) -> str:
    """The variable a field of a settings model is read from: the contract's name for it."""
    alias = model.model_fields[field].validation_alias
    assert isinstance(alias, str), f"setting {field} names no variable"
    return alias


def field_of(model: type[BaseSettings], loc: str) -> str:
    """The field a validation error is about: its location is the variable's name when the value came
    from the environment."""
    return next((name for name in model.model_fields if variable_of(model, name) == loc), loc)


def env_name(field: str) -> str:
    return variable_of(Settings, field)


def _explain(error: Any, flags: Mapping[str, Any]) -> str:
    field = field_of(Settings, str(error["loc"][0])) if error.get("loc") else ""
    source = f"--{field.replace('_', '-')}" if field in flags else env_name(field)
    value = error.get("input")
    message = str(error.get("msg", "invalid"))
    if isinstance(value, Mapping):  # a model-level error carries the whole input
        return f"{source}: {message}"
    return f"{source}={value!r}: {message}"


def _shown(default: Any) -> str:
    return "unset" if default in (None, "") else str(default)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field, --field-name, typed as text: pydantic validates flags like variables."""
    for name, info in Settings.model_fields.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}", dest=name, default=None, metavar=name.upper().split("_")[-1],
            help=f"{info.description} [env {env_name(name)}, default {_shown(info.default)}]",
        )


def markdown_table() -> str:
    """The settings table of docs/sidecar.md (a test keeps the two equal)."""
    rows = ["| flag | variable | default | |", "|---|---|---|---|"]
    for name, info in Settings.model_fields.items():
        rows.append(f"| `--{name.replace('_', '-')}` | `{env_name(name)}` | {_shown(info.default)} | "
                    f"{info.description} |")
    return "\n".join(rows)
