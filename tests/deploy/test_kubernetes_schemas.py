"""Every manifest kustomize renders from deploy/kubernetes (base, overlays, examples) passes
check-jsonschema against the vendored schema of its kind: Kubernetes v1.31.6 strict, the
Prometheus Operator v0.93.0 CRDs. No cluster: the schemas are files in the repository."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.kube import (
    BUILDS,
    KUBERNETES_VERSION,
    OPERATOR_VERSION,
    ROOT,
    Doc,
    container,
    one,
    schema_files,
    schema_name,
)


def check_jsonschema(schema: Path, instances: list[Path]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--schemafile", str(schema),
                           *map(str, instances)], capture_output=True, text=True, timeout=120)


def write(docs: list[tuple[str, Doc]], out: Path) -> list[Path]:
    """One JSON file per manifest, named build--kind--name so a failure says which."""
    paths = []
    for build, doc in docs:
        path = out / f"{build.replace('/', '.')}--{doc['kind']}--{doc['metadata']['name']}.json"
        path.write_text(json.dumps(doc))
        paths.append(path)
    return paths


def test_every_build_renders_and_every_kind_has_a_vendored_schema(builds):
    assert {"base", "overlays/kube-prometheus-stack", "overlays/without-collector", "examples/sglang-pd"} <= set(BUILDS)
    vendored = {p.name for p in schema_files()}
    used = {schema_name(doc) for docs in builds.values() for doc in docs}
    assert used - vendored == set(), "a kind with no schema would go unchecked"
    assert vendored - used == set(), "vendor only the kinds the manifests use"


@pytest.mark.parametrize("schema", schema_files(), ids=lambda p: p.stem)
def test_manifests_pass_check_jsonschema(schema, builds, tmp_path):
    docs = [(build, doc) for build, docs in builds.items() for doc in docs if schema_name(doc) == schema.name]
    assert docs
    out = check_jsonschema(schema, write(docs, tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "validation done" in out.stdout


def test_the_schemas_catch_a_misspelt_field_and_a_bad_rule_duration(builds, tmp_path):
    # Proof that the check has teeth: strict schemas refuse what the API server would drop.
    base = builds["base"]
    daemonset = copy.deepcopy(one(base, "DaemonSet"))
    container(daemonset, "sidecar")["livenessprobe"] = container(daemonset, "sidecar").pop("livenessProbe")
    rule = copy.deepcopy(one(base, "PrometheusRule"))
    rule["spec"]["groups"][0]["rules"][0]["for"] = "one minute"
    for doc, field in ((daemonset, "livenessprobe"), (rule, "one minute")):
        (path,) = write([("broken", doc)], tmp_path)
        schema = next(p for p in schema_files() if p.name == schema_name(doc))
        out = check_jsonschema(schema, [path])
        assert out.returncode == 1 and field in out.stdout + out.stderr, out.stdout + out.stderr


def test_the_docs_name_the_versions_the_schemas_are_for():
    text = (ROOT / "docs" / "deployment.md").read_text()
    assert f"Kubernetes {KUBERNETES_VERSION}" in text and f"Prometheus Operator {OPERATOR_VERSION}" in text
