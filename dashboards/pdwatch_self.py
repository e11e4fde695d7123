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
        "Spans and heartbeats received", "OTLP spans ingested per second, and the heartbeats among them.",
        [(f"sum(rate({c.SPANS_RECEIVED.series}{RATE}))", "spans"),
         (f"sum(rate({c.HEARTBEATS_RECEIVED.series}{RATE}))", "heartbeats")],
        unit="ops",
    ))
    d.with_panel(p.timeseries(
        "Spans rejected by reason", "Spans the sidecar could not use, by reason.",
        [(f"sum by ({c.SPANS_REJECTED.by(c.L_REASON)}) (rate({c.SPANS_REJECTED.series}{RATE}))", legend(c.L_REASON))],
        unit="ops",
    ))

    d.with_row(p.row("Tracking"))
    d.with_panel(p.timeseries(
        "Tracked legs and instances", "Open legs and engine instances the sidecar holds in memory.",
        [(f"sum({c.TRACKED_LEGS.series})", "legs"), (f"sum({c.TRACKED_INSTANCES.series})", "instances")],
        unit="none",
    ))
    d.with_panel(p.timeseries(
        "Legs evicted by reason", "Legs dropped from tracking (bounds, instance restarts), per second.",
        [(f"sum by ({c.LEGS_EVICTED.by(c.L_REASON)}) (rate({c.LEGS_EVICTED.series}{RATE}))", legend(c.L_REASON))],
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
        "GPU telemetry up", "1 when the sidecar samples GPUs through NVML.", f"min({c.GPU_TELEMETRY_UP.series})",
        width=4, height=8,
    ))
    return d
