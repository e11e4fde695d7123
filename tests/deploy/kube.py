"""Reading deploy/kubernetes: each kustomization built by kustomize (kubectl's own), the
vendored schema of each manifest, and small lookups the tests share."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
# The versions docs/deployment.md names; schemas/README.md says where each came from.
KUBERNETES_VERSION = "v1.31.6"
OPERATOR_VERSION = "v0.93.0"
SCHEMA_DIRS = (KUBE / "schemas" / f"kubernetes-{KUBERNETES_VERSION}",
               KUBE / "schemas" / f"prometheus-operator-{OPERATOR_VERSION}")
# Every kustomization: the base, each overlay, each example (components/ hold kustomize Components,
# built only inside a kustomization that names them: each has an overlay of its own).
BUILDS = sorted(str(p.parent.relative_to(KUBE)) for p in KUBE.glob("**/kustomization.yaml")
                if p.parent.relative_to(KUBE).parts[0] != "components")
COMPONENTS = sorted(p.parent.name for p in (KUBE / "components").glob("*/kustomization.yaml"))

# The label engine pods carry so that the NetworkPolicy lets them send OTLP.
ENGINE_LABEL = ("pdwatch-engine", "true")

Doc = dict[str, Any]


class Loader(yaml.SafeLoader):
    """YAML 1.2 reads a plain `=` (an AlertmanagerConfig matcher's matchType, as kustomize prints it) as the
    string it is; PyYAML's 1.1 resolver takes it for the `value` tag and cannot build it."""


Loader.add_constructor("tag:yaml.org,2002:value", lambda loader, node: loader.construct_scalar(node))


def load_all(text: str) -> list[Doc]:
    return [doc for doc in yaml.load_all(text, Loader=Loader) if doc]


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    return found


def kustomize(build: str) -> list[Doc]:
    """The manifests `kubectl kustomize` renders for one kustomization under deploy/kubernetes."""
    out = subprocess.run([kubectl(), "kustomize", str(KUBE / build)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kustomize {build}: {out.stderr}"
    return load_all(out.stdout)


def kustomize_with(kustomization: dict[str, Any], folder: Path) -> list[Doc]:
    """The manifests of a kustomization of one's own, written in `folder`: "resources" and "components"
    name paths under deploy/kubernetes (made relative, as kustomize requires)."""
    up = Path(os.path.relpath(KUBE, folder))
    doc = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", **kustomization}
    for key in ("resources", "components"):
        doc[key] = [str(up / p) for p in kustomization.get(key, [])]
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(doc))
    out = subprocess.run([kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kustomize {kustomization}: {out.stderr}"
    return load_all(out.stdout)


def schema_name(doc: Doc) -> str:
    """kind[-group]-version.json, the schemas' file names: apps/v1 DaemonSet -> daemonset-apps-v1.json."""
    group, _, version = doc["apiVersion"].rpartition("/")
    parts = [doc["kind"].lower(), group.split(".")[0], version] if group else [doc["kind"].lower(), version]
    return "-".join(parts) + ".json"


def schema_files() -> list[Path]:
    return sorted(p for d in SCHEMA_DIRS for p in d.glob("*.json"))


def find(docs: list[Doc], kind: str, name: str | None = None) -> list[Doc]:
    """Manifests of a kind (and a name, or a generated name that starts with it plus a hash)."""
    def named(doc: Doc) -> bool:
        real = doc["metadata"]["name"]
        return name is None or real == name or real.rpartition("-")[0] == name
    return [doc for doc in docs if doc["kind"] == kind and named(doc)]


def one(docs: list[Doc], kind: str, name: str | None = None) -> Doc:
    (doc,) = find(docs, kind, name)
    return doc


def pod_spec(workload: Doc) -> Doc:
    return workload["spec"]["template"]["spec"]


def container(workload: Doc, name: str) -> Doc:
    (found,) = [c for c in pod_spec(workload)["containers"] if c["name"] == name]
    return found


def env(container_spec: Doc) -> dict[str, Doc]:
    """Variable name -> its entry (with `value` or `valueFrom`)."""
    return {e["name"]: e for e in container_spec.get("env", [])}


def port_number(container_spec: Doc, name: str) -> int:
    (number,) = [p["containerPort"] for p in container_spec.get("ports", []) if p["name"] == name]
    return number


def target_port(workload: Doc, target: int | str) -> int:
    """A Service's targetPort (a number, or a container port's name) as the pod's port number."""
    if isinstance(target, int):
        return target
    (number,) = [p["containerPort"] for c in pod_spec(workload)["containers"] for p in c.get("ports", [])
                 if p["name"] == target]
    return number


def quantity_bytes(quantity: str) -> int:
    """A memory quantity in binary units (512Mi, 1Gi) or plain bytes."""
    for suffix, factor in (("Ki", 1 << 10), ("Mi", 1 << 20), ("Gi", 1 << 30)):
        if quantity.endswith(suffix):
            return int(quantity[: -len(suffix)]) * factor
    return int(quantity)


def matches(selector: Doc, labels: dict[str, str]) -> bool:
    """Whether a label selector with matchLabels only (all these manifests use) selects `labels`."""
    assert set(selector) <= {"matchLabels"}, f"selector beyond matchLabels: {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
