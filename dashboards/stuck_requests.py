"""Dashboard "Stuck requests": every stuck leg with a link to its trace in
Jaeger, and one row per instance."""

from __future__ import annotations

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import table
from grafana_foundation_sdk.models import dashboard as dm

from pdwatch.dashboards.common import BY_INSTANCE, BY_ROLE, CLUSTER, ROLE, Panels, dashboard, sel, variables

UID = "pdwatch-stuck-requests"

# Grafana Explore on the Jaeger data source chosen in $jaeger, searching the
# cell's trace id. Grafana fills ${...} before following the link, so the
# JSON stays unencoded.
TRACE_EXPLORE_URL = (
    '/explore?schemaVersion=1&panes={"trace":{"datasource":"${jaeger}","queries":[{"refId":"A",'
    '"datasource":{"type":"jaeger","uid":"${jaeger}"},"query":"${__value.raw}"}],'
    '"range":{"from":"now-1h","to":"now"}}}&orgId=1'
)


def _stuck_table(p: Panels) -> table.Panel:
    panel = p.table(
        "Stuck legs",
        "The 20 oldest stuck legs (pdwatch_stuck_request_info; value = age in the stage). "
        "The trace id opens the request's trace, where a pd.stuck span marks the hung stage.",
        f"max by (trace_id, rid, role, stage, pd_instance) (pdwatch_stuck_request_info{BY_INSTANCE})",
    )
    panel.with_transformation(dm.DataTransformerConfig(id_val="organize", options={
        "excludeByName": {"Time": True},
        "indexByName": {"trace_id": 0, "role": 1, "stage": 2, "Value": 3, "pd_instance": 4, "rid": 5},
        "renameByName": {"Value": "age in stage"},
    }))
    panel.sort_by([cb.TableSortByFieldState().display_name("age in stage").desc(True)])
    panel.override_by_name("trace_id", [
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
        "Stuck legs by stage", "pdwatch_stuck_requests per role and stage.",
        [(f"sum by (role, stage) (pdwatch_stuck_requests{BY_INSTANCE})", "{{role}} {{stage}}")], unit="none",
    ))
    d.with_panel(p.timeseries(
        "Thresholds", "The stuck threshold per role and stage: max(floor, 3 x p99 of recent durations).",
        [(f"max by (role, stage) (pdwatch_stuck_threshold_seconds{BY_ROLE})", "{{role}} {{stage}}")], unit="s",
    ))

    # One row per selected instance (Grafana repeats it over $instance).
    one = sel(CLUSTER, ROLE, 'pd_instance=~"$instance"')
    d.with_row(p.row("Instance $instance").repeat("instance"))
    d.with_panel(p.timeseries(
        "Stuck legs on $instance", "Stuck legs of this instance per stage.",
        [(f"sum by (stage) (pdwatch_stuck_requests{one})", "{{stage}}")], unit="none", width=6,
    ))
    d.with_panel(p.timeseries(
        "In flight on $instance", "Open legs of this instance per stage.",
        [(f"sum by (stage) (pdwatch_inflight_requests{one})", "{{stage}}")], unit="none", width=6, stacked=True,
    ))
    d.with_panel(p.timeseries(
        "Oldest stage age on $instance", "The oldest open leg's age per stage on this instance.",
        [(f"max by (stage) (pdwatch_oldest_stage_age_seconds{one})", "{{stage}}")], unit="s", width=6,
    ))
    d.with_panel(p.timeseries(
        "Up, loop stalled, heartbeat age on $instance",
        "Whether the sidecar hears the instance, whether its scheduler loop advances, and the age of its last "
        "heartbeat.",
        [(f"max(pdwatch_instance_up{one})", "up"),
         (f"max(pdwatch_engine_loop_stalled{one})", "loop stalled"),
         (f"max(pdwatch_instance_heartbeat_age_seconds{one})", "heartbeat age (s)")],
        unit="none", width=6,
    ))
    return d
