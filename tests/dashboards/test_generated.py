"""The dashboards: committed JSON equals a fresh render, the panels the issue
asks for are there, and every PromQL expression is valid and names only
metrics the sidecar exposes."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from pdwatch import cli
from pdwatch import contract as c
from pdwatch.dashboards import common, render
from tests.support.metrics import exposed_series

DOCS = render.load()
FLOW, STUCK, SELF = DOCS["pd-request-flow.json"], DOCS["stuck-requests.json"], DOCS["pdwatch-self.json"]

KNOWN_METRICS = exposed_series()


def _panels(doc):
    return [p for p in doc["panels"] if p["type"] != "row"]


def _exprs(doc):
    return " ".join(expr for _, expr in render.expressions(doc))


def test_committed_json_is_what_regenerating_writes(tmp_path):
    assert render.stale() == [], "run: pdwatch dashboards generate"
    render.write(tmp_path)
    for name in render.DASHBOARDS:
        assert (tmp_path / name).read_bytes() == (render.GENERATED_DIR / name).read_bytes(), name
    # Two renders in one process are identical too (no ids from a global counter).
    assert render.render_all() == render.render_all()


def test_generate_check_command(tmp_path):
    assert cli.main(["dashboards", "generate", "--check"]) == 0
    (tmp_path / "pd-request-flow.json").write_text("{}\n")
    assert cli.main(["dashboards", "generate", "--check", "--out", str(tmp_path)]) == 1
    assert cli.main(["dashboards", "generate", "--out", str(tmp_path)]) == 0
    assert cli.main(["dashboards", "generate", "--check", "--out", str(tmp_path)]) == 0


@pytest.mark.parametrize("name", list(render.DASHBOARDS))
def test_grafana_11_schema_stable_uid_variables_and_layout(name):
    doc = DOCS[name]
    assert doc["schemaVersion"] == 41  # the Grafana 11.6 build of the SDK
    assert doc["uid"].startswith("pdwatch-") and "pdwatch" in doc["tags"]
    names = [v["name"] for v in doc["templating"]["list"]]
    assert names[:1] == ["datasource"] and names[-3:] == ["cluster", "role", "instance"]
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids)) and 0 not in ids
    for panel in doc["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert all(t["refId"] for t in panel["targets"]), panel["title"]
    assert {a["name"] for a in doc["annotations"]["list"]} >= {"Annotations & Alerts"}


def test_request_flow_has_the_panels_the_issue_lists():
    titles = {p["title"] for p in _panels(FLOW)}
    assert {
        "Legs leaving each stage", "Legs in flight per stage", "Stuck legs now",
        "Oldest stage age against its threshold", "Completions by outcome", "GPU utilization by role",
        "GPU power by role", "Request state by role", "Suspected failure family",
    } <= titles
    exprs = _exprs(FLOW)
    for metric in ("pdwatch_inflight_requests", "pdwatch_stuck_requests", "pdwatch_oldest_stage_age_seconds",
                   "pdwatch_stuck_threshold_seconds", "pdwatch_requests_finished_total",
                   "pdwatch_gpu_utilization_ratio", "pdwatch_gpu_power_watts", "pdwatch_suspected_failure"):
        assert metric in exprs, metric
    # GPU panels sit in one row beside the request state.
    row = [p for p in _panels(FLOW) if p["title"] in ("Request state by role", "GPU utilization by role",
                                                     "GPU power by role")]
    assert len({p["gridPos"]["y"] for p in row}) == 1
    restarts = [a for a in FLOW["annotations"]["list"] if a["name"] == "Instance restarts"][0]
    assert "pdwatch_instance_start_time_seconds" in restarts["expr"] and restarts["titleFormat"]
    durations = [p for p in _panels(FLOW) if "exemplars" in p["title"]][0]
    assert durations["targets"][0]["exemplar"] is True


def test_stuck_requests_links_each_trace_id_to_jaeger_and_repeats_per_instance():
    table = [p for p in _panels(STUCK) if p["type"] == "table"][0]
    assert "pdwatch_stuck_request_info" in table["targets"][0]["expr"]
    # Every label the metric carries survives the table's max by: the reason too (why the leg is stuck).
    by = re.search(r"max by \(([^)]*)\)", table["targets"][0]["expr"]).group(1)
    assert {label.strip() for label in by.split(",")} == set(c.STUCK_INFO.labels), by
    (organize,) = [t for t in table["transformations"] if t["id"] == "organize"]
    assert c.L_REASON in organize["options"]["indexByName"]
    assert table["targets"][0]["format"] == "table" and table["targets"][0]["instant"] is True
    override = [o for o in table["fieldConfig"]["overrides"] if o["matcher"]["options"] == "trace_id"][0]
    link = override["properties"][0]["value"][0]
    assert "${__value.raw}" in link["url"] and "${jaeger}" in link["url"] and link["url"].startswith("/explore?")
    assert "jaeger" in [v["name"] for v in STUCK["templating"]["list"]]
    repeated = [p for p in STUCK["panels"] if p["type"] == "row" and p.get("repeat") == "instance"]
    assert repeated and "$instance" in repeated[0]["title"]


def test_pdwatch_itself_covers_ingest_rejections_tracking_evictions_and_gpu_telemetry():
    exprs = _exprs(SELF)
    for metric in ("pdwatch_spans_received_total", "pdwatch_spans_rejected_total", "pdwatch_tracked_legs",
                   "pdwatch_legs_evicted_total", "pdwatch_gpu_telemetry_up", "pdwatch_heartbeats_received_total"):
        assert metric in exprs, metric


def test_pdwatch_itself_shows_where_pdwatch_goes_blind():
    """Contract v1.2: engine telemetry loss, plugin state, the judge's age, the sidecars Prometheus reaches."""
    exprs = _exprs(SELF)
    for metric in ("pdwatch_engine_spans_dropped_total", "pdwatch_engine_exports_failed_total",
                   "pdwatch_engine_hook_errors_total", "pdwatch_engine_info", "pdwatch_evaluation_age_seconds",
                   'up{job=~"pdwatch|pdwatch-node"}'):
        assert metric in exprs, metric
    plugin = [p for p in _panels(SELF) if p["title"] == "Engine plugin state"][0]
    assert plugin["type"] == "table" and plugin["targets"][0]["instant"] is True


