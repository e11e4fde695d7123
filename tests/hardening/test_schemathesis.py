"""Schemathesis against the sidecar's own OpenAPI schema: every operation,
generated paths, queries, headers and bodies, on an app that holds a live
incident (open, stuck and finished legs), with and without a token. No
response may be a server error, and each must match what the schema declares."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from pdwatch.sidecar.app import create_app
from pdwatch.sidecar.settings import Settings

from .conftest import FUZZ_EXAMPLES, Engine, FakeClock, check_invariants

TOKEN = "schemathesis-token"
# OTLP protobuf bodies are bytes to schemathesis: sent as generated, like octet-stream.
schemathesis.serializer.alias("application/x-protobuf", "application/octet-stream")


def incident_app(token: str | None):
    clock = FakeClock()
    app = create_app(Settings(nvml="off", token=token, floor_transfer_s=1), clock=clock)
    tracker = app.state.sidecar.tracker
    p, d = Engine("prefill", "prefill-0", clock), Engine("decode", "decode-0", clock)
    try:
        for room in range(6):
            p.walk(f"p-{room}", room, ("bootstrap", "queued", "prefill", "transfer"))
            d.walk(f"d-{room}", room, ("bootstrap", "transfer"))
            if room % 2:
                p.rec.finish(f"p-{room}")
                d.rec.enter(f"d-{room}", "queued")
                d.rec.enter(f"d-{room}", "decode")
                d.rec.finish(f"d-{room}")
        p.send(tracker)
        d.send(tracker)
    finally:
        p.rec.shutdown(timeout_s=1)
        d.rec.shutdown(timeout_s=1)
    clock.advance(2)  # past the 1 s floor, within the engines' 3 heartbeats: up, and their legs judged
    assert app.state.sidecar.judge_now().stuck  # the API has something to say
    return app


open_schema = schemathesis.openapi.from_asgi("/openapi.json", incident_app(None))
# With a token, the schema itself is behind it too.
guarded_schema = schemathesis.openapi.from_asgi("/openapi.json", incident_app(TOKEN),
                                                headers={"Authorization": f"Bearer {TOKEN}"})
FUZZ = settings(max_examples=max(10, FUZZ_EXAMPLES // 3), deadline=None,
                suppress_health_check=list(HealthCheck))


@open_schema.parametrize()
@FUZZ
def test_no_operation_answers_a_server_error(case):
    response = case.call_and_validate(checks=[not_a_server_error, response_schema_conformance])
    assert response.status_code < 500
    open_schema.app.state.sidecar.worker.call(check_invariants, open_schema.app.state.sidecar.tracker)


@guarded_schema.parametrize()
@FUZZ
def test_no_operation_answers_a_server_error_with_a_token_set(case):
    response = case.call_and_validate(checks=[not_a_server_error])
    if case.path not in ("/metrics", "/healthz"):
        assert response.status_code in (401, 405)  # 405: schemathesis also tries methods the path lacks
    assert TOKEN not in response.text


@pytest.mark.parametrize("path", ["/api/v1/stuck", "/api/v1/summary", "/api/v1/diagnosis"])
def test_the_schema_covers_the_api(path):
    assert open_schema[path]["GET"] is not None
