"""Every name is written once, in `pdwatch.contract`: the product code spells no `pdwatch_` metric,
`PDWATCH_` variable, contract attribute or span name, or alert name of its own, and what a sidecar
exposes is exactly the contract's metric families.

Tests are not scanned: they may spell names literally, as an independent check of the contract.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pdwatch import contract as c

ROOT = Path(__file__).resolve().parent.parent
# Product code beside the contract: the layers, the benches and deploy/'s generator. pdwatch/ holds
# the CLI; its other entries are links to the layer folders, scanned once under their own names.
SCANNED = ("engine_patches", "sidecar", "alerts", "dashboards", "testbed", "pdwatch", "bench", "deploy")
LAYERS = {"contract", "engine_patches", "sidecar", "alerts", "dashboards", "testbed"}

# Files another part of issue 31 is rewriting right now; each is scanned again once it lands.
PENDING: dict[str, str] = {}  # files being rewritten elsewhere, scanned once they land
# `pdwatch_` words that are not metrics.
NOT_METRICS = {
    "pdwatch_traceparent": "the attribute the SGLang plugin sets on a request's time stats",
    "pdwatch_testbed_cpu": "the testbed's CPU plugin for SGLang, by its module name",
    "pdwatch_lease_expires_unix": "the key the vLLM adapter adds to a prefill's kv_transfer_params",
}

METRIC = re.compile(r"(?<![\w.])pdwatch_[a-z0-9_]*")
VARIABLE = re.compile(r"(?<![A-Za-z0-9_])PDWATCH_[A-Z0-9_]*")
# Attribute and span names, and the prefixes names are built from (pd.open.count.<stage>, pd.<stage>).
ATTRIBUTES = {value for name, value in vars(c).items()
              if name.startswith(("R_", "A_", "H_", "SPAN_", "STAGE_SPAN_")) and isinstance(value, str)}
ATTRIBUTES |= set(c.STAGE_SPAN_NAMES)


def product_files() -> list[Path]:
    files = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if folder == "pdwatch" and len(rel.parts) > 2 and rel.parts[1] in LAYERS:
                continue
            if rel.as_posix() not in PENDING:
                files.append(path)
    return files


def docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes: prose about a name, not a use of it."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def strings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string constant, f-string parts included, docstrings left out."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = docstrings(tree)
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip]


def spelt_names(path: Path) -> list[str]:
    found, where = [], path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    for line, text in strings(path):
        words = [w for w in METRIC.findall(text) if w not in NOT_METRICS] + VARIABLE.findall(text)
        if text in ATTRIBUTES or text in c.ALERT_NAMES:
            words.append(text)
        found += [f"{where}:{line}: {word!r} in {text!r}" for word in words]
    return found


def test_the_check_catches_what_it_is_for(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('"""pdwatch_docs_may_name_it and PDWATCH_TOO."""\n'
                      'X = f"sum(pdwatch_{kind}_total)"\nY = "PDWATCH_TOKEN"\nZ = "pd.open.count."\n'
                      'W = "PDTotalWedge"\nV = "pdwatch_traceparent"\nU = "_pdwatch_private"\n')
    found = {hit.split(": ", 1)[1] for hit in spelt_names(sample)}
    assert found == {"'pdwatch_' in 'sum(pdwatch_'", "'PDWATCH_TOKEN' in 'PDWATCH_TOKEN'",
                     "'pd.open.count.' in 'pd.open.count.'", "'PDTotalWedge' in 'PDTotalWedge'"}


def test_no_product_code_spells_a_name_the_contract_owns():
    files = product_files()
    assert any(p.name == "generate.py" for p in files) and any(p.name == "recorder.py" for p in files)
    spelt = [hit for path in files for hit in spelt_names(path)]
    assert not spelt, "use the contract's object or constant:\n" + "\n".join(spelt)


def test_pending_files_still_exist():
    """An entry for a file that moved or went away is stale: take it out so the new code is scanned."""
    assert all((ROOT / rel).is_file() for rel in PENDING), [rel for rel in PENDING if not (ROOT / rel).is_file()]


def test_every_metric_is_named_once_and_is_well_formed():
    names = [m.name for m in c.METRICS]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert c.METRICS == (*c.REQUIRED_METRICS, *c.ADDED_METRICS)
    for m in c.METRICS:
        assert m.help.strip() and m.help.endswith("."), m.name
        assert len(set(m.labels)) == len(m.labels), m.name
    with pytest.raises(ValueError):
        c.Metric("pdwatch_x_total", "counter", (), "A counter named with its suffix.")
    with pytest.raises(ValueError):
        c.Metric("other_x", "gauge", (), "Not pdwatch's.")


def test_a_query_grouping_by_a_label_the_metric_lacks_fails_where_it_is_written():
    assert c.STUCK.by(c.L_CLUSTER, c.L_INSTANCE) == "pd_cluster, pd_instance"
    assert c.STAGE_DURATION.by(c.L_LE, c.L_ROLE) == "le, role"
    assert c.SPANS_RECEIVED.by(c.L_JOB, c.L_TARGET) == "job, instance"
    with pytest.raises(ValueError, match="pd_instanse"):
        c.STUCK.by(c.L_CLUSTER, "pd_instanse")
    with pytest.raises(ValueError):
        c.THRESHOLD.by(c.L_INSTANCE)  # thresholds are per cluster, role and stage
    with pytest.raises(ValueError):
        c.STUCK.by(c.L_LE)  # only a histogram has buckets
    assert c.STAGE_DURATION.sample("bucket") == "pdwatch_stage_duration_seconds_bucket"
    with pytest.raises(ValueError):
        c.STUCK.sample("count")


def test_a_sidecar_exposes_exactly_the_contract_metric_families():
    from pdwatch.sidecar import families
    from pdwatch.sidecar.gpu.collector import GpuCollector
    from pdwatch.sidecar.service import Sidecar
    from pdwatch.sidecar.settings import Settings

    sc = Sidecar(Settings(nvml="off", forward_otlp_endpoint="http://127.0.0.1:9"))
    exposed = {f.name: f for f in sc.registry.collect()}
    exposed.update({f.name: f for f in GpuCollector._families()})  # built as if telemetry were up
    assert set(exposed) == {m.name for m in c.METRICS}
    for m in c.METRICS:
        assert (exposed[m.name].type, exposed[m.name].documentation) == (m.type, m.help), m.name
    with pytest.raises(ValueError):
        families.gauge(c.FINISHED)  # a counter
    with pytest.raises(ValueError):
        families.counter(c.FINISHED, 1)  # labelled: samples, not one value


def test_the_sidecar_settings_are_the_contract_variables():
    from pdwatch.sidecar.settings import Settings, env_name

    assert {env_name(field) for field in Settings.model_fields} == {*c.SIDECAR_ENV, *c.SIDECAR_OWN_ENV}


def test_the_sidecar_page_names_every_added_metric():
    text = (ROOT / "docs" / "sidecar.md").read_text()
    globs = [g.rstrip("*") for g in re.findall(r"`(pdwatch_[a-z_]*\*)`", text)]
    missing = [m.series for m in c.ADDED_METRICS
               if m.name not in text and not any(m.name.startswith(g) for g in globs)]
    assert not missing, missing
