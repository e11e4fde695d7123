"""The alert rules: generated file current, promtool-valid, unit-tested, runbooks present."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from pdwatch import contract as c
from pdwatch.alerts import generate as gen
from tests.support.metrics import exposed_series

ROOT = Path(__file__).resolve().parents[2]
ALERTS_DIR = ROOT / "alerts"

RULE_FILE = ALERTS_DIR / "pdwatch-alerts.yml"
TEST_FILES = sorted((ALERTS_DIR / "tests").glob("*.test.yml"))

def test_rule_file_is_what_the_generator_writes():
    assert RULE_FILE.read_text() == gen.render(), "run: python alerts/generate.py"


def test_generator_check_mode_agrees(tmp_path):
    stale = tmp_path / "rules.yml"
    stale.write_text("groups: []\n")
    assert gen.main(["--check", "--out", str(stale)]) == 1
    assert gen.main(["--check", "--out", str(RULE_FILE)]) == 0


def test_promtool_accepts_the_rules():
    out = subprocess.run(["promtool", "check", "rules", str(RULE_FILE)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(gen.alerts())} rules found" in out.stdout + out.stderr


@pytest.mark.parametrize("test_file", TEST_FILES, ids=lambda p: p.name)
def test_promtool_unit_tests_pass(test_file):
    out = subprocess.run(["promtool", "test", "rules", test_file.name], cwd=test_file.parent,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr


def test_every_contract_alert_has_a_rule_with_severity_for_and_annotations():
    rules = gen.alerts()
    assert {r.name for r in rules} == set(gen.ALERT_NAMES)
    assert len(gen.ALERT_NAMES) == 13  # v1.2 added four
    text = RULE_FILE.read_text()
    for rule in rules:
        assert rule.severity in ("critical", "warning"), rule.name
        assert re.fullmatch(r"\d+[smh]", rule.for_), rule.name
        assert rule.summary.strip() and rule.description.strip(), rule.name
        # The description carries values, not just words.
        assert "{{" in rule.description, rule.name
        assert f'runbook_url: "{gen.runbook_url(rule.name)}"' in text


def test_runbook_urls_come_from_the_alert_name_and_every_runbook_exists():
    for name in gen.ALERT_NAMES:
        url = gen.runbook_url(name)
        assert url == f"{gen.DEFAULT_RUNBOOK_BASE}docs/runbooks/{name}.md"
        runbook = ROOT / "docs" / "runbooks" / f"{name}.md"
        assert runbook.is_file(), runbook
        body = runbook.read_text()
        assert body.startswith(f"# {name}"), runbook
        for section in ("## What it means", "## How to confirm", "## What to do"):
            assert section in body, (runbook, section)
    custom = gen.render("https://docs.test/pdwatch")
    assert '"https://docs.test/pdwatch/docs/runbooks/PDTotalWedge.md"' in custom


def _alert_tests():
    """(alertname, fires?) for every alert_rule_test item of the promtool files."""
    cases = []
    for path in TEST_FILES:
        for item in path.read_text().split("- eval_time:")[1:]:
            name = re.search(r"alertname: (\w+)", item).group(1)
            cases.append((name, "exp_alerts: []" not in item))
    return cases


def test_every_alert_is_tested_where_it_fires_and_where_it_must_not():
    cases = _alert_tests()
    for name in gen.ALERT_NAMES:
        assert (name, True) in cases, f"{name}: no case where it fires"
        assert (name, False) in cases, f"{name}: no case where it must stay quiet"


def _metric_names(text: str) -> set[str]:
    return set(re.findall(r"\bpdwatch_[a-z_]+", text))


def test_rules_use_only_metric_names_the_sidecar_exposes():
    for rule in gen.alerts():
        used = _metric_names(rule.expr) | _metric_names(rule.description)
        assert used, rule.name
        assert used <= exposed_series(), (rule.name, used - exposed_series())
        for family in re.findall(r'family="(\w+)"', rule.expr):
            assert family in c.FAMILIES


def test_the_sidecar_down_rule_names_every_job_the_deployments_scrape_sidecars_under():
    """deploy/prometheus/ names its scrape job; the ServiceMonitor of deploy/kubernetes/ sets no jobLabel, so
    the operator names the job after the Service it selects."""
    import yaml

    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"] for job in prometheus["scrape_configs"]}
    monitor = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "base" / "servicemonitor.yaml").read_text())
    service = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "base" / "service.yaml").read_text())
    assert "jobLabel" not in monitor["spec"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    jobs.add(service["metadata"]["name"])
    assert set(gen.SIDECAR_JOBS) == jobs
