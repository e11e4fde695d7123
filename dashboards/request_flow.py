"""Dashboard "PD request flow": are requests moving through every stage, which
legs are stuck, and what the GPUs of each role do meanwhile."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import statetimeline
from grafana_foundation_sdk.models import dashboard as dm

from pdwatch.dashboards.common import (
    BY_INSTANCE,
    BY_ROLE,
    CLUSTER,
    Panels,
    PrometheusAnnotation,
    dashboard,
    sel,
    variables,
)

UID = "pdwatch-request-flow"
RATE = "[$__rate_interval]"


def build() -> db.Dashboard:
    p = Panels()
    d = dashboard(
        UID, "PD request flow",
        "Flow and in-flight legs per stage and role, stuck legs against their thresholds, completions, "
        "and the GPUs of each role beside the request state. Restarts are annotations.",
    )
    for v in variables():
        d.with_variable(v)
    d.annotation(PrometheusAnnotation(
        "Instance restarts",
        f"changes(pdwatch_instance_start_time_seconds{BY_INSTANCE}[1m]) > 0",
        title="restart of {{pd_instance}} ({{role}})", tag_keys="cluster,role,pd_instance", color="orange",
    ))

    d.with_row(p.row("Stuck now"))
    d.with_panel(p.stat(
        "Stuck legs now", "Legs the sidecar judges stuck: in one stage past max(floor, 3 x p99) without progress.",
        f"sum(pdwatch_stuck_requests{BY_INSTANCE})", red_at=1,
    ))
    d.with_panel(p.stat(
        "Legs in flight", "Open legs of every stage.", f"sum(pdwatch_inflight_requests{BY_INSTANCE})",
    ))
    d.with_panel(p.stat(
        "Others flowing", "1 when some leg of the cluster finished ok within the sidecar's flow window (60 s).",
        f"min(pdwatch_cluster_flowing{sel(CLUSTER)})",
    ))
    d.with_panel(p.timeseries(
        "Stuck legs by stage and instance", "pdwatch_stuck_requests per role, stage and instance.",
        [(f"sum by (role, stage, pd_instance) (pdwatch_stuck_requests{BY_INSTANCE})",
          "{{role}} {{stage}} {{pd_instance}}")],
        unit="none", width=12, height=4,
    ))

    d.with_row(p.row("Flow per stage"))
    d.with_panel(p.timeseries(
        "Legs leaving each stage", "Stage exits per second (the stage duration histogram's count).",
        [(f"sum by (role, stage) (rate(pdwatch_stage_duration_seconds_count{BY_ROLE}{RATE}))", "{{role}} {{stage}}")],
        unit="ops",
    ))
    d.with_panel(p.timeseries(
        "Legs in flight per stage", "Open legs per role and stage.",
        [(f"sum by (role, stage) (pdwatch_inflight_requests{BY_INSTANCE})", "{{role}} {{stage}}")],
        unit="none", stacked=True,
    ))
    age = p.timeseries(
        "Oldest stage age against its threshold",
        "The oldest open leg's age in each stage (decode: since its last token), and the stuck threshold "
        "(dashed) it is judged against.",
        [(f"max by (role, stage) (pdwatch_oldest_stage_age_seconds{BY_INSTANCE})", "{{role}} {{stage}} oldest"),
         (f"max by (role, stage) (pdwatch_stuck_threshold_seconds{BY_ROLE})", "{{role}} {{stage}} threshold")],
        unit="s",
    )
    age.override_by_regexp(".* threshold$", [
        dm.DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]}),
        dm.DynamicConfigValue(id_val="custom.fillOpacity", value=0),
    ])
    d.with_panel(age)
    durations = p.timeseries(
        "Stage duration p99 (exemplars link to traces)",
        "p99 of finished stages from pdwatch_stage_duration_seconds; exemplars carry the trace id.",
        [(f"histogram_quantile(0.99, sum by (le, role, stage) "
          f"(rate(pdwatch_stage_duration_seconds_bucket{BY_ROLE}{RATE})))", "{{role}} {{stage}} p99")],
        unit="s", exemplars=True,
    )
    d.with_panel(durations)
    d.with_panel(p.timeseries(
        "Completions by outcome", "Legs finished per second by role and outcome (lost = ended by a restart).",
        [(f"sum by (role, outcome) (rate(pdwatch_requests_finished_total{BY_INSTANCE}{RATE}))", "{{role}} {{outcome}}")],
        unit="reqps",
    ))
    d.with_panel(p.timeseries(
        "Stuck detections", "Legs newly judged stuck, per role and stage (each leg once).",
        [(f"sum by (role, stage) (increase(pdwatch_stuck_detected_total{BY_ROLE}{RATE}))", "{{role}} {{stage}}")],
        unit="none",
    ))

    d.with_row(p.row("GPUs beside request state"))
    d.with_panel(p.timeseries(
        "Request state by role", "Legs in flight and stuck per role.",
        [(f"sum by (role) (pdwatch_inflight_requests{BY_INSTANCE})", "{{role}} in flight"),
         (f"sum by (role) (pdwatch_stuck_requests{BY_INSTANCE})", "{{role}} stuck")],
        unit="none", width=8,
    ))
    d.with_panel(p.timeseries(
        "GPU utilization by role",
        "Near 0 % on the decode side with stuck transfers: a transfer wedge; ~100 % with frozen loops: a "
        "stuck collective.",
        [(f"avg by (role, pd_instance) (pdwatch_gpu_utilization_ratio{BY_INSTANCE})", "{{role}} {{pd_instance}}")],
        unit="percentunit", width=8,
    ).min(0).max(1))
    d.with_panel(p.timeseries(
        "GPU power by role", "Power drawn against the power limit, per instance.",
        [(f"sum by (role, pd_instance) (pdwatch_gpu_power_watts{BY_INSTANCE})", "{{role}} {{pd_instance}}"),
         (f"sum by (role, pd_instance) (pdwatch_gpu_power_limit_watts{BY_INSTANCE})", "{{role}} {{pd_instance}} limit")],
        unit="watt", width=8,
    ).override_by_regexp(".* limit$", [
        dm.DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]}),
    ]))
    families = p.setup(
        statetimeline.Panel(), "Suspected failure family",
        "The sidecar's diagnosis per family (contract section 8).",
        [(f"max by (family) (pdwatch_suspected_failure{sel(CLUSTER)})", "{{family}}")], width=24, height=6,
    )
    families.mappings([dm.ValueMap(options={
        "0": dm.ValueMappingResult(text="no", color="transparent", index=0),
        "1": dm.ValueMappingResult(text="suspected", color="red", index=1),
    })])
    d.with_panel(families)
    return d
