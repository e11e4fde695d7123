"""Pieces every pdwatch dashboard shares: data sources, variables, label
selectors, and panel builders with the defaults pdwatch wants."""

from __future__ import annotations

import itertools
import typing

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

from pdwatch import contract as c

# The data source uids the provisioning files give (provisioning/datasources).
PROMETHEUS_UID = "pdwatch-prometheus"
JAEGER_UID = "pdwatch-jaeger"

PROM = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
TAGS = ["pdwatch"]

# Label matchers for the dashboard variables; every pdwatch series of a
# cluster carries these labels (contract section 6). Every metric and label
# the dashboards name is the contract's object or constant.
CLUSTER = f'{c.L_CLUSTER}=~"$cluster"'
ROLE = f'{c.L_ROLE}=~"$role"'
INSTANCE = f'{c.L_INSTANCE}=~"$instance"'


def sel(*matchers: str) -> str:
    return "{" + ", ".join(matchers) + "}"


def legend(*labels: str) -> str:
    """A legend that names each series by these labels' values."""
    return " ".join(f"{{{{{label}}}}}" for label in labels)


BY_INSTANCE = sel(CLUSTER, ROLE, INSTANCE)  # series with cluster, role, pd_instance
BY_ROLE = sel(CLUSTER, ROLE)  # series without pd_instance (thresholds, stage histograms)


def variables(*, jaeger: bool = False) -> list[cogbuilder.Builder[dm.VariableModel]]:
    """Data source, cluster, role and instance; each narrows the next."""
    # Default to the provisioned data sources; Grafana picks another of the
    # same type when these uids do not exist.
    out: list[cogbuilder.Builder[dm.VariableModel]] = [
        db.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
        .current(dm.VariableOption(selected=True, text="Prometheus (pdwatch)", value=PROMETHEUS_UID)),
    ]
    if jaeger:
        out.append(
            db.DatasourceVariable("jaeger").label("Jaeger").type("jaeger")
            .current(dm.VariableOption(selected=True, text="Jaeger (pdwatch)", value=JAEGER_UID))
        )
    up = c.INSTANCE_UP.series
    for name, label, query in (
        ("cluster", "Cluster", f"label_values({up}, {c.L_CLUSTER})"),
        ("role", "Role", f"label_values({up}{sel(CLUSTER)}, {c.L_ROLE})"),
        ("instance", "Instance", f"label_values({up}{sel(CLUSTER, ROLE)}, {c.L_INSTANCE})"),
    ):
        out.append(
            db.QueryVariable(name)
            .label(label)
            .datasource(PROM)
            .query(query)
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dm.VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
            .all_value(".*")
            .current(dm.VariableOption(selected=True, text="All", value="$__all"))
        )
    return out


class PrometheusAnnotation(cogbuilder.Builder[dm.AnnotationQuery]):
    """An annotation from a Prometheus query. The 11.6 schema's AnnotationQuery
    has no title or tag fields, which Grafana's Prometheus annotations read."""

    def __init__(self, name: str, expr: str, *, title: str, tag_keys: str, color: str, step: str = "15s"):
        self._model = _PromAnnotationModel(name=name, datasource=PROM, enable=True, icon_color=color, expr=expr)
        self._model.extra = {"titleFormat": title, "tagKeys": tag_keys, "step": step, "textFormat": ""}

    def build(self) -> dm.AnnotationQuery:
        return self._model


class _PromAnnotationModel(dm.AnnotationQuery):
    extra: dict[str, str]

    def to_json(self) -> dict[str, object]:
        return {**super().to_json(), **self.extra}


class PanelBuilder(typing.Protocol):
    """What every panel type's builder offers (the SDK has no common base class for them)."""

    def id(self, id_val: int, /) -> typing.Self: ...
    def title(self, title: str, /) -> typing.Self: ...
    def description(self, description: str, /) -> typing.Self: ...
    def datasource(self, datasource: dm.DataSourceRef, /) -> typing.Self: ...
    def span(self, w: int, /) -> typing.Self: ...
    def height(self, h: int, /) -> typing.Self: ...
    def with_target(self, target: cogbuilder.Builder[cogvariants.Dataquery], /) -> typing.Self: ...


AnyPanel = typing.TypeVar("AnyPanel", bound=PanelBuilder)


class Panels:
    """Panel builders with ids, reference ids and the shared data source."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)

    def _setup(self, panel: AnyPanel, title: str, description: str, targets: list[tuple[str, str]],
               width: int, height: int, exemplars: bool = False) -> AnyPanel:
        panel.id(next(self._ids)).title(title).description(description).datasource(PROM).span(width).height(height)
        for ref, (expr, legend) in zip("ABCDEFGH", targets):
            query = prometheus.Dataquery().ref_id(ref).expr(expr).legend_format(legend).range()
            panel.with_target(query.exemplar(True) if exemplars else query)
        return panel

    def timeseries(self, title: str, description: str, targets: list[tuple[str, str]], *, unit: str,
                   width: int = 12, height: int = 8, stacked: bool = False,
                   exemplars: bool = False) -> timeseries.Panel:
        panel = self._setup(timeseries.Panel(), title, description, targets, width, height, exemplars).unit(unit)
        panel.fill_opacity(10).line_width(1).show_points(cm.VisibilityMode.NEVER)
        if stacked:
            panel.stacking(cb.StackingConfig().mode(cm.StackingMode.NORMAL))
        return panel

    def stat(self, title: str, description: str, expr: str, *, unit: str = "none", red_at: float | None = None,
             width: int = 4, height: int = 4, legend: str = "") -> stat.Panel:
        panel = self._setup(stat.Panel(), title, description, [(expr, legend)], width, height).unit(unit)
        if red_at is not None:
            panel.thresholds(
                db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps([
                    dm.Threshold(value=None, color="green"),
                    dm.Threshold(value=red_at, color="red"),
                ])
            )
        return panel

    def table(self, title: str, description: str, expr: str, *, width: int = 24, height: int = 10) -> table.Panel:
        """A table of one instant query, one row per series, labels as columns."""
        panel = table.Panel().id(next(self._ids)).title(title).description(description).datasource(PROM)
        panel.span(width).height(height)
        return panel.with_target(
            prometheus.Dataquery().ref_id("A").expr(expr).legend_format("").format(pm.PromQueryFormat.TABLE).instant()
        )

    def setup(self, panel: AnyPanel, title: str, description: str, targets: list[tuple[str, str]],
              width: int, height: int) -> AnyPanel:
        """Title, data source, size and range queries for any other panel type."""
        return self._setup(panel, title, description, targets, width, height)

    def row(self, title: str) -> db.Row:
        return db.Row(title).id(next(self._ids))


def dashboard(uid: str, title: str, description: str) -> db.Dashboard:
    return (
        db.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(TAGS)
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .editable()
        # Grafana's own annotations (alerts, manual notes), which its UI adds
        # to every dashboard; without it the annotations object has no list.
        .annotation(
            db.AnnotationQuery()
            .name("Annotations & Alerts")
            .datasource(dm.DataSourceRef(type_val="grafana", uid="-- Grafana --"))
            .built_in(1)
            .enable(True)
            .hide(True)
            .icon_color("rgba(0, 211, 255, 1)")
            .type("dashboard")
        )
    )
