"""The sidecar's HTTP surface (contract section 7): thin handlers over the `Sidecar`.

Ingest reads the body on the event loop and hands parsing, decoding and
applying to the tracker's worker thread, awaiting the result; every GET reads
the judge's latest immutable evaluation (one request's detail is the judge's
view of it, made on the worker when asked). So the event loop never waits on the tracker, and no read
changes anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.routing import APIRoute
from prometheus_client.exposition import choose_encoder

from pdwatch import contract as c

from . import ui, views
from .auth import Auth, authorized
from .otlp_body import PROTOBUF, BodyError, decompress, media_type, response_body
from .overload import RETRY_AFTER_S
from .service import Sidecar
from .settings import Settings

log = logging.getLogger("pdwatch.sidecar")

TRACE_ID = re.compile(r"^[0-9a-f]{32}$")
# An oversized body is read to its end (and thrown away) up to this much, so the
# client reads the 413 instead of a connection reset; past it, the connection closes.
DRAIN_MAX_BYTES = 256 << 20


# The ingest body is read by hand (streamed, size-limited), so FastAPI cannot
# infer it: described here, so the schema (and schemathesis) know it.
INGEST_OPENAPI: dict[str, Any] = {
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


class IngestRoute(APIRoute):
    """The ingest route without FastAPI's per-request parameter handling: its handler takes the
    request alone, reads the body itself and checks the token itself, so there is nothing to solve
    (solving it was about half of the route's own time on the event loop). It stays an APIRoute,
    so the OpenAPI schema describes it as before."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler: Callable[[Request], Coroutine[Any, Any, Response]] = self.endpoint
        return handler


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        await _drain(request)
        raise BodyError(413, f"body of {declared} bytes exceeds the limit of {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            await _drain(request)
            raise BodyError(413, f"body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _drain(request: Request) -> None:
    """Read what is left of a refused body, keeping none of it, so the client gets to read the answer."""
    drained = 0
    with contextlib.suppress(Exception):
        async for chunk in request.stream():
            drained += len(chunk)
            if drained > DRAIN_MAX_BYTES:
                break


def create_app(settings: Settings | None = None, *, clock: Callable[[], int] = time.time_ns,
               sidecar: Sidecar | None = None, **options: Any) -> FastAPI:
    """The app over a new Sidecar (or the one given); `options` reach Sidecar (tests: nvml_library, ...)."""
    settings = settings or Settings()
    sc = sidecar or Sidecar(settings, clock=clock, **options)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        sc.start()
        try:
            yield
        finally:
            await asyncio.to_thread(sc.stop)

    app = FastAPI(
        title="pdwatch sidecar",
        description="Finds the prefill/decode request that hangs while others flow.",
        version=c.package_version(),
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,  # served below, behind the token like the API it describes
    )
    app.state.sidecar = sc

    @app.get("/openapi.json", include_in_schema=False)
    def openapi(_: Auth) -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    def docs(_: Auth) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="pdwatch sidecar API")

    async def ingest(request: Request) -> Response:
        await authorized(request)  # what Auth does on the other routes, without a dependency to solve
        refusal = sc.guard.refusal()
        if refusal is not None:
            return JSONResponse({"detail": refusal[1]}, status_code=refusal[0], headers={"Retry-After": RETRY_AFTER_S})
        sc.guard.in_flight += 1
        try:
            media = media_type(request.headers.get("content-type"))
            raw = await _read_body(request, settings.max_body_bytes)
            body = decompress(raw, request.headers.get("content-encoding"), settings.max_body_bytes)
            try:
                otlp, decoded, applied = await asyncio.wrap_future(sc.worker.submit(sc.ingest, body, media))
            except BodyError:
                raise
            except Exception:  # a bug here must not become a 500 that makes exporters retry forever
                sc.guard.errors += 1
                log.exception("ingest failed")
                raise BodyError(400, "spans could not be applied") from None
            if sc.forwarder is not None:
                # A bounded append; the forwarder's thread sends. No heartbeat in it: the body goes as it came.
                sc.forwarder.submit(otlp, decoded.spans - decoded.heartbeats,
                                    raw=body if media == PROTOBUF and not decoded.heartbeats else None)
            message = "; ".join(dict.fromkeys(applied.messages))[:1024] if applied.rejected else ""
            return Response(response_body(applied.rejected, message, media), media_type=media)
        except BodyError as err:
            headers = {"Connection": "close"} if err.status == 413 else None
            return JSONResponse({"detail": err.message}, status_code=err.status, headers=headers)
        finally:
            sc.guard.in_flight -= 1

    app.router.add_api_route(c.PATH_INGEST, ingest, methods=["POST"], route_class_override=IngestRoute,
                             summary="OTLP/HTTP trace ingest (protobuf or JSON, optionally gzip)",
                             openapi_extra=INGEST_OPENAPI)

    @app.get(c.PATH_METRICS, summary="Prometheus text; OpenMetrics with exemplars when asked for")
    def metrics(request: Request) -> Response:
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(sc.registry), media_type=content_type)

    @app.get(c.PATH_STUCK, summary="Legs stuck past their stage's threshold or on evidence, oldest first")
    def stuck(_: Auth) -> list[dict[str, Any]]:
        return views.stuck_list(sc.latest())

    @app.get(c.PATH_REQUEST, summary="Both legs of one request, with stages and times")
    async def request_detail(trace_id: str, _: Auth) -> dict[str, Any]:
        trace_id = trace_id.lower()
        if not TRACE_ID.match(trace_id):
            raise HTTPException(400, "trace id must be 32 hex digits")
        detail = views.request_detail(await asyncio.wrap_future(sc.worker.submit(sc.judge.request_view, trace_id)))
        if detail is None:
            raise HTTPException(404, f"no leg of trace {trace_id} is known")
        return detail

    @app.get(c.PATH_DIAGNOSIS, summary="Per cluster: failure family, confidence, evidence with figures, action")
    def diagnosis(_: Auth) -> list[dict[str, Any]]:
        return list(sc.latest().diagnosis)

    @app.get("/api/v1/summary", summary="Per cluster: finished and open legs, flow, stuck; instances")
    def summary(_: Auth) -> dict[str, Any]:
        return views.summary(sc.latest())

    @app.get("/api/v1/history", summary="The last minutes of every instance: open legs, flow, stuck, GPUs")
    def history(_: Auth, seconds: float = 600.0) -> dict[str, Any]:
        if not 0 < seconds <= 86_400:
            raise HTTPException(400, "seconds must be in (0, 86400]")
        ev = sc.latest()
        return {"at_unix_s": round(ev.at_ns / 1e9, 3), "instances": sc.history.view(seconds, ev.at_ns / 1e9)}

    @app.get(c.PATH_HEALTH, summary="Liveness: 503 once the judge has not finished a pass for 3 of its intervals",
             responses={503: {"description": "the judge is stalled"}})
    async def healthz(response: Response) -> dict[str, Any]:
        # Only the evaluation, never the sampler directly: /healthz and /metrics then tell
        # one story about the GPUs (the sampler runs ahead of the judge by up to a tick).
        ev = sc.latest()
        stalled = sc.worker.stalled()  # read here, on the event loop: the judge's thread may be the one stuck
        if stalled:
            response.status_code = 503
        return {
            "status": "stalled" if stalled else "ok",
            "evaluation_age_s": round(sc.worker.age_s(), 3),
            "tracked_legs": ev.counters.tracked_legs,
            "instances": ev.counters.tracked_instances,
            "evaluated_unix_s": round(ev.at_ns / 1e9, 3),
            "gpu_telemetry": {"up": ev.gpu_up, "reason": ev.gpu_reason, "devices": len(ev.gpus), "driver": ev.gpu_driver},
        }

    app.include_router(ui.router)  # the live page: static files and one read-only route, behind the token
    return app
