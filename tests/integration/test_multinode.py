"""Past one node: three sidecars (one per "node": prefill-0, decode-0, decode-1),
one Prometheus over all three with the repository's rules. The prefill and
decode legs of one request land on different sidecars; the page and the
cluster-wide diagnosis (`pdwatch diagnose --prometheus`) must still be right.
"""

from __future__ import annotations

import time

import pytest

from pdwatch.testbed.monitoring import Monitoring
from pdwatch.testbed.sidecar_process import SidecarProcess

pytestmark = pytest.mark.integration

HEADLINE = "PDRequestStuckWhileOthersFlow"
NODES = ("prefill-0", "decode-0", "decode-1")


def test_three_sidecars_one_prometheus_page_and_diagnose_the_incident():
    from pdwatch.sidecar.diagnosis.classify import verdict
    from pdwatch.sidecar.diagnosis.from_prometheus import gather
    from pdwatch.testbed.stack import Stack

    env = {"PDWATCH_FLOOR_TRANSFER_S": "4", "PDWATCH_LOG_LEVEL": "warning", "PDWATCH_EVALUATE_INTERVAL_S": "0.25",
           "PDWATCH_NVML": "off"}
    sidecars = {node: SidecarProcess(env=env) for node in NODES}

    class PerNodeStack(Stack):
        """Each engine exports to its own node's sidecar, as with a sidecar per node."""

        def _engine_env(self, instance):
            return {**super()._engine_env(instance), "OTEL_EXPORTER_OTLP_ENDPOINT": sidecars[instance].url}

    stack = None
    try:
        for sc in sidecars.values():
            sc.start()
        stack = PerNodeStack("decode-restart", otlp_endpoint=sidecars["prefill-0"].url, heartbeat_s=0.5, rate=3.0,
                             restart_at=7.0, duration_s=200.0)  # "long after" its peers: over RESTART_SKEW_S
        with Monitoring([sc.url for sc in sidecars.values()]) as mon:
            stack.start()
            deadline = time.monotonic() + 150
            while time.monotonic() < deadline and not mon.webhook.alerts(HEADLINE):
                time.sleep(1)
            pages = mon.webhook.alerts(HEADLINE)
            assert pages, f"no page; firing: {[a['labels'] for a in mon.firing()]}"
            paged = {(a["labels"]["pd_instance"], a["labels"]["role"]) for _t, _p, a in pages}
            assert paged <= {("prefill-0", "prefill"), ("decode-0", "decode")}
            # Each sidecar saw only its own node's legs ...
            per_node = {node: {s["pd_instance"] for s in sc.get("/api/v1/stuck")} for node, sc in sidecars.items()}
            assert per_node == {"prefill-0": {"prefill-0"}, "decode-0": {"decode-0"}, "decode-1": set()}
            # ... yet the two legs of each hung request, seen by two sidecars, share one trace id.
            prefill_ids = {s["trace_id"] for s in sidecars["prefill-0"].get("/api/v1/stuck")}
            decode_ids = {s["trace_id"] for s in sidecars["decode-0"].get("/api/v1/stuck")}
            assert prefill_ids & decode_ids
            # The cluster-wide diagnosis, through Prometheus, names the incident.
            (facts,) = gather(mon.prometheus_url)
            v = verdict(facts)
            assert v["family"] == "transfer_wedge", v
            assert "restart_skew" in [f["family"] for f in v["findings"]], v
            assert {i.pd_instance for i in facts.instances} == set(NODES)
    finally:
        if stack is not None:
            stack.stop()
        for sc in sidecars.values():  # also when a start failed: no sidecar outlives the test
            sc.stop()
