"""Dashboard "Stuck requests": every stuck leg with a link to its trace in
Jaeger, and one row per instance."""

from __future__ import annotations

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import table
from grafana_foundation_sdk.models import dashboard as dm

from pdwatch import contract as c
from pdwatch.dashboards.common import BY_INSTANCE, BY_ROLE, Panels, dashboard, legend, variables

UID = "pdwatch-stuck-requests"
STAGE, INSTANCE = c.L_STAGE, c.L_INSTANCE

# Grafana Explore on the Jaeger data source chosen in $jaeger, searching the
# cell's trace id. Grafana fills ${...} before following the link, so the
# JSON stays unencoded.
TRACE_EXPLORE_URL = (
    '/explore?schemaVersion=1&panes={"trace":{"datasource":"${jaeger}","queries":[{"refId":"A",'
    '"datasource":{"type":"jaeger","uid":"${jaeger}"},"query":"${__value.raw}"}],'
    '"range":{"from":"now-1h","to":"now"}}}&orgId=1'
)


def _stuck_table(p: Panels) -> table.Panel:
    info = c.STUCK_INFO
    panel = p.table(
        "Stuck legs",
        f"The {c.STUCK_INFO_TOP} oldest stuck legs ({info.name}; value = age in the stage). "
        f"The trace id opens the request's trace, where a {c.SPAN_STUCK} span marks the hung stage. "
        "The reason says why the leg is stuck: past its threshold, or on the engines' own evidence.",
        f"max by ({info.by(c.L_TRACE_ID, c.L_RID, c.L_ROLE, STAGE, INSTANCE, c.L_REASON, c.L_CLUSTER)}) "
        f"({info.series}{BY_INSTANCE})",
    )
    panel.with_transformation(dm.DataTransformerConfig(id_val="organize", options={
        "excludeByName": {"Time": True},
        "indexByName": {c.L_TRACE_ID: 0, c.L_ROLE: 1, STAGE: 2, "Value": 3, c.L_REASON: 4, INSTANCE: 5, c.L_RID: 6,
                        c.L_CLUSTER: 7},
        "renameByName": {"Value": "age in stage"},
    }))
    panel.sort_by([cb.TableSortByFieldState().display_name("age in stage").desc(True)])
    panel.override_by_name(c.L_TRACE_ID, [
        dm.DynamicConfigValue(id_val="links", value=[
            {"title": "Open trace ${__value.raw} in Jaeger", "url": TRACE_EXPLORE_URL, "targetBlank": True},
        ]),
    ])
    panel.override_by_name("age in stage", [dm.DynamicConfigValue(id_val="unit", value="s")])
    return panel


def build() -> db.Dashboard:
    p = Panels()
    d = dashboard(
        UID, "Stuck requests",
        "The stuck legs, each with a link to its trace in Jaeger, and a row per instance.",
    )
    for v in variables(jaeger=True):
        d.with_variable(v)

    d.with_row(p.row("Stuck legs"))
    d.with_panel(_stuck_table(p))
    d.with_panel(p.timeseries(
        "Stuck legs by stage", f"{c.STUCK.name} per role and stage.",
        [(f"sum by ({c.STUCK.by(c.L_ROLE, STAGE)}) ({c.STUCK.series}{BY_INSTANCE})", legend(c.L_ROLE, STAGE))],
        unit="none",
    ))
    d.with_panel(p.timeseries(
        "Thresholds", f"The stuck threshold per role and stage: max(floor, {c.P99_FACTOR:g} x p99 of recent durations).",
        [(f"max by ({c.THRESHOLD.by(c.L_ROLE, STAGE)}) ({c.THRESHOLD.series}{BY_ROLE})", legend(c.L_ROLE, STAGE))],
        unit="s",
    ))

    # One row per selected instance (Grafana repeats it over $instance, so there it is that one).
    one = BY_INSTANCE
    d.with_row(p.row("Instance $instance").repeat("instance"))
    d.with_panel(p.timeseries(
        "Stuck legs on $instance", "Stuck legs of this instance per stage.",
        [(f"sum by ({c.STUCK.by(STAGE)}) ({c.STUCK.series}{one})", legend(STAGE))], unit="none", width=6,
    ))
    d.with_panel(p.timeseries(
        "In flight on $instance", "Open legs of this instance per stage.",
        [(f"sum by ({c.INFLIGHT.by(STAGE)}) ({c.INFLIGHT.series}{one})", legend(STAGE))], unit="none", width=6,
        stacked=True,
    ))
    d.with_panel(p.timeseries(
        "Oldest stage age on $instance", "The oldest open leg's age per stage on this instance.",
        [(f"max by ({c.OLDEST_AGE.by(STAGE)}) ({c.OLDEST_AGE.series}{one})", legend(STAGE))], unit="s", width=6,
    ))
    d.with_panel(p.timeseries(
        "Up, loop stalled, heartbeat age on $instance",
        "Whether the sidecar hears the instance, whether its scheduler loop advances, and the age of its last "
        "heartbeat.",
        [(f"max({c.INSTANCE_UP.series}{one})", "up"),
         (f"max({c.LOOP_STALLED.series}{one})", "loop stalled"),
         (f"max({c.HEARTBEAT_AGE.series}{one})", "heartbeat age (s)")],
        unit="none", width=6,
    ))
    return d
