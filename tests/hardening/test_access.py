"""Access: `pdwatch serve` binds loopback unless told otherwise; with a token
set, ingest and the API need it as a bearer token; the token never reaches a
log line, even at debug level and under wrong guesses."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from pdwatch.engine_patches.recorder import Recorder, RecorderConfig
from pdwatch.sidecar.server import build_parser
from pdwatch.sidecar.settings import Settings
from pdwatch.testbed.sidecar_process import free_port

TOKEN = "s3cret-Tok3n-for-tests-only"
API = ["/api/v1/stuck", "/api/v1/summary", "/api/v1/diagnosis", f"/api/v1/requests/{'ab' * 16}"]
PB = {"content-type": "application/x-protobuf"}


def listening_addresses(port: int) -> set[str]:
    """Local addresses in LISTEN state on `port`, from /proc/net/tcp{,6}."""
    found = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            addr, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:
                found.add(addr)
    return found


def test_serve_binds_loopback_by_default_and_keeps_the_token_out_of_its_logs(tmp_path, monkeypatch):
    monkeypatch.delenv("PDWATCH_HOST", raising=False)
    assert Settings.from_sources(vars(build_parser().parse_args([]))).host == "127.0.0.1"
    port = free_port()
    env = {**os.environ, "PDWATCH_TOKEN": TOKEN, "PDWATCH_PORT": str(port), "PDWATCH_NVML": "off",
           "PDWATCH_LOG_LEVEL": "debug"}
    env.pop("PDWATCH_HOST", None)
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pdwatch.cli", "serve"], env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1 and nothing else
        for header in ("", "Bearer wrong", f"Bearer {TOKEN}x", f"Basic {TOKEN}", f"Bearer {TOKEN}"):
            httpx.get(f"{url}/api/v1/stuck", headers={"authorization": header} if header else {})
            httpx.post(f"{url}/v1/traces", content=b"", headers={**PB, "authorization": header})
    finally:
        proc.terminate()
        proc.wait(10)
    text = log.read_bytes().decode(errors="replace")
    assert "starting with Settings(" in text and "token='<set>'" in text  # it did log its settings
    assert TOKEN not in text and TOKEN[:12] not in text


@pytest.fixture
def guarded(live_sidecar):
    return live_sidecar(token=TOKEN)


def test_with_a_token_ingest_and_api_need_it_metrics_and_health_stay_open(guarded):
    url = guarded.url
    for header in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Bearer {TOKEN[:-1]}"},
                   {"authorization": f"Basic {TOKEN}"}, {"authorization": TOKEN},
                   {"authorization": b"Bearer \xff\xfe"}):
        r = httpx.post(f"{url}/v1/traces", content=b"", headers={**PB, **header})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert TOKEN not in r.text
        for path in API:
            assert httpx.get(f"{url}{path}", headers=header).status_code == 401, path
    good = {"authorization": f"Bearer {TOKEN}"}
    assert httpx.post(f"{url}/v1/traces", content=b"", headers={**PB, **good}).status_code == 200
    assert httpx.post(f"{url}/v1/traces", content=b"", headers={**PB, "authorization": f"bearer  {TOKEN}"}
                      ).status_code == 200  # the scheme in any case, extra spaces before the token
    for path in API:
        assert httpx.get(f"{url}{path}", headers=good).status_code in (200, 404), path
    assert httpx.get(f"{url}/metrics").status_code == 200
    assert httpx.get(f"{url}/healthz").status_code == 200


def test_a_recorder_with_the_token_gets_through_and_one_without_does_not(guarded):
    def run(environ):
        # The token as an engine is given it: the OTLP exporter's standard headers variable.
        rec = Recorder(RecorderConfig(role="prefill", instance=f"p-{len(environ)}", heartbeat_s=1.0),
                       environ={"OTEL_EXPORTER_OTLP_ENDPOINT": guarded.url, **environ})
        rec.arrive("p-1", bootstrap_room=1)
        rec.enter("p-1", "bootstrap")
        rec.drain()
        rec.heartbeat()
        rec.flush()
        stats = rec.stats()
        rec.shutdown(timeout_s=1)
        return stats

    refused = run({})
    assert refused["export_failed_spans"] > 0 and not guarded.sidecar.tracker.instances
    ok = run({"OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer%20{TOKEN}"})
    assert ok["export_failed_spans"] == 0
    assert [k[1] for k in guarded.sidecar.tracker.instances] == ["p-1"]
