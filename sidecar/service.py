"""Everything one running sidecar owns, wired once: settings, the tracker and its
worker thread, the judge, the GPU sampler, the forwarder, the ingest guard and
the metrics registry. The HTTP app (`app.py`) is a thin layer over this.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from pdwatch import contract as c

from . import forward
from .capture import StackCapture
from .diagnosis.collector import DiagnosisCollector
from .evaluation import Evaluation
from .families import counter, gauge
from .gpu.collector import GpuCollector
from .gpu.join import parse_gpu_map
from .gpu.sampler import GpuSampler
from .history import History
from .judge import Judge
from .metrics import DurationCollector, EvaluationCollector
from .otlp_body import parse_request
from .overload import GuardCollector, IngestGuard
from .settings import Settings
from .spans import Decoded, decode
from .tracker import Applied, Limits, Tracker
from .worker import Worker


class Sidecar:
    def __init__(self, settings: Settings, *, clock: Callable[[], int] = time.time_ns,
                 nvml_library: str | None = None, forward_options: dict[str, Any] | None = None):
        self.settings = settings
        self.tracker = Tracker(Limits.of(settings), clock=clock)
        self.gpu = GpuSampler(settings.gpu_interval_s, settings.nvml, library=nvml_library)
        self.forwarder = forward.from_settings(settings.forward_otlp_endpoint, settings.forward_otlp_headers,
                                               settings.forward_otlp_certificate, **(forward_options or {}))
        self.history = History()
        hosts = tuple(h.strip() for h in settings.capture_hosts.split(",") if h.strip()) or None
        self.capture = StackCapture(settings.capture, every_s=settings.capture_every_s,
                                    timeout_s=settings.capture_timeout_s, hosts=hosts)
        self.judge = Judge(self.tracker, settings, gpu=self.gpu,
                           gpu_map=parse_gpu_map(settings.gpu_map),
                           on_stuck=self.forwarder.stuck if self.forwarder is not None else None,
                           history=self.history, capture=self.capture)
        self.worker = Worker(self.judge.tick, settings.evaluate_interval_s)
        self.guard = IngestGuard(settings.max_rss_bytes)
        self.registry = CollectorRegistry(auto_describe=False)
        for collector in (EvaluationCollector(self.latest), DurationCollector(self.latest), GpuCollector(self.latest),
                          DiagnosisCollector(self.latest), GuardCollector(self.guard), WorkerCollector(self.worker),
                          CaptureCollector(self.capture)):
            self.registry.register(collector)
        if self.forwarder is not None:
            self.registry.register(forward.ForwardCollector(self.forwarder))

    def latest(self) -> Evaluation:
        """The judge's latest evaluation: one immutable object, read without a lock."""
        return self.judge.latest

    def start(self) -> None:
        self.gpu.start()  # NVML is opened on the sampler's own thread
        if self.forwarder is not None:
            self.forwarder.start()
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop()
        self.gpu.stop()
        if self.forwarder is not None:
            self.forwarder.stop()

    def ingest(self, body: bytes, media: str) -> tuple[ExportTraceServiceRequest, Decoded, Applied]:
        """Parse, decode and apply one OTLP body; runs on the worker (BodyError for a malformed body).

        The decoded records are let go here, where they were made: what comes back holds only the
        counts, so the event loop does not free a request's worth of records after answering."""
        request = parse_request(body, media)
        decoded = decode(request)
        applied = self.tracker.apply(decoded)
        decoded.batches.clear()
        return request, decoded, applied

    def judge_now(self) -> Evaluation:
        """Run the judge's tick at once, on its thread (tests, and the demo's final word)."""
        self.worker.tick_now()
        return self.latest()


class CaptureCollector:
    """The stack captures by result: what the stack capture did, and why it did not."""

    def __init__(self, capture: StackCapture):
        self.capture = capture

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        family = counter(c.STACK_CAPTURES)
        for result, n in self.capture.counts.items():
            family.add_metric([result], n)
        yield family


class WorkerCollector:
    """The judge's own health: ticks, failed ticks, how long the latest took, how long ago one finished."""

    def __init__(self, worker: Worker):
        self.worker = worker

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        w = self.worker
        yield counter(c.JUDGE_TICKS, w.ticks)
        yield counter(c.JUDGE_ERRORS, w.tick_errors)
        yield gauge(c.JUDGE_TICK_SECONDS, w.last_tick_s)
        yield gauge(c.EVALUATION_AGE, round(w.age_s(), 3))  # read now, not when the judge last ran
