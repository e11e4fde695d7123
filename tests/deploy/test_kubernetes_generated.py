"""The manifests that restate the repository stay equal to it: the PrometheusRule to the alert
table (and promtool accepts its rules and passes alerts/tests on them), the dashboard
ConfigMaps to dashboards/generated, the collector's config to deploy/otel-collector/node.yaml."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import yaml

from pdwatch.alerts import generate as alert_rules
from tests.deploy.kube import KUBE, ROOT, container, env, find, one, pod_spec, port_number

GENERATOR = KUBE / "generate.py"
ALERT_TESTS = sorted((ROOT / "alerts" / "tests").glob("*.test.yml"))
DASHBOARDS = sorted((ROOT / "dashboards" / "generated").glob("*.json"))


def needs_promtool() -> None:
    if shutil.which("promtool") is None:
        pytest.fail("promtool is missing: `make test` installs it (mk/debian.mk)")


def test_generated_manifests_are_current():
    out = subprocess.run([sys.executable, str(GENERATOR), "--check"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr


def test_the_prometheus_rule_is_the_alert_table_in_every_build(builds):
    table = yaml.safe_load(alert_rules.render())
    assert table == yaml.safe_load((ROOT / "alerts" / "pdwatch-alerts.yml").read_text())
    for build, docs in builds.items():
        for rule in find(docs, "PrometheusRule"):
            assert rule["spec"] == table, build
    assert find(builds["base"], "PrometheusRule")


@pytest.fixture(scope="module")
def extracted_rules(builds, tmp_path_factory):
    """The base PrometheusRule's spec as a plain Prometheus rule file."""
    path = tmp_path_factory.mktemp("rules") / "pdwatch-alerts.yml"
    path.write_text(yaml.safe_dump(one(builds["base"], "PrometheusRule")["spec"], sort_keys=False))
    return path


def test_promtool_accepts_the_prometheus_rules_rules(extracted_rules):
    needs_promtool()
    out = subprocess.run(["promtool", "check", "rules", str(extracted_rules)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alert_rules.alerts())} rules found" in out.stdout + out.stderr


