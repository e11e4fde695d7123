"""The example Alertmanager configuration: amtool accepts it, routes by
severity, and a real Alertmanager applies its inhibitions."""

from __future__ import annotations

import shutil
import subprocess
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest

from pdwatch.testbed.processes import free_port as _free_port

CONFIG = Path(__file__).resolve().parents[2] / "alerts" / "alertmanager.example.yml"


def _amtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["amtool", *args], capture_output=True, text=True)


def test_amtool_accepts_the_config():
    out = _amtool("check-config", str(CONFIG))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout
    assert "2 inhibit rules" in out.stdout


@pytest.mark.parametrize("labels, receiver", [
    (["alertname=PDRequestStuckWhileOthersFlow", "severity=critical", "pd_cluster=c1"], "pdwatch-pager"),
    (["alertname=PDEngineSilent", "severity=critical"], "pdwatch-pager"),
    (["alertname=PDRestartSkew", "severity=warning"], "pdwatch-tickets"),
    (["alertname=PDWatchTelemetryMissing", "severity=warning", "reason=no_spans"], "pdwatch-tickets"),
    (["alertname=SomethingElse"], "pdwatch-tickets"),
])
def test_routes_by_severity(labels, receiver):
    out = _amtool("config", "routes", "test", f"--config.file={CONFIG}", *labels)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split() == [receiver]


@pytest.fixture
def alertmanager(tmp_path):
    binary = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    assert binary, "prometheus-alertmanager is installed by mk/debian.mk"
    port = _free_port()
    proc = subprocess.Popen(
        [binary, f"--config.file={CONFIG}", f"--storage.path={tmp_path}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}/api/v2"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"{base}/status", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "alertmanager did not start in 20 s"
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _alert(**labels):
    now = datetime.now(timezone.utc)
    return {
        "labels": labels,
        "annotations": {"summary": "test"},
        "startsAt": now.isoformat(),
        "endsAt": (now + timedelta(minutes=10)).isoformat(),
    }


@pytest.mark.integration
def test_total_wedge_and_silent_engine_inhibit_the_per_request_page(alertmanager):
    stuck = dict(alertname="PDRequestStuckWhileOthersFlow", severity="critical", role="decode", stage="transfer")
    alerts = [
        # c1: total wedge silences every stuck page of the cluster.
        _alert(alertname="PDTotalWedge", severity="critical", pd_cluster="c1"),
        _alert(**stuck, pd_cluster="c1", pd_instance="decode-0"),
        # c2: decode-1 is silent, which explains its stuck legs but not decode-2's.
        _alert(alertname="PDEngineSilent", severity="critical", pd_cluster="c2", role="decode", pd_instance="decode-1"),
        _alert(**stuck, pd_cluster="c2", pd_instance="decode-1"),
        _alert(**stuck, pd_cluster="c2", pd_instance="decode-2"),
        # c3: a wedge elsewhere inhibits nothing here.
        _alert(**stuck, pd_cluster="c3", pd_instance="decode-0"),
    ]
    assert httpx.post(f"{alertmanager}/alerts", json=alerts, timeout=5).status_code == 200
    seen = {}
    deadline = time.monotonic() + 10
    while len(seen) < len(alerts) and time.monotonic() < deadline:
        for a in httpx.get(f"{alertmanager}/alerts", timeout=5).json():
            key = (a["labels"]["alertname"], a["labels"]["pd_cluster"], a["labels"].get("pd_instance"))
            seen[key] = a["status"]
        time.sleep(0.1)
    assert len(seen) == len(alerts), seen

    def inhibited(name, cluster, instance=None):
        return seen[(name, cluster, instance)]["state"] == "suppressed" and bool(
            seen[(name, cluster, instance)]["inhibitedBy"])

    assert inhibited("PDRequestStuckWhileOthersFlow", "c1", "decode-0")
    assert inhibited("PDRequestStuckWhileOthersFlow", "c2", "decode-1")
    assert not inhibited("PDRequestStuckWhileOthersFlow", "c2", "decode-2")
    assert not inhibited("PDRequestStuckWhileOthersFlow", "c3", "decode-0")
    assert not inhibited("PDTotalWedge", "c1")
    assert not inhibited("PDEngineSilent", "c2", "decode-1")
