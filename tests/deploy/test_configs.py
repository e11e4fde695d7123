"""The deployment examples in deploy/: Prometheus configs pass promtool (the
real validator); collector configs, for which no collector binary is at hand,
are checked for YAML syntax and for the wiring a collector would refuse or
that would break pdwatch: undefined components, span-name filters that miss
the contract's names, loops back into a sidecar, routing by trace id."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pdwatch import contract as c

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
COLLECTORS = sorted((DEPLOY / "otel-collector").glob("*.yaml"))
PROMETHEUS = sorted((DEPLOY / "prometheus").glob("*.yml"))


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def port(endpoint: str) -> int:
    return int(re.search(r":(\d+)/?$", endpoint).group(1))


@pytest.mark.parametrize("path", PROMETHEUS, ids=lambda p: p.name)
def test_promtool_accepts_the_prometheus_config_and_its_rules(path):
    if shutil.which("promtool") is None:
        pytest.fail("promtool is missing: `make test` installs it (mk/debian.mk)")
    out = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "pdwatch-alerts.yml" in out.stdout and "SUCCESS" in out.stdout


def test_the_sidecars_prometheus_scrapes_are_where_the_node_collector_sends():
    node = load(DEPLOY / "otel-collector" / "node.yaml")
    sidecar_port = port(node["exporters"]["otlphttp/pdwatch"]["endpoint"])
    prom = load(DEPLOY / "prometheus" / "prometheus.yml")
    (job,) = [j for j in prom["scrape_configs"] if j["job_name"] == "pdwatch"]
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert len(targets) > 1 and all(port(t) == sidecar_port for t in targets)


@pytest.mark.parametrize("path", COLLECTORS, ids=lambda p: p.name)
def test_collector_pipelines_use_only_defined_components(path):
    cfg = load(path)
    pipelines = cfg["service"]["pipelines"]
    assert pipelines
    for name, pipe in pipelines.items():
        assert name.split("/")[0] == "traces"
        for kind in ("receivers", "processors", "exporters"):
            for comp in pipe.get(kind, []):
                assert comp in cfg[kind], f"{path.name}: pipeline {name} uses undefined {kind[:-1]} {comp}"
        assert pipe["receivers"] and pipe["exporters"]
        procs = pipe.get("processors", [])
        if "memory_limiter" in procs:  # the collector's documented order: memory_limiter first
            assert procs[0] == "memory_limiter"


@pytest.mark.parametrize("path", COLLECTORS, ids=lambda p: p.name)
def test_span_filters_name_contract_spans(path):
    cfg = load(path)
    names = {c.SPAN_HEARTBEAT, c.SPAN_STUCK}
    for key, proc in cfg["processors"].items():
        if not key.startswith("filter/"):
            continue
        for cond in proc["traces"]["span"]:
            m = re.fullmatch(r'name (==|!=) "([^"]+)"', cond)
            assert m and m.group(2) in names, f"{path.name} {key}: {cond}"


@pytest.mark.parametrize("name", ["node.yaml", "pool-member.yaml"])
def test_spans_from_the_sidecar_reach_jaeger_only_and_never_loop(name):
    cfg = load(DEPLOY / "otel-collector" / name)
    (back,) = [r for r in cfg["receivers"] if r.endswith("from-sidecar")]
    into_sidecar = [e for e in cfg["exporters"] if "pdwatch" in e]
    for pname, pipe in cfg["service"]["pipelines"].items():
        if back in pipe["receivers"]:
            assert not set(pipe["exporters"]) & set(into_sidecar), f"{pname} sends the sidecar's spans back to it"
            assert pipe["exporters"] == ["otlp/jaeger"] and "filter/stuck-only" in pipe["processors"]
    # The receiver listens on loopback: only the sidecar on the same host reaches it.
    assert cfg["receivers"][back]["protocols"]["http"]["endpoint"].startswith("127.0.0.1:")
    # The sidecar must not listen where the collector does.
    sidecar_port = port(cfg["exporters"][into_sidecar[0]]["endpoint"])
    taken = [port(p["endpoint"]) for r in cfg["receivers"].values() for p in r["protocols"].values()]
    assert sidecar_port not in taken


def test_pool_gateway_routes_lifecycle_by_trace_and_heartbeats_by_service():
    cfg = load(DEPLOY / "otel-collector" / "pool-gateway.yaml")
    pipes = cfg["service"]["pipelines"]
    by_exporter = {e: p for p in pipes.values() for e in p["exporters"]}
    trace_lb = by_exporter["loadbalancing/by-trace"]
    assert cfg["exporters"]["loadbalancing/by-trace"]["routing_key"] == "traceID"
    assert "filter/drop-heartbeats" in trace_lb["processors"]
    assert cfg["exporters"]["loadbalancing/by-service"]["routing_key"] == "service"
    assert "filter/heartbeats-only" in by_exporter["loadbalancing/by-service"]["processors"]
    pool = [set(cfg["exporters"][e]["resolver"]["static"]["hostnames"]) for e in cfg["exporters"]
            if e.startswith("loadbalancing/")]
    assert pool[0] == pool[1]  # both routes cover the same members
    # Pool members take the loadbalancing exporter's OTLP/gRPC on the port the gateway dials.
    member = load(DEPLOY / "otel-collector" / "pool-member.yaml")
    grpc = member["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert all(port(h) == port(grpc) for h in pool[0])