@pytest.mark.parametrize("test_file", ALERT_TESTS, ids=lambda p: p.name)
def test_the_alert_unit_tests_pass_on_the_prometheus_rules_rules(test_file, extracted_rules, tmp_path):
    needs_promtool()
    spec = yaml.safe_load(test_file.read_text())
    spec["rule_files"] = [str(extracted_rules)]
    local = tmp_path / test_file.name
    local.write_text(yaml.safe_dump(spec, sort_keys=False))
    out = subprocess.run(["promtool", "test", "rules", local.name], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr


def test_each_dashboard_is_a_config_map_for_grafanas_sidecar(builds):
    maps = [m for m in find(builds["base"], "ConfigMap") if "grafana_dashboard" in m["metadata"].get("labels", {})]
    assert DASHBOARDS
    by_file = {key: (m, text) for m in maps for key, text in m["data"].items()}
    assert set(by_file) == {p.name for p in DASHBOARDS}
    for path in DASHBOARDS:
        config_map, text = by_file[path.name]
        assert text == path.read_text(), f"{path.name} differs: run deploy/kubernetes/generate.py"
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert len(config_map["data"]) == 1
        # kubectl apply (client side) keeps the whole object in an annotation of 256 KiB at most.
        assert len(text.encode()) < 200 * 1024


def test_the_collector_runs_node_yaml_unchanged_with_the_kubernetes_additions(builds):
    base = builds["base"]
    config = one(base, "ConfigMap", "pdwatch-collector")
    assert config["data"]["node.yaml"] == (ROOT / "deploy" / "otel-collector" / "node.yaml").read_text()
    additions = yaml.safe_load(config["data"]["kubernetes.yaml"])
    node = yaml.safe_load(config["data"]["node.yaml"])
    # What is merged over node.yaml only adds: no key it sets has a value in node.yaml.
    def leaves(tree, prefix=()):
        for key, value in tree.items():
            yield from leaves(value, (*prefix, key)) if isinstance(value, dict) else [(*prefix, key)]
    for path in leaves(additions):
        at = node
        for key in path[:-1]:
            at = at.get(key, {}) if isinstance(at, dict) else {}
        assert path[-1] not in at, f"kubernetes.yaml overrides node.yaml at {'.'.join(path)}"
    daemonset = one(base, "DaemonSet", "pdwatch-node")
    collector = container(daemonset, "otel-collector")
    mount = next(m for m in collector["volumeMounts"] if m["name"] == "collector-config")
    (volume,) = [v for v in pod_spec(daemonset)["volumes"] if v["name"] == "collector-config"]
    assert volume["configMap"]["name"] == config["metadata"]["name"]
    assert collector["args"] == [f"--config={mount['mountPath']}/{key}" for key in ("node.yaml", "kubernetes.yaml")]
    # The token header is filled from the container's environment, which the Secret fills.
    assert additions["exporters"]["otlphttp/pdwatch"]["headers"]["Authorization"] == "Bearer ${env:PDWATCH_TOKEN}"
    assert "secretKeyRef" in env(collector)["PDWATCH_TOKEN"]["valueFrom"]
    # The kubelet probes the health_check extension where it listens.
    health = int(additions["extensions"]["health_check"]["endpoint"].rsplit(":", 1)[1])
    assert port_number(collector, "health") == health
    assert {collector["livenessProbe"]["httpGet"]["port"], collector["readinessProbe"]["httpGet"]["port"]} == {"health"}
    assert additions["service"]["extensions"] == ["health_check", "bearertokenauth/engines"]
    # Engines' OTLP is taken only with the same token; the sidecar's pd.stuck spans, from inside the pod
    # on loopback, need none.
    auth = additions["extensions"]["bearertokenauth/engines"]
    assert (auth["scheme"], auth["token"]) == ("Bearer", "${env:PDWATCH_TOKEN}")
    receivers = additions["receivers"]
    assert {p: v["auth"]["authenticator"] for p, v in receivers["otlp"]["protocols"].items()} == \
        dict.fromkeys(node["receivers"]["otlp"]["protocols"], "bearertokenauth/engines")
    assert "otlp/from-sidecar" not in receivers


def test_the_jaeger_component_sends_over_tls_with_its_ca_and_header_and_changes_nothing_else(builds):
    """components/jaeger-tls: a third collector config, merged last, replaces only the Jaeger exporter's
    endpoint (from the container's environment), TLS (the CA from a Secret, mounted where the config reads
    it) and headers; both pipelines that reach Jaeger still go through that exporter."""
    docs = builds["overlays/jaeger-tls"]
    config = one(docs, "ConfigMap", "pdwatch-collector")
    base_config = one(builds["base"], "ConfigMap", "pdwatch-collector")
    assert {k: v for k, v in config["data"].items() if k != "jaeger.yaml"} == base_config["data"]
    jaeger = yaml.safe_load(config["data"]["jaeger.yaml"])
    assert list(jaeger) == ["exporters"] and list(jaeger["exporters"]) == ["otlp/jaeger"]
    exporter = jaeger["exporters"]["otlp/jaeger"]
    assert exporter["endpoint"] == "${env:JAEGER_OTLP_ENDPOINT}"
    assert exporter["tls"]["insecure"] is False
    assert exporter["headers"] == {"authorization": "${env:JAEGER_AUTHORIZATION}"}
    daemonset = one(docs, "DaemonSet", "pdwatch-node")
    collector = container(daemonset, "otel-collector")
    mount = next(m for m in collector["volumeMounts"] if m["name"] == "collector-config")["mountPath"]
    assert collector["args"] == [f"--config={mount}/{key}" for key in ("node.yaml", "kubernetes.yaml", "jaeger.yaml")]
    ca_mount = next(m for m in collector["volumeMounts"] if m["name"] == "jaeger-tls")
    (volume,) = [v for v in pod_spec(daemonset)["volumes"] if v["name"] == "jaeger-tls"]
    (item,) = volume["secret"]["items"]
    assert exporter["tls"]["ca_file"] == f"{ca_mount['mountPath']}/{item['path']}" and ca_mount["readOnly"]
    variables = env(collector)
    assert variables["JAEGER_OTLP_ENDPOINT"]["value"].endswith(":4317")
    auth = variables["JAEGER_AUTHORIZATION"]["valueFrom"]["secretKeyRef"]
    assert auth["name"] == volume["secret"]["secretName"] and auth["optional"] is True
    node = yaml.safe_load(config["data"]["node.yaml"])
    to_jaeger = [p for p in node["service"]["pipelines"].values() if "otlp/jaeger" in p["exporters"]]
    assert len(to_jaeger) == 2
