"""The sidecar's HTTP surface (contract section 7): thin handlers over the tracker."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import time
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from . import views
from .diagnosis.classify import verdict
from .diagnosis.collector import DiagnosisCollector
from .diagnosis.from_tracker import gather as gather_facts
from .forward import ForwardCollector, from_settings as forwarder_from_settings
from .gpu.collector import GpuCollector
from .gpu.join import InstanceClaim, Owner, parse_gpu_map
from .gpu.sampler import GpuSampler
from .metrics import StageDurations, TrackerCollector
from .otlp_body import PROTOBUF, BodyError, decompress, media_type, parse_request, response_body
from .overload import RETRY_AFTER_S, GuardCollector, IngestGuard
from .settings import Settings
from .tracker import Tracker

log = logging.getLogger("pdwatch.sidecar")

TRACE_ID = re.compile(r"^[0-9a-f]{32}$")


# The ingest body is read by hand (streamed, size-limited), so FastAPI cannot
# infer it: described here, so the schema (and schemathesis) know it.
INGEST_OPENAPI = {
    "requestBody": {"required": True, "content": {
        "application/x-protobuf": {"schema": {"type": "string", "format": "binary"}},
        "application/json": {"schema": {"type": "object", "properties": {
            "resourceSpans": {"type": "array", "items": {"type": "object"}}}}},
    }},
    "responses": {
        "200": {"description": "ExportTraceServiceResponse; partial_success names spans it could not use"},
        **{str(code): {"description": text} for code, text in (
            (400, "malformed body or gzip"), (401, "missing or wrong bearer token"), (413, "body over the limit"),
            (415, "content type or encoding not supported"), (429, "too many requests in flight; Retry-After"),
            (503, "sidecar memory over its limit; Retry-After"))},
    },
}


class Sidecar:
    """Everything one running sidecar owns: settings, tracker, metrics registry."""

    def __init__(self, settings: Settings, *, clock=time.time_ns):
        self.settings = settings
        self.registry = CollectorRegistry(auto_describe=False)
        self.tracker = Tracker(
            settings.floors,
            flow_window_s=settings.flow_window_s,
            max_open_legs=settings.max_open_legs,
            max_closed_legs=settings.max_closed_legs,
            max_instances=settings.max_instances,
            instance_ttl_s=settings.instance_ttl_s,
            clock=clock,
        )
        self.durations = StageDurations(self.tracker.lock)
        self.tracker.on_stage_durations = self.durations.observe_many
        self.registry.register(self.durations)
        self.registry.register(TrackerCollector(self.tracker, self.durations))
        self.gpu = GpuSampler(settings.gpu_interval_s, settings.nvml, library=settings.extra.get("nvml_library"))
        self.gpu_map = parse_gpu_map(settings.gpu_map)
        self.registry.register(GpuCollector(self.gpu, self.gpu_claims, self.gpu_map))
        self.registry.register(DiagnosisCollector(self))
        self.forwarder = forwarder_from_settings(self)
        if self.forwarder is not None:
            self.tracker.on_stuck = self.forwarder.on_stuck  # enqueues only: it runs under the tracker lock
            self.registry.register(ForwardCollector(self.forwarder))
        self.guard = IngestGuard(settings.max_rss_bytes)
        self.registry.register(GuardCollector(self.guard))

    def diagnosis(self) -> list[dict]:
        return [verdict(facts) for facts in gather_facts(self)]

    def gpu_claims(self) -> list[InstanceClaim]:
        """What each engine process says it drives: GPU UUIDs and its PID, freshest heartbeat first."""
        with self.tracker.lock:
            incs = [(inst, inc) for inst in self.tracker.instances.values() for inc in inst.ranks.values()]
            incs.sort(key=lambda pair: -pair[1].last_heartbeat_ns)
            return [
                InstanceClaim(Owner(inst.cluster, inst.role, inst.name), inc.gpu_uuids,
                              (inc.pid,) if inc.pid else ())
                for inst, inc in incs
            ]


async def authorized(request: Request) -> None:
    # async: a plain def dependency would hop to the thread pool on every request, ingest included.
    token = request.app.state.sidecar.settings.token
    if not token:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    # Constant-time compare, so response timing does not reveal the token.
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})


# Ingest and the API need the token when one is set; /metrics and /healthz stay open.
Auth = Annotated[None, Depends(authorized)]


def create_app(settings: Settings | None = None, *, clock=time.time_ns, sidecar: Sidecar | None = None) -> FastAPI:
    settings = settings or Settings()
    sc = sidecar or Sidecar(settings, clock=clock)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # The stuck rule runs on a timer too, so detections are counted even when nobody scrapes.
        async def judge():
            while True:
                await asyncio.sleep(settings.evaluate_interval_s)
                try:
                    sc.tracker.evaluate()
                except Exception:
                    log.exception("stuck evaluation failed")

        task = asyncio.create_task(judge())
        sc.gpu.start()  # NVML is opened on the sampler's own thread
        if sc.forwarder is not None:
            sc.forwarder.start()
        try:
            yield
        finally:
            task.cancel()
            sc.gpu.stop()
            if sc.forwarder is not None:
                await asyncio.to_thread(sc.forwarder.stop)

    app = FastAPI(
        title="pdwatch sidecar",
        description="Finds the prefill/decode request that hangs while others flow.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.sidecar = sc


    @app.post("/v1/traces", summary="OTLP/HTTP trace ingest (protobuf or JSON, optionally gzip)",
              openapi_extra=INGEST_OPENAPI)
    async def ingest(request: Request, _: Auth) -> Response:
        refusal = sc.guard.refusal()
        if refusal is not None:
            return JSONResponse({"detail": refusal[1]}, status_code=refusal[0], headers={"Retry-After": RETRY_AFTER_S})
        sc.guard.in_flight += 1
        try:
            media = media_type(request.headers.get("content-type"))
            limit = settings.max_body_bytes
            declared = request.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise BodyError(413, f"body of {declared} bytes exceeds the limit of {limit}")
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise BodyError(413, f"body exceeds the limit of {limit} bytes")
                chunks.append(chunk)
            body = decompress(b"".join(chunks), request.headers.get("content-encoding"), limit)
            otlp = parse_request(body, media)
            try:
                applied = sc.tracker.ingest(otlp)
            except Exception:  # a bug here must not become a 500 that makes exporters retry forever
                sc.guard.errors += 1
                log.exception("ingest failed")
                raise BodyError(400, "spans could not be applied") from None
            if sc.forwarder is not None:
                # A bounded append; the worker thread sends. Nothing to drop: the body goes as it came.
                sc.forwarder.submit(otlp, raw=body if media == PROTOBUF and not applied.other else None)
            message = "; ".join(dict.fromkeys(applied.messages))[:1024] if applied.rejected else ""
            return Response(response_body(applied.rejected, message, media), media_type=media)
        except BodyError as err:
            return JSONResponse({"detail": err.message}, status_code=err.status)
        finally:
            sc.guard.in_flight -= 1

    @app.get("/metrics", summary="Prometheus text; OpenMetrics with exemplars when asked for")
    def metrics(request: Request) -> Response:
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(sc.registry), media_type=content_type)

    @app.get("/api/v1/stuck", summary="Legs stuck past their stage's threshold")
    def stuck(_: Auth) -> list[dict]:
        return views.stuck_list(sc.tracker)

    @app.get("/api/v1/requests/{trace_id}", summary="Both legs of one request, with stages and times")
    def request_detail(trace_id: str, _: Auth) -> dict:
        trace_id = trace_id.lower()
        if not TRACE_ID.match(trace_id):
            raise HTTPException(400, "trace id must be 32 hex digits")
        detail = views.request_detail(sc.tracker, trace_id)
        if detail is None:
            raise HTTPException(404, f"no leg of trace {trace_id} is known")
        return detail

    @app.get("/api/v1/diagnosis", summary="Per cluster: failure family, confidence, evidence with figures, action")
    def diagnosis(_: Auth) -> list[dict]:
        return sc.diagnosis()

    @app.get("/api/v1/summary", summary="Per cluster: finished and open legs, flow, stuck; instances")
    def summary(_: Auth) -> dict:
        return views.summary(sc.tracker)

    @app.get("/healthz", summary="Liveness")
    def healthz() -> dict:
        gpu = sc.gpu.snapshot()
        return {
            "status": "ok",
            "tracked_legs": len(sc.tracker.open),
            "instances": len(sc.tracker.instances),
            "gpu_telemetry": {"up": gpu.up, "reason": gpu.reason, "devices": len(gpu.devices), "driver": gpu.driver},
        }

    return app
