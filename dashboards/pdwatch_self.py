"""Dashboard "pdwatch itself": is the sidecar receiving, keeping up, and
seeing the GPUs."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db

from pdwatch import contract as c
from pdwatch.dashboards.common import BY_INSTANCE, Panels, dashboard, legend, variables

UID = "pdwatch-self"
RATE = "[$__rate_interval]"
PER_INSTANCE = (c.L_ROLE, c.L_INSTANCE)


def build() -> db.Dashboard:
    p = Panels()
    d = dashboard(
        UID, "pdwatch itself",
        "The sidecar's own health: ingest, rejections, tracked legs, evictions, engine heartbeats and GPU "
        "telemetry.",
    )
    for v in variables():
        d.with_variable(v)

    d.with_row(p.row("Ingest"))
    d.with_panel(p.timeseries(
        "Spans and heartbeats received",
        "OTLP spans ingested per second, and the heartbeats among them, per sidecar (the scrape target): a "
        "sidecar whose line falls to zero while the others go on is the one to look at.",
        [(f"sum by ({c.SPANS_RECEIVED.by(c.L_TARGET)}) (rate({c.SPANS_RECEIVED.series}{RATE}))",
          f"{legend(c.L_TARGET)} spans"),
         (f"sum by ({c.HEARTBEATS_RECEIVED.by(c.L_TARGET)}) (rate({c.HEARTBEATS_RECEIVED.series}{RATE}))",
          f"{legend(c.L_TARGET)} heartbeats")],
        unit="ops",
    ))
    d.with_panel(p.timeseries(
        "Spans rejected by reason", "Spans a sidecar could not use, by sidecar and reason.",
        [(f"sum by ({c.SPANS_REJECTED.by(c.L_TARGET, c.L_REASON)}) (rate({c.SPANS_REJECTED.series}{RATE}))",
          legend(c.L_TARGET, c.L_REASON))],
        unit="ops",
    ))

    d.with_row(p.row("Tracking"))
    d.with_panel(p.timeseries(
        "Tracked legs and instances", "Open legs and engine instances each sidecar holds in memory.",
        [(f"sum by ({c.TRACKED_LEGS.by(c.L_TARGET)}) ({c.TRACKED_LEGS.series})", f"{legend(c.L_TARGET)} legs"),
         (f"sum by ({c.TRACKED_INSTANCES.by(c.L_TARGET)}) ({c.TRACKED_INSTANCES.series})",
          f"{legend(c.L_TARGET)} instances")],
        unit="none",
    ))
    d.with_panel(p.timeseries(
        "Legs evicted by reason", "Legs dropped from tracking (bounds, instance restarts), per second, by sidecar.",
        [(f"sum by ({c.LEGS_EVICTED.by(c.L_TARGET, c.L_REASON)}) (rate({c.LEGS_EVICTED.series}{RATE}))",
          legend(c.L_TARGET, c.L_REASON))],
        unit="ops",
    ))

    d.with_row(p.row("Engines and GPUs"))
    d.with_panel(p.timeseries(
        "Heartbeat age per instance",
        f"Seconds since each engine instance's last heartbeat; down after {c.DOWN_AFTER_INTERVALS} intervals.",
        [(f"max by ({c.HEARTBEAT_AGE.by(*PER_INSTANCE)}) ({c.HEARTBEAT_AGE.series}{BY_INSTANCE})",
          legend(*PER_INSTANCE))],
        unit="s",
    ))
    d.with_panel(p.timeseries(
        "Instances up",
        f"{c.INSTANCE_UP.name} per instance (0 = no heartbeat for {c.DOWN_AFTER_INTERVALS} intervals).",
        [(f"max by ({c.INSTANCE_UP.by(*PER_INSTANCE)}) ({c.INSTANCE_UP.series}{BY_INSTANCE})",
          legend(*PER_INSTANCE))],
        unit="none", width=8,
    ))
    d.with_panel(p.stat(
        "GPU telemetry up", "1 when a sidecar samples GPUs through NVML; one value per sidecar.",
        f"min by ({c.GPU_TELEMETRY_UP.by(c.L_TARGET)}) ({c.GPU_TELEMETRY_UP.series})", legend=legend(c.L_TARGET),
        width=4, height=8,
    ))

    # Contract v1.2: where pdwatch itself goes blind.
    d.with_row(p.row("Blind spots"))
    d.with_panel(p.timeseries(
        "Engine telemetry lost",
        "Per instance, spans its engine side dropped (queue or buffer full), spans in exports the sidecar did not "
        "take, and exceptions caught in its hooks, per second.",
        [(f"sum by ({c.ENGINE_SPANS_DROPPED.by(*PER_INSTANCE)}) "
          f"(rate({c.ENGINE_SPANS_DROPPED.series}{BY_INSTANCE}{RATE}))", "dropped " + legend(*PER_INSTANCE)),
         (f"sum by ({c.ENGINE_EXPORTS_FAILED.by(*PER_INSTANCE)}) "
          f"(rate({c.ENGINE_EXPORTS_FAILED.series}{BY_INSTANCE}{RATE}))", "export failed " + legend(*PER_INSTANCE)),
         (f"sum by ({c.ENGINE_HOOK_ERRORS.by(*PER_INSTANCE)}) "
          f"(rate({c.ENGINE_HOOK_ERRORS.series}{BY_INSTANCE}{RATE}))", "hook errors " + legend(*PER_INSTANCE))],
        unit="ops",
    ))
    d.with_panel(p.table(
        "Engine plugin state",
        f"One row per instance: its engine and version, the pdwatch plugin's version and state ({c.PLUGIN_ACTIVE}: "
        f"every hook installed; {c.PLUGIN_PARTIAL}, {c.PLUGIN_INACTIVE}: part or none of the engine is observed; "
        f"{c.PLUGIN_UNKNOWN}: it does not say).",
        f"max by ({c.ENGINE_INFO.by(*c.ENGINE_INFO.labels)}) ({c.ENGINE_INFO.series}{BY_INSTANCE})",
        width=12, height=8,
    ))
    d.with_panel(p.timeseries(
        "Judge evaluation age",
        f"Seconds since each sidecar's judge last finished a pass; {c.PATH_HEALTH} answers 503 past "
        f"{c.JUDGE_STALLED_INTERVALS} evaluate intervals.",
        [(f"max by ({c.EVALUATION_AGE.by(c.L_TARGET)}) ({c.EVALUATION_AGE.series})", legend(c.L_TARGET))],
        unit="s",
    ))
    d.with_panel(p.timeseries(
        "Sidecars up",
        "Prometheus's up for each sidecar it scrapes (0: the scrape failed: nothing can page for its engines).",
        [(f"max by ({c.L_JOB}, {c.L_TARGET}) ({c.SIDECAR_UP})", legend(c.L_TARGET))],
        unit="none",
    ))
    return d
