"""Dashboard "pdwatch itself": is the sidecar receiving, keeping up, and
seeing the GPUs."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db

from pdwatch.dashboards.common import BY_INSTANCE, Panels, dashboard, variables

UID = "pdwatch-self"
RATE = "[$__rate_interval]"


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
        [(f"sum(rate(pdwatch_spans_received_total{RATE}))", "spans"),
         (f"sum(rate(pdwatch_heartbeats_received_total{RATE}))", "heartbeats")],
        unit="ops",
    ))
    d.with_panel(p.timeseries(
        "Spans rejected by reason", "Spans the sidecar could not use, by reason.",
        [(f"sum by (reason) (rate(pdwatch_spans_rejected_total{RATE}))", "{{reason}}")], unit="ops",
    ))

    d.with_row(p.row("Tracking"))
    d.with_panel(p.timeseries(
        "Tracked legs and instances", "Open legs and engine instances the sidecar holds in memory.",
        [("sum(pdwatch_tracked_legs)", "legs"), ("sum(pdwatch_tracked_instances)", "instances")], unit="none",
    ))
    d.with_panel(p.timeseries(
        "Legs evicted by reason", "Legs dropped from tracking (bounds, instance restarts), per second.",
        [(f"sum by (reason) (rate(pdwatch_legs_evicted_total{RATE}))", "{{reason}}")], unit="ops",
    ))

    d.with_row(p.row("Engines and GPUs"))
    d.with_panel(p.timeseries(
        "Heartbeat age per instance", "Seconds since each engine instance's last heartbeat; down after 3 intervals.",
        [(f"max by (role, pd_instance) (pdwatch_instance_heartbeat_age_seconds{BY_INSTANCE})", "{{role}} {{pd_instance}}")],
        unit="s",
    ))
    d.with_panel(p.timeseries(
        "Instances up", "pdwatch_instance_up per instance (0 = no heartbeat for 3 intervals).",
        [(f"max by (role, pd_instance) (pdwatch_instance_up{BY_INSTANCE})", "{{role}} {{pd_instance}}")],
        unit="none", width=8,
    ))
    d.with_panel(p.stat(
        "GPU telemetry up", "1 when the sidecar samples GPUs through NVML.", "min(pdwatch_gpu_telemetry_up)",
        width=4, height=8,
    ))
    return d
