"""The Kubernetes manifests agree with the code: the DaemonSet sets only real sidecar settings
(values they accept), on the contract's port and paths; the NetworkPolicy opens ingest to
engines and the metrics port to Prometheus only; engines send where the Service listens,
with the engine-side variables docs/sglang.md lists; each overlay does what it says."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import pytest
import tomllib
import yaml

from pdwatch import contract as c
from pdwatch.sidecar.settings import Settings, env_name
from tests.deploy.kube import (
    BUILDS,
    COMPONENTS,
    ENGINE_LABEL,
    KUBE,
    ROOT,
    Doc,
    container,
    env,
    find,
    kustomize_with,
    matches,
    one,
    pod_spec,
    port_number,
    quantity_bytes,
    target_port,
)

WITH_SIDECAR = ["base", "overlays/kube-prometheus-stack", "overlays/without-collector", "overlays/gpu-operator",
                "overlays/gke", "overlays/runtime-class-nvidia", "overlays/jaeger-tls"]
NAMESPACE = "pdwatch"
SERVICE = "pdwatch-node"
SECRET = {"name": "pdwatch-token", "key": "token"}


def daemonset(docs: list[Doc]) -> Doc:
    return one(docs, "DaemonSet", "pdwatch-node")


def sidecar(docs: list[Doc]) -> Doc:
    return container(daemonset(docs), "sidecar")


def ingest_ports(docs: list[Doc]) -> set[int]:
    """The pod ports behind the Service's OTLP ports: where engines' spans land."""
    service = one(docs, "Service", SERVICE)
    return {target_port(daemonset(docs), p["targetPort"]) for p in service["spec"]["ports"]
            if p["name"].startswith("otlp-")}


def collector_metrics_port(docs: list[Doc]) -> int | None:
    """Where the pod's collector serves its own metrics (kubernetes.yaml's telemetry reader); None without one."""
    if not any(ct["name"] == "otel-collector" for ct in pod_spec(daemonset(docs))["containers"]):
        return None
    config = yaml.safe_load(one(docs, "ConfigMap", "pdwatch-collector")["data"]["kubernetes.yaml"])
    (reader,) = config["service"]["telemetry"]["metrics"]["readers"]
    prometheus = reader["pull"]["exporter"]["prometheus"]
    assert prometheus["host"] == "${env:POD_IP}"  # the pod's address: loopback would be out of Prometheus' reach
    return int(prometheus["port"])


def sidecar_settings(docs: list[Doc]) -> Settings:
    """The sidecar's Settings as its environment makes them (the Secret's token stood in for)."""
    values = {}
    for name, entry in env(sidecar(docs)).items():
        if name.startswith(c.ENV_PREFIX):
            values[name] = entry.get("value", "a-token-from-the-secret")
    fields = {env_name(f): f for f in Settings.model_fields}
    assert set(values) <= set(fields), f"not sidecar settings: {set(values) - set(fields)}"
    return Settings(**{fields[name]: value for name, value in values.items()})


@pytest.mark.parametrize("build", WITH_SIDECAR)
def test_the_sidecar_sets_only_real_settings_on_the_contracts_paths(builds, build):
    docs = builds[build]
    spec = sidecar(docs)
    settings = sidecar_settings(docs)
    assert spec["args"] == ["serve"]
    assert settings.host == "0.0.0.0" and settings.port == port_number(spec, "http-metrics")
    # Only NVIDIA's runtime variables besides pdwatch's own.
    assert {n for n in env(spec) if not n.startswith(c.ENV_PREFIX)} == {"NVIDIA_VISIBLE_DEVICES",
                                                                          "NVIDIA_DRIVER_CAPABILITIES"}
    assert env(spec)[c.ENV_TOKEN]["valueFrom"]["secretKeyRef"] == SECRET
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert spec[probe]["httpGet"] == {"path": c.PATH_HEALTH, "port": "http-metrics"}, probe
    limits, requests = spec["resources"]["limits"], spec["resources"]["requests"]
    assert set(limits) == set(requests) == {"cpu", "memory"}
    # Ingest sheds load (503) before the kernel kills the pod at its memory limit.
    assert 0 < settings.max_rss_bytes < quantity_bytes(limits["memory"])


@pytest.mark.parametrize("build", WITH_SIDECAR)
def test_prometheus_scrapes_the_sidecars_metrics_path_on_each_pod(builds, build):
    docs = builds[build]
    monitor = one(docs, "ServiceMonitor")
    service = one(docs, "Service", SERVICE)
    pod_labels = daemonset(docs)["spec"]["template"]["metadata"]["labels"]
    assert matches(monitor["spec"]["selector"], service["metadata"]["labels"])
    assert service["spec"]["selector"].items() <= pod_labels.items()
    endpoint, *collector = monitor["spec"]["endpoints"]
    assert endpoint["path"] == c.PATH_METRICS
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert target_port(daemonset(docs), port["targetPort"]) == sidecar_settings(docs).port
    assert endpoint["interval"] == "15s"  # the scrape interval alerts/tests are written for
    # The node's collector is scraped too, where the pod has one: on the port its telemetry serves.
    want = collector_metrics_port(docs)
    assert len(collector) == (want is not None), collector
    for extra in collector:
        (port,) = [p for p in service["spec"]["ports"] if p["name"] == extra["port"]]
        assert target_port(daemonset(docs), port["targetPort"]) == want and extra["path"] == "/metrics"


@pytest.mark.parametrize("build", WITH_SIDECAR)
def test_engines_reach_ingest_on_the_otlp_http_port_and_their_spans_reach_the_sidecar(builds, build):
    docs = builds[build]
    service = one(docs, "Service", SERVICE)
    assert service["spec"]["internalTrafficPolicy"] == "Local"  # a node's engines, that node's sidecar
    (http,) = [p for p in service["spec"]["ports"] if p["name"] == "otlp-http"]
    assert http["port"] == c.DEFAULT_PORT
    settings = sidecar_settings(docs)
    collectors = [ct for ct in pod_spec(daemonset(docs))["containers"] if ct["name"] == "otel-collector"]
    if not collectors:  # engines straight to the sidecar; it forwards to the trace store itself
        assert ingest_ports(docs) == {settings.port}
        assert urlsplit(settings.forward_otlp_endpoint).hostname != "127.0.0.1"
        return
    node = yaml.safe_load(one(docs, "ConfigMap", "pdwatch-collector")["data"]["node.yaml"])
    receivers = {name: int(p["endpoint"].rsplit(":", 1)[1]) for name, p in node["receivers"]["otlp"]["protocols"].items()}
    assert ingest_ports(docs) == {port_number(collectors[0], f"otlp-{k}") for k in receivers} == set(receivers.values())
    # node.yaml's loopback wiring, which holds because both containers share the pod's network.
    assert urlsplit(node["exporters"]["otlphttp/pdwatch"]["endpoint"]).port == settings.port
    back = node["receivers"]["otlp/from-sidecar"]["protocols"]["http"]["endpoint"]
    assert settings.forward_otlp_endpoint == f"http://{back}"


@pytest.mark.parametrize("build", WITH_SIDECAR)
def test_network_policy_opens_ingest_to_engines_and_metrics_to_prometheus_only(builds, build):
    docs = builds[build]
    policy = one(docs, "NetworkPolicy", "pdwatch-node")["spec"]
    assert matches(policy["podSelector"], daemonset(docs)["spec"]["template"]["metadata"]["labels"])
    assert policy["policyTypes"] == ["Ingress"]
    engines, prometheus = policy["ingress"]
    assert all(p["protocol"] == "TCP" for rule in (engines, prometheus) for p in rule["ports"])
    assert {p["port"] for p in engines["ports"]} == ingest_ports(docs)
    scraped = {sidecar_settings(docs).port} | ({collector_metrics_port(docs)} - {None})
    assert {p["port"] for p in prometheus["ports"]} == scraped
    # Engines from any namespace, by their label; Prometheus from its namespace, by the operator's label.
    (peer,) = engines["from"]
    assert peer["namespaceSelector"] == {}
    assert peer["podSelector"] == {"matchLabels": dict([ENGINE_LABEL])}
    (peer,) = prometheus["from"]
    assert peer["namespaceSelector"]["matchLabels"]
    assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "prometheus"
    # A port of a pdwatch container that no rule opens serves the kubelet's probes only.
    opened = ingest_ports(docs) | scraped
    for ct in pod_spec(daemonset(docs))["containers"]:
        probed = {ct[p]["httpGet"]["port"] for p in ("livenessProbe", "readinessProbe") if p in ct}
        for port in ct["ports"]:
            assert port["containerPort"] in opened or port["name"] in probed, f"{ct['name']} {port['name']}"


def test_every_image_is_pinned_and_pdwatch_is_this_version(builds):
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for build, docs in builds.items():
        for workload in (d for d in docs if d["kind"] in ("DaemonSet", "StatefulSet", "Deployment")):
            for ct in pod_spec(workload)["containers"]:
                name, _, tag = ct["image"].rpartition(":")
                assert name and tag and tag != "latest", f"{build}: {ct['image']}"
                if name == "pdwatch":
                    assert tag == version, f"{build}: the image is built from this version's wheel"
    dockerfile = (ROOT / "deploy" / "kubernetes" / "Dockerfile").read_text()
    assert f"pdwatch:{version}" in dockerfile and f"pdwatch-{version}-py3-none-any.whl" in dockerfile


def documented_engine_env() -> set[str]:
    """The variables of docs/sglang.md's "Set the environment" table."""
    text = (ROOT / "docs" / "sglang.md").read_text()
    return set(re.findall(r"^\| `([A-Z0-9_]+)` \|", text, flags=re.M))


