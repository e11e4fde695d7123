"""Dashboard "PD request flow": are requests moving through every stage, which
legs are stuck, and what the GPUs of each role do meanwhile."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import statetimeline
from grafana_foundation_sdk.models import dashboard as dm

from pdwatch import contract as c
from pdwatch.dashboards.common import (
    BY_INSTANCE,
    BY_ROLE,
    CLUSTER,
    Panels,
    PrometheusAnnotation,
    dashboard,
    legend,
    sel,
    variables,
)

UID = "pdwatch-request-flow"
RATE = "[$__rate_interval]"
ROLE, STAGE, INSTANCE = c.L_ROLE, c.L_STAGE, c.L_INSTANCE


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
        f"changes({c.INSTANCE_START.series}{BY_INSTANCE}[1m]) > 0",
        title=f"restart of {legend(INSTANCE)} ({legend(ROLE)})", tag_keys=",".join(c.INSTANCE_KEY), color="orange",
    ))

    d.with_row(p.row("Stuck now"))
    d.with_panel(p.stat(
        "Stuck legs now",
        f"Legs the sidecar judges stuck: in one stage past max(floor, {c.P99_FACTOR:g} x p99) without progress. "
        "Each leg group counted once, however many sidecars report it (max by, as the rules read it).",
        f"sum(max by ({c.STUCK.by(*c.LEG_GROUP)}) ({c.STUCK.series}{BY_INSTANCE}))", red_at=1,
    ))
    d.with_panel(p.stat(
        "Legs in flight", "Open legs of every stage.", f"sum({c.INFLIGHT.series}{BY_INSTANCE})",
    ))
    d.with_panel(p.stat(
        "Others flowing",
        f"1 when some leg of the cluster finished ok within a sidecar's flow window "
        f"({c.DEFAULT_FLOW_WINDOW_S:g} s): any sidecar that saw one (max, as the rules read it).",
        f"max({c.CLUSTER_FLOWING.series}{sel(CLUSTER)})",
    ))
    d.with_panel(p.timeseries(
        "Stuck legs by stage and instance", f"{c.STUCK.name} per role, stage and instance.",
        [(f"sum by ({c.STUCK.by(ROLE, STAGE, INSTANCE)}) ({c.STUCK.series}{BY_INSTANCE})",
          legend(ROLE, STAGE, INSTANCE))],
        unit="none", width=12, height=4,
    ))

    d.with_row(p.row("Flow per stage"))
    durations = c.STAGE_DURATION
    d.with_panel(p.timeseries(
        "Legs leaving each stage", "Stage exits per second (the stage duration histogram's count).",
        [(f"sum by ({durations.by(ROLE, STAGE)}) (rate({durations.sample('count')}{BY_ROLE}{RATE}))",
          legend(ROLE, STAGE))],
        unit="ops",
    ))
    d.with_panel(p.timeseries(
        "Legs in flight per stage", "Open legs per role and stage.",
        [(f"sum by ({c.INFLIGHT.by(ROLE, STAGE)}) ({c.INFLIGHT.series}{BY_INSTANCE})", legend(ROLE, STAGE))],
        unit="none", stacked=True,
    ))
    age = p.timeseries(
        "Oldest stage age against its threshold",
        "The oldest open leg's age in each stage (decode: since its last token), and the stuck threshold "
        "(dashed) it is judged against.",
        [(f"max by ({c.OLDEST_AGE.by(ROLE, STAGE)}) ({c.OLDEST_AGE.series}{BY_INSTANCE})",
          f"{legend(ROLE, STAGE)} oldest"),
         (f"max by ({c.THRESHOLD.by(ROLE, STAGE)}) ({c.THRESHOLD.series}{BY_ROLE})",
          f"{legend(ROLE, STAGE)} threshold")],
        unit="s",
    )
    age.override_by_regexp(".* threshold$", [
        dm.DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]}),
        dm.DynamicConfigValue(id_val="custom.fillOpacity", value=0),
    ])
    d.with_panel(age)
    p99 = p.timeseries(
        "Stage duration p99 (exemplars link to traces)",
        f"p99 of finished stages from {durations.name}; exemplars carry the trace id.",
        [(f"histogram_quantile(0.99, sum by ({durations.by(c.L_LE, ROLE, STAGE)}) "
          f"(rate({durations.sample('bucket')}{BY_ROLE}{RATE})))", f"{legend(ROLE, STAGE)} p99")],
        unit="s", exemplars=True,
    )
    d.with_panel(p99)
    d.with_panel(p.timeseries(
        "Completions by outcome", "Legs finished per second by role and outcome (lost = ended by a restart).",
        [(f"sum by ({c.FINISHED.by(ROLE, c.L_OUTCOME)}) (rate({c.FINISHED.series}{BY_INSTANCE}{RATE}))",
          legend(ROLE, c.L_OUTCOME))],
        unit="reqps",
    ))
    d.with_panel(p.timeseries(
        "Stuck detections", "Legs newly judged stuck, per role and stage (each leg once).",
        [(f"sum by ({c.STUCK_DETECTED.by(ROLE, STAGE)}) (increase({c.STUCK_DETECTED.series}{BY_ROLE}{RATE}))",
          legend(ROLE, STAGE))],
        unit="none",
    ))

    d.with_row(p.row("GPUs beside request state"))
    d.with_panel(p.timeseries(
        "Request state by role", "Legs in flight and stuck per role.",
        [(f"sum by ({c.INFLIGHT.by(ROLE)}) ({c.INFLIGHT.series}{BY_INSTANCE})", f"{legend(ROLE)} in flight"),
         (f"sum by ({c.STUCK.by(ROLE)}) ({c.STUCK.series}{BY_INSTANCE})", f"{legend(ROLE)} stuck")],
        unit="none", width=8,
    ))
    d.with_panel(p.timeseries(
        "GPU utilization by role",
        "Near 0 % on the decode side with stuck transfers: a transfer wedge; ~100 % with frozen loops: a "
        "stuck collective.",
        [(f"avg by ({c.GPU_UTILIZATION.by(ROLE, INSTANCE)}) ({c.GPU_UTILIZATION.series}{BY_INSTANCE})",
          legend(ROLE, INSTANCE))],
        unit="percentunit", width=8,
    ).min(0).max(1))
    d.with_panel(p.timeseries(
        "GPU power by role", "Power drawn against the power limit, per instance.",
        [(f"sum by ({c.GPU_POWER.by(ROLE, INSTANCE)}) ({c.GPU_POWER.series}{BY_INSTANCE})", legend(ROLE, INSTANCE)),
         (f"sum by ({c.GPU_POWER_LIMIT.by(ROLE, INSTANCE)}) ({c.GPU_POWER_LIMIT.series}{BY_INSTANCE})",
          f"{legend(ROLE, INSTANCE)} limit")],
        unit="watt", width=8,
    ).override_by_regexp(".* limit$", [
        dm.DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]}),
    ]))
    families = p.setup(
        statetimeline.Panel(), "Suspected failure family",
        "The sidecar's diagnosis per family (contract section 8).",
        [(f"max by ({c.SUSPECTED_FAILURE.by(c.L_FAMILY)}) ({c.SUSPECTED_FAILURE.series}{sel(CLUSTER)})",
          legend(c.L_FAMILY))],
        width=24, height=6,
    )
    families.mappings([dm.ValueMap(options={
        "0": dm.ValueMappingResult(text="no", color="transparent", index=0),
        "1": dm.ValueMappingResult(text="suspected", color="red", index=1),
    })])
    d.with_panel(families)
    return d