def test_every_expression_names_known_metrics_and_promtool_parses_it(tmp_path):
    lines = ["groups:", "  - name: dashboards", "    rules:"]
    count = 0
    for name, doc in DOCS.items():
        for where, expr in render.expressions(doc):
            used = set(re.findall(r"\bpdwatch_[a-z_]+", expr))
            if c.SIDECAR_UP in expr:  # Prometheus's own up for the sidecars' scrape jobs (contract v1.2)
                used.add(c.SCRAPE_UP)
            assert used and used <= KNOWN_METRICS | {c.SCRAPE_UP}, (name, where, used - KNOWN_METRICS)
            concrete = render.concrete(expr)
            assert "$" not in concrete, (name, where, concrete)
            # A recording rule per expression: promtool parses the PromQL.
            lines += [f"      - record: pdwatch:dashboard:expr{count}", f"        expr: {json.dumps(concrete)}"]
            count += 1
    rule_file = tmp_path / "dashboard-exprs.yml"
    rule_file.write_text("\n".join(lines) + "\n")
    out = subprocess.run(["promtool", "check", "rules", str(rule_file)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {count} rules found" in out.stdout + out.stderr
    assert count >= 30


def test_provisioning_names_the_uids_the_dashboards_use():
    prov = Path(render.__file__).resolve().parent / "provisioning"
    sources = (prov / "datasources" / "pdwatch.yml").read_text()
    assert f"uid: {common.PROMETHEUS_UID}" in sources and "type: prometheus" in sources
    assert f"uid: {common.JAEGER_UID}" in sources and "type: jaeger" in sources
    assert f"datasourceUid: {common.JAEGER_UID}" in sources  # exemplars -> traces
    for doc in DOCS.values():
        current = {v["name"]: v["current"]["value"] for v in doc["templating"]["list"] if v["type"] == "datasource"}
        assert current["datasource"] == common.PROMETHEUS_UID
        assert current.get("jaeger", common.JAEGER_UID) == common.JAEGER_UID
    provider = (prov / "dashboards" / "pdwatch.yml").read_text()
    assert "type: file" in provider and "folderUid: pdwatch" in provider


@pytest.mark.parametrize("name", list(render.DASHBOARDS))
def test_the_sdk_reads_the_committed_json_back(name):
    # The SDK's own 11.6 models parse what it wrote; panels, queries and
    # variables survive the round trip (defaults it fills in may be added).
    from grafana_foundation_sdk.cog import plugins
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import dashboard as dm

    plugins.register_default_plugins()
    doc = DOCS[name]
    back = json.loads(json.dumps(dm.Dashboard.from_json(doc), cls=JSONEncoder))
    assert [(p["type"], p["title"]) for p in back["panels"]] == [(p["type"], p["title"]) for p in doc["panels"]]
    def panel_exprs(d):
        return [e for where, e in render.expressions(d) if where.startswith("panel ")]

    assert panel_exprs(back) == panel_exprs(doc)
    assert back["templating"] == doc["templating"]


def _panel_expr(doc, title: str) -> str:
    (panel,) = [p for p in _panels(doc) if p["title"] == title]
    (target,) = panel["targets"]
    return render.concrete(target["expr"])


def test_the_stat_panels_read_several_sidecars_as_the_rules_do(tmp_path):
    """Two sidecars scraped at once (a central pool's, or a node's sidecar restarted beside its old pod):
    the same stuck leg group counts once, and a cluster flows if any sidecar saw it flow (max by, as the
    rules read them), evaluated by promtool over those series."""
    stuck, flowing = _panel_expr(FLOW, "Stuck legs now"), _panel_expr(FLOW, "Others flowing")
    group = 'pd_cluster="pd-a",role="decode",stage="transfer",pd_instance="decode-0"'
    other = 'pd_cluster="pd-a",role="prefill",stage="transfer",pd_instance="prefill-0"'
    series = [
        (f'{c.STUCK.name}{{{group},{c.L_TARGET}="sidecar-a:4319"}}', "2x3"),
        (f'{c.STUCK.name}{{{group},{c.L_TARGET}="sidecar-b:4319"}}', "2x3"),
        (f'{c.STUCK.name}{{{other},{c.L_TARGET}="sidecar-a:4319"}}', "1x3"),
        (f'{c.CLUSTER_FLOWING.name}{{pd_cluster="pd-a",{c.L_TARGET}="sidecar-a:4319"}}', "0x3"),
        (f'{c.CLUSTER_FLOWING.name}{{pd_cluster="pd-a",{c.L_TARGET}="sidecar-b:4319"}}', "1x3"),
    ]
    test = {
        "rule_files": [str(tmp_path / "none.yml")], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": [{"series": s, "values": v} for s, v in series],
                   "promql_expr_test": [
                       {"expr": stuck, "eval_time": "1m", "exp_samples": [{"labels": "{}", "value": 3}]},
                       {"expr": flowing, "eval_time": "1m", "exp_samples": [{"labels": "{}", "value": 1}]},
                   ]}],
    }
    (tmp_path / "none.yml").write_text("groups: []\n")
    (tmp_path / "panels.test.yml").write_text(json.dumps(test))
    out = subprocess.run(["promtool", "test", "rules", str(tmp_path / "panels.test.yml")], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_pdwatch_itself_says_which_sidecar_is_sick():
    """Every panel about the sidecars themselves keeps the scrape target apart: a sum over all of them would
    hide the one that stopped ingesting, rejects everything or lost NVML."""
    per_sidecar = {"Spans and heartbeats received", "Spans rejected by reason", "Tracked legs and instances",
                   "Legs evicted by reason", "GPU telemetry up", "Judge evaluation age", "Sidecars up"}
    panels = {p["title"]: p for p in _panels(SELF)}
    assert per_sidecar <= panels.keys(), per_sidecar - panels.keys()
    for title in per_sidecar:
        for target in panels[title]["targets"]:
            by = re.match(r"\w+ by \(([^)]*)\)", target["expr"])
            assert by and c.L_TARGET in [label.strip() for label in by.group(1).split(",")], (title, target["expr"])
            assert "{{" + c.L_TARGET + "}}" in target["legendFormat"], (title, target["legendFormat"])