def test_the_sglang_example_sets_the_engine_side_environment(builds):
    docs = builds["examples/sglang-pd"]
    base = builds["base"]
    engines = [w for w in find(docs, "StatefulSet")
               if w["spec"]["template"]["metadata"]["labels"].get(ENGINE_LABEL[0]) == ENGINE_LABEL[1]]
    roles = {}
    documented = documented_engine_env()
    assert set(c.ENGINE_ENV) - {c.ENV_INVENTORY_MAX} <= documented
    for workload in engines:
        (engine,) = pod_spec(workload)["containers"]
        variables = env(engine)
        assert set(variables) <= documented, set(variables) - documented
        assert variables["PDWATCH_SGLANG"]["value"] == "1"
        # The stable name of a StatefulSet's pod: the same instance across restarts.
        assert variables[c.ENV_INSTANCE]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        endpoint = urlsplit(variables[c.ENV_OTLP_ENDPOINT]["value"])
        assert (endpoint.hostname, endpoint.port) == (f"{SERVICE}.{NAMESPACE}.svc", c.DEFAULT_PORT)
        assert variables[c.ENV_CLUSTER]["value"]
        (mode,) = [a.split("=", 1)[1] for a in engine["command"] if a.startswith("--disaggregation-mode=")]
        roles[mode] = variables[c.ENV_CLUSTER]["value"]
    assert set(roles) == {"prefill", "decode"} and len(set(roles.values())) == 1, roles
    # The namespace and Service the engines name are the base's.
    assert one(base, "Service", SERVICE)["metadata"]["namespace"] == NAMESPACE
    assert one(base, "Namespace")["metadata"]["name"] == NAMESPACE


