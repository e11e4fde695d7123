"""What every client command (`pdwatch diagnose`, `trace`, `report`) reads a sidecar or Prometheus with, declared once.

Each field resolves flag -> environment variable (the contract's ENV_* name
for it, its validation_alias) -> default; `add_arguments` turns the
fields a command uses into its flags, with the variable and default in the
help; `ClientSettings.from_sources` says which flag or variable was wrong.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import Annotated, Any

from opentelemetry.util.re import parse_env_headers
from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict, SettingsError

from pdwatch import contract as c
from pdwatch.sidecar.settings import field_of, variable_of


def _url(value: str | None) -> str | None:
    if value is None or not value.strip():
        return None
    value = value.strip()
    if not value.startswith(("http://", "https://")):
        raise ValueError("must be an http:// or https:// URL")
    return value.rstrip("/")


class ClientSettings(BaseSettings):
    """Where the client commands read from, and how."""

    model_config = SettingsConfigDict(env_prefix=c.ENV_PREFIX, case_sensitive=False, frozen=True, populate_by_name=True,
                                      env_ignore_empty=True, extra="ignore")

    sidecar: str = Field(c.DEFAULT_SIDECAR_URL, validation_alias=c.ENV_SIDECAR, description="a sidecar's base URL")
    token: str | None = Field(None, validation_alias=c.ENV_TOKEN, repr=False, description="bearer token for the sidecar")
    prometheus: str | None = Field(None, validation_alias=c.ENV_PROMETHEUS, description="a Prometheus (or Thanos, Mimir) base URL that scrapes the sidecars")
    # The OTLP exporters' header format (OTEL_EXPORTER_OTLP_HEADERS), which the engine side reads too.
    prometheus_headers: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict, validation_alias=c.ENV_PROMETHEUS_HEADERS, description="headers for Prometheus, NAME=VALUE pairs separated by commas, "
                                          "values URL-encoded (e.g. X-Scope-OrgID=team-a)")
    timeout_s: float = Field(10.0, validation_alias=c.ENV_TIMEOUT, gt=0, allow_inf_nan=False, description="seconds to wait for each answer")
    trace_url: str | None = Field(None, validation_alias=c.ENV_TRACE_URL, description="a trace store's link for each trace id, {trace_id} replaced, "
                                                    "e.g. https://jaeger.example/trace/{trace_id}")

    @field_validator("sidecar")
    @classmethod
    def _sidecar_url(cls, value: str) -> str:
        url = _url(value)
        if url is None:
            raise ValueError("must be an http:// or https:// URL")
        return url

    @field_validator("prometheus")
    @classmethod
    def _prometheus_url(cls, value: str | None) -> str | None:
        return _url(value)

    @field_validator("prometheus_headers", mode="before")
    @classmethod
    def _headers(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        if any(p.strip() and ("=" not in p or not p.split("=", 1)[0].strip()) for p in value.split(",")):
            raise ValueError("must be NAME=VALUE pairs separated by commas")
        return dict(parse_env_headers(value, liberal=True))

    @field_validator("trace_url")
    @classmethod
    def _trace_template(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        if "{trace_id}" not in value:
            raise ValueError("must contain {trace_id}, where each trace's id goes")
        return value.strip()

    def __repr_args__(self) -> Any:  # neither the token nor a header (often a credential) may reach a log line
        for name, value in super().__repr_args__():
            yield name, ("<set>" if value else value) if name == "prometheus_headers" else value
        yield "token", "<set>" if self.token else None

    @property
    def sidecar_headers(self) -> dict[str, str] | None:
        return {"Authorization": f"Bearer {self.token}"} if self.token else None

    @classmethod
    def from_sources(cls, flags: Mapping[str, Any] | None = None) -> ClientSettings:
        """Flags that were given, else the environment, else defaults; a ValueError names the flag or variable.

        A sidecar named by a flag wins over a Prometheus named in the environment (the command reads one)."""
        given = {k: v for k, v in (flags or {}).items() if v is not None and k in cls.model_fields}
        if "sidecar" in given:
            given["prometheus"] = None
        try:
            return cls(**given)
        except ValidationError as exc:
            raise ValueError("; ".join(_explain(e, given) for e in exc.errors())) from None
        except SettingsError as exc:  # a variable pydantic-settings could not even read
            raise ValueError(str(exc)) from None


SECRET = ("token", "prometheus_headers")  # never echoed in an error: they often hold credentials


def flag(field: str) -> str:
    return f"--{field.replace('_', '-')}"


def env_name(field: str) -> str:
    return variable_of(ClientSettings, field)


def _explain(error: Any, given: Mapping[str, Any]) -> str:
    field = field_of(ClientSettings, str(error["loc"][0])) if error.get("loc") else ""
    source = flag(field) if field in given else env_name(field)
    message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    if field in SECRET:
        return f"{source}: {message}"
    return f"{source}={error.get('input')!r}: {message}"


def _shown(field: str) -> str:
    default = ClientSettings.model_fields[field].get_default(call_default_factory=True)
    return "unset" if default in (None, "", {}) else str(default)


METAVARS = {"sidecar": "URL", "prometheus": "URL", "token": "TOKEN", "prometheus_headers": "HEADERS",
            "timeout_s": "SECONDS", "trace_url": "TEMPLATE"}


def add_arguments(parser: argparse._ActionsContainer, *fields: str,
                  notes: Mapping[str, str] | None = None) -> None:
    """A flag for each named field, its help ending in [env NAME, default D]; `notes` add a clause to a help."""
    for name in fields:
        note = f" ({notes[name]})" if notes and name in notes else ""
        parser.add_argument(flag(name), dest=name, default=None, metavar=METAVARS[name],
                            help=f"{ClientSettings.model_fields[name].description}{note} "
                                 f"[env {env_name(name)}, default {_shown(name)}]")


def markdown_table() -> str:
    """The client settings table of docs/sidecar.md (a test keeps the two equal)."""
    rows = ["| flag | variable | default | |", "|---|---|---|---|"]
    for name, info in ClientSettings.model_fields.items():
        rows.append(f"| `{flag(name)}` | `{env_name(name)}` | {_shown(name)} | {info.description} |")
    return "\n".join(rows)


def for_command(prog: str, args: argparse.Namespace) -> ClientSettings | None:
    """A client command's settings from its flags, else the environment, else defaults; None after
    saying on stderr which flag or variable was wrong (the command then exits 2)."""
    try:
        return ClientSettings.from_sources(vars(args))
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None
