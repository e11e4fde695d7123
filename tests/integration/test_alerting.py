"""End to end on the real servers: testbed engines over NIXL -> a `pdwatch serve`
process -> Debian's Prometheus with alerts/pdwatch-alerts.yml -> Alertmanager
with alerts/alertmanager.example.yml -> a webhook receiver.

Three clusters run at once against one sidecar: the incident (decode-restart),
healthy traffic, and long generations. Only the incident may page.
"""

from __future__ import annotations

import re
import time

import pytest
import yaml

from pdwatch.testbed.monitoring import RULES, Monitoring
from pdwatch.testbed.sidecar_process import SidecarProcess

pytestmark = pytest.mark.integration

HEARTBEAT_S = 0.5
FLOOR_TRANSFER_S = 4.0
FLOOR_DECODE_S = 3.0
HEADLINE = "PDRequestStuckWhileOthersFlow"


def metric_names(expr: str) -> set[str]:
    return {m for m in re.findall(r"\b(pdwatch_[a-z_]+)", expr)}


@pytest.fixture(scope="module")
def incident():
    from pdwatch.testbed.gpu_emulation import GpuEmulator
    from pdwatch.testbed.stack import Stack

    # Emulated GPUs behind the NVML stub, so the GPU panels and rules have data too.
    gpus = GpuEmulator.for_demo(count=12)
    env = {"PDWATCH_FLOOR_TRANSFER_S": str(FLOOR_TRANSFER_S), "PDWATCH_FLOOR_DECODE_S": str(FLOOR_DECODE_S),
           "PDWATCH_LOG_LEVEL": "warning", "PDWATCH_EVALUATE_INTERVAL_S": "0.25", **gpus.env()}
    stacks = []
    with SidecarProcess(env=env) as sc, Monitoring([sc.url]) as mon:
        try:
            # Distinct seeds: the routers' rooms, hence trace ids, must not repeat across clusters.
            for seed, (cluster, scenario) in enumerate((("incident", "decode-restart"), ("healthy", "healthy"),
                                                        ("long", "long-decode")), start=1):
                stack = Stack(scenario, otlp_endpoint=sc.url, heartbeat_s=HEARTBEAT_S, rate=2.0, restart_at=4.0,
                              cluster=cluster, decode_floor_s=FLOOR_DECODE_S, duration_s=240.0, seed=seed,
                              gpus=gpus)
                stack.start()
                stacks.append(stack)
            fault_at = None
            deadline = time.monotonic() + 200
            while time.monotonic() < deadline and not mon.webhook.alerts(HEADLINE):
                for event in stacks[0].poll_events():
                    if event.get("event") == "restart" and fault_at is None:
                        fault_at = time.time()
                time.sleep(1)
            # Keep watching a little longer: nothing else may page meanwhile.
            time.sleep(5)
            yield {"sidecar": sc, "monitoring": mon, "fault_at": fault_at, "truth": stacks[0].truth()}
        finally:
            for stack in stacks:
                stack.stop()


def test_the_incident_pages_with_labels_and_annotations(incident):
    mon = incident["monitoring"]
    pages = mon.webhook.alerts(HEADLINE)
    assert pages, f"no {HEADLINE} reached the webhook; firing: {[a['labels'] for a in mon.firing()]}"
    t, path, alert = pages[0]
    labels, notes = alert["labels"], alert["annotations"]
    assert path == "/pdwatch/page"  # critical routes to the pager receiver
    assert labels["pd_cluster"] == "incident" and labels["stage"] == "transfer" and labels["severity"] == "critical"
    assert labels["pd_instance"] in ("prefill-0", "decode-0")
    assert notes["summary"] and notes["runbook_url"].endswith(f"runbooks/{HEADLINE}.md")
    assert "transfer" in notes["description"] and re.search(r"\d", notes["description"])
    assert incident["fault_at"] is not None
    # Fault to page within floor + the rule's `for` + two scrape intervals (+ Alertmanager's group wait, eval).
    rule = next(r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if r.get("alert") == HEADLINE)
    for_s = float(rule["for"].rstrip("ms")) * (60 if rule["for"].endswith("m") else 1)
    scrape, evaluation, group_wait = mon.scrape_s, mon.eval_s, mon.group_wait_s
    budget = FLOOR_TRANSFER_S + for_s + 2 * scrape + evaluation + group_wait + 2 * HEARTBEAT_S
    assert t - incident["fault_at"] <= budget, (t - incident["fault_at"], budget)


def test_healthy_and_long_generations_deliver_nothing(incident):
    mon = incident["monitoring"]
    for _t, _path, alert in mon.webhook.alerts():
        assert alert["labels"].get("pd_cluster") in ("incident", None), alert["labels"]
    assert not [a for a in mon.firing() if a["labels"].get("pd_cluster") in ("healthy", "long")]


def test_every_rule_and_dashboard_expression_runs_and_its_metrics_exist(incident):
    from pdwatch.dashboards import render

    mon, sc = incident["monitoring"], incident["sidecar"]
    exposition = sc.client.get("/metrics").text
    exprs = [(f"rule {r.get('alert') or r.get('record')}", r["expr"])
             for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    for name, doc in render.load().items():
        # Annotations span the dashboard's time range; here, the whole run.
        exprs += [(f"{name}: {where}", render.concrete(e).replace("[1m]", "[10m]") if where.startswith("annotation")
                   else render.concrete(e)) for where, e in render.expressions(doc)]
    assert len(exprs) > 20
    empty = []
    for where, expr in exprs:
        result = mon.query(expr)  # raises on a PromQL error
        if not result:
            empty.append(where)
        for metric in metric_names(expr):
            base = re.sub(r"_(bucket|sum|count)$", "", metric) if metric.startswith("pdwatch_stage_duration") else metric
            assert f"\n{base}" in exposition or f"# TYPE {base}" in exposition, f"{where}: {metric} not exposed"
            assert mon.query(f'count({{__name__=~"{metric}"}})'), f"{where}: no series of {metric} in Prometheus"
    # Dashboard views must all show something after the incident; rule
    # expressions are filters, empty when their alert does not fire.
    dashboard_empty = [w for w in empty if not w.startswith("rule ")]
    assert not dashboard_empty, dashboard_empty
    fired = set(mon.alert_names()["firing"])
    assert HEADLINE in fired and f"rule {HEADLINE}" not in empty