def test_kube_prometheus_stack_overlay_labels_what_the_charts_prometheus_selects(builds):
    docs = builds["overlays/kube-prometheus-stack"]
    for kind in ("ServiceMonitor", "PrometheusRule"):
        assert one(docs, kind)["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (peer,) = one(docs, "NetworkPolicy")["spec"]["ingress"][1]["from"]
    assert peer["podSelector"]["matchLabels"]["prometheus"] == "kube-prometheus-stack-prometheus"


def test_without_collector_overlay_leaves_no_collector_behind(builds):
    docs = builds["overlays/without-collector"]
    spec = pod_spec(daemonset(docs))
    assert [ct["name"] for ct in spec["containers"]] == ["sidecar"]
    assert not spec.get("volumes") and not find(docs, "ConfigMap", "pdwatch-collector")
    assert [p["name"] for p in one(docs, "Service", SERVICE)["spec"]["ports"]] == ["otlp-http", "http-metrics"]


# ---- where the pod runs ------------------------------------------------------------------------


@pytest.mark.parametrize("build", WITH_SIDECAR)
def test_the_pod_outranks_ordinary_pods_and_tolerates_every_taint(builds, build):
    """A GPU node whose requests the engines fill, tainted as its pool is, must still admit its pdwatch pod:
    with the Service's internalTrafficPolicy Local, a node without one drops its engines' spans."""
    docs = builds[build]
    spec = pod_spec(daemonset(docs))
    priority = one(docs, "PriorityClass", spec["priorityClassName"])
    assert 0 < priority["value"] < 2_000_000_000, priority  # above ordinary pods, below the system classes
    assert not priority.get("globalDefault") and "namespace" not in priority["metadata"]
    assert {"operator": "Exists"} in spec["tolerations"], spec["tolerations"]  # no key, no effect: every taint


def test_which_nodes_is_a_choice_of_component(builds):
    """The base runs on every node; each node component narrows it as one kind of cluster labels its GPU
    nodes, and the runtime component asks for the NVIDIA runtime. Each component has an overlay that uses it."""
    def spec(build: str) -> Doc:
        return pod_spec(daemonset(builds[build]))

    for key in ("nodeSelector", "affinity", "runtimeClassName"):
        assert key not in spec("base"), key
    assert spec("overlays/gpu-operator")["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    (term,) = spec("overlays/gke")["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert term == {"matchExpressions": [{"key": "cloud.google.com/gke-accelerator", "operator": "Exists"}]}
    assert spec("overlays/runtime-class-nvidia")["runtimeClassName"] == "nvidia"
    used = {part for build in BUILDS for part in
            yaml.safe_load((KUBE / build / "kustomization.yaml").read_text()).get("components", [])}
    scheduling = [name for name in COMPONENTS if name.startswith(("nodes-", "runtime-class-"))]
    assert len(scheduling) == 3 and {f"../../components/{name}" for name in scheduling} <= used, (COMPONENTS, used)


# ---- the token engines send ---------------------------------------------------------------------

TOKEN_VAR = "SIDECAR_TOKEN"
HEADERS_VAR = "OTEL_EXPORTER_OTLP_HEADERS"


def test_engines_send_the_sidecars_token_as_kubernetes_expands_it(builds):
    """Without a collector (overlays/without-collector) nothing adds the token on the way: the example engines
    send it themselves. Their header, as Kubernetes expands $(SIDECAR_TOKEN), is one a real sidecar that
    requires that token accepts; without it, the sidecar refuses the export (401, counted as failed)."""
    from pdwatch.engine_patches.recorder import Recorder, RecorderConfig
    from tests.support.sidecar import LiveSidecar
    from tests.support.waiting import wait_for

    token = "a-token-from-the-secret"
    headers = set()
    for workload in find(builds["examples/sglang-pd"], "StatefulSet"):
        (engine,) = pod_spec(workload)["containers"]
        variables, names = env(engine), [e["name"] for e in engine["env"]]
        assert variables[TOKEN_VAR]["valueFrom"] == {"secretKeyRef": SECRET}, workload["metadata"]["name"]
        assert names.index(TOKEN_VAR) < names.index(HEADERS_VAR)  # Kubernetes expands only what came before
        headers.add(variables[HEADERS_VAR]["value"].replace(f"$({TOKEN_VAR})", token))
    assert len(headers) == 1, headers
    with LiveSidecar(Settings(token=token)) as sc:
        sent = {}
        for name, environ in (("with", {HEADERS_VAR: headers.pop()}), ("without", {})):
            rec = Recorder(RecorderConfig(role="decode", instance=f"decode-{name}", heartbeat_s=60.0, endpoint=sc.url),
                           environ=environ)
            rec.heartbeat()
            rec.flush()
            sent[name] = rec.export.failed_spans
            rec.shutdown(1)
        # The accepted one's heartbeat and its final heartbeat (shutdown), and nothing of the other's.
        assert wait_for(lambda: sc.sidecar.tracker.heartbeats_received == 2), sc.sidecar.tracker.heartbeats_received
        assert sent == {"with": 0, "without": 1}


# ---- runbook links ----------------------------------------------------------------------------------


def test_the_runbook_base_url_is_a_deploy_time_setting(builds, tmp_path):
    """components/runbook-base with a ConfigMap of one's own: every alert's runbook_url moves under that base,
    each still naming its own runbook; the ConfigMap stays out of the cluster; no regenerate step."""
    base = "https://git.acme.example/pdwatch/blob/v0.2.0/"
    docs = kustomize_with({
        "resources": ["overlays/kube-prometheus-stack"], "components": ["components/runbook-base"],
        "configMapGenerator": [{"name": "pdwatch-runbook-base", "literals": [f"url={base}"], "options": {
            "disableNameSuffixHash": True, "annotations": {"config.kubernetes.io/local-config": "true"}}}],
    }, tmp_path)

    def links(docs: list[Doc]) -> dict[str, str]:
        rule = one(docs, "PrometheusRule")
        return {r["alert"]: r["annotations"]["runbook_url"] for g in rule["spec"]["groups"] for r in g["rules"]
                if "alert" in r}

    before, after = links(builds["overlays/kube-prometheus-stack"]), links(docs)
    assert before.keys() == after.keys() and len(after) > 10
    assert all(url == f"{base}docs/runbooks/{name}.md" for name, url in after.items()), after
    assert all(url.startswith("https://pdwatch.example/") for url in before.values())  # the generated default
    assert not find(docs, "ConfigMap", "pdwatch-runbook-base")


# ---- Alertmanager ------------------------------------------------------------------------------------


def test_the_alertmanagerconfig_routes_and_inhibits_as_the_alertmanager_example_does(builds):
    """examples/alertmanager is alerts/alertmanager.example.yml (checked by amtool and a real Alertmanager in
    tests/alerts) in the operator's words: the same grouping, routes by severity, timings, inhibitions and
    receivers, with the webhook URLs from a Secret; every severity the rules use has its route."""
    (amc,) = find(builds["examples/alertmanager"], "AlertmanagerConfig")
    assert amc["metadata"]["namespace"] == "monitoring"  # the Alertmanager's own (see the manifest's comment)
    example = yaml.safe_load((ROOT / "alerts" / "alertmanager.example.yml").read_text())

    def matchers(ms: list[dict]) -> list[str]:
        return sorted(f'{m["name"]}{m.get("matchType", "=")}"{m["value"]}"' for m in ms)

    theirs, ours = example["route"], amc["spec"]["route"]
    keys = {"receiver": "receiver", "group_by": "groupBy", "group_wait": "groupWait",
            "group_interval": "groupInterval", "repeat_interval": "repeatInterval"}
    assert {k: ours.get(v) for k, v in keys.items()} == {k: theirs.get(k) for k in keys}
    for t, o in zip(theirs["routes"], ours["routes"], strict=True):
        assert matchers(o["matchers"]) == sorted(t["matchers"])
        assert {k: o.get(v) for k, v in keys.items()} == {k: t.get(k) for k in keys}
    for t, o in zip(example["inhibit_rules"], amc["spec"]["inhibitRules"], strict=True):
        assert (matchers(o["sourceMatch"]), matchers(o["targetMatch"]), o["equal"]) == \
            (sorted(t["source_matchers"]), sorted(t["target_matchers"]), t["equal"])
    assert [r["name"] for r in amc["spec"]["receivers"]] == [r["name"] for r in example["receivers"]]
    for receiver in amc["spec"]["receivers"]:
        (hook,) = receiver["webhookConfigs"]
        assert hook["sendResolved"] is True and set(hook["urlSecret"]) == {"name", "key"}
    rules = yaml.safe_load((ROOT / "alerts" / "pdwatch-alerts.yml").read_text())
    severities = {r["labels"]["severity"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    routed = {m["value"] for r in ours["routes"] for m in r["matchers"] if m["name"] == "severity"}
    assert severities <= routed, severities - routed
