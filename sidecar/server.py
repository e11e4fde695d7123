"""`pdwatch serve`: run the sidecar under uvicorn."""

from __future__ import annotations

import argparse
import gc
import logging
import sys

from pdwatch import contract as c

from .settings import Settings, add_arguments


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdwatch serve",
        description="Run the pdwatch sidecar: OTLP/HTTP ingest, stuck detection, Prometheus metrics and a JSON API. "
        "Every setting is a flag, else its environment variable, else the default.",
    )
    add_arguments(parser)
    return parser


# Allocations between young-generation collections (CPython's default is 700).
GC_YOUNG_THRESHOLD = 50_000
SWITCH_INTERVAL_S = 0.0005


def tune_gc() -> None:
    """Make the cyclic GC cheap for a process that holds up to hundreds of thousands of legs.

    At the default threshold a collection runs every few dozen spans, and the
    older generations, full of long-lived legs, get walked again and again: that
    cost a fifth of ingest. Ingest makes almost no reference cycles (refcounting
    frees a closed leg), so collecting less often costs little memory. Objects
    alive after start-up (FastAPI, protobuf, prometheus_client) are frozen out of
    every collection.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, 20, 20)


def tune_threads(switch_interval_s: float = SWITCH_INTERVAL_S) -> None:
    """Hand the GIL between threads more often than CPython's default 5 ms.

    The event loop (ingest, /healthz, the API) shares the GIL with the tracker's
    worker (decoding, applying, the judge's tick) and with scrapes. At 5 ms a
    thread that wants the GIL waits up to that long behind the other's Python
    work, at every handoff, and a request takes several: bench/healthz_under_scrape.py
    read a /healthz p99 25-30 ms over idle at 100,000 open legs, and ingest lost
    time at each hop to the worker and back.
    """
    sys.setswitchinterval(switch_interval_s)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = Settings.from_sources(vars(args))
        from .gpu.join import parse_gpu_map

        parse_gpu_map(settings.gpu_map)  # a bad map is a start-up error, not a silent fallback
    except ValueError as exc:
        print(f"pdwatch serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("pdwatch.sidecar")
    if settings.host not in ("127.0.0.1", "::1", "localhost") and not settings.token:
        log.warning("listening on %s without %s: anyone who reaches it can send spans", settings.host, c.ENV_TOKEN)

    import uvicorn  # imported late: `--help` and bad settings answer fast

    from .app import create_app

    log.info("starting with %r", settings)
    if settings.nvml == "off":
        log.info("GPU telemetry off (%s=off)", c.ENV_NVML)
    app = create_app(settings)
    tune_gc()
    tune_threads()
    # No X-Forwarded-* rewriting: nothing here reads the client address, and it costs every request.
    uvicorn.run(app, host=settings.host, port=settings.port,
                log_level=settings.log_level, access_log=False, proxy_headers=False)
    return 0
