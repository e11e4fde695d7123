"""Forwarding to a trace store: the engines' lifecycle spans, spans that are not
pdwatch's (another instrumentation's, untouched), and a `pd.stuck` span per leg
that becomes stuck (contract section 10).

Ingest must never wait on the trace store, so the two entry points only
append to bounded deques under a short lock:

  submit(request)   from the ingest handler, after the tracker applied it
                    (with its raw body when it holds no heartbeat);
  stuck(legs, ...)  from the judge, once per leg that became stuck.

A worker thread drains both, drops heartbeats, batches, and POSTs OTLP/HTTP
protobuf to `<endpoint>/v1/traces`, retrying 429/502/503/504 and connection
errors with exponential backoff (a Retry-After header wins). Whatever does not
fit in the queue, or is still unsent when the retries run out, is counted,
never raised (OTel SDK's BatchSpanProcessor does the same).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status
from prometheus_client.core import Metric

from pdwatch import contract as c
from pdwatch.contract.otlp import add_attributes

from .evaluation import StuckLeg, stuck_description
from .families import counter, gauge

log = logging.getLogger("pdwatch.sidecar.forward")

# OTLP/HTTP's retryable answers (OTLP specification, "Failures").
RETRYABLE = frozenset((429, 502, 503, 504))
SERVICE_NAME = "pdwatch-sidecar"
SCOPE = InstrumentationScope(name="pdwatch.sidecar")
UNKNOWN_FAMILY = "unknown"
KINDS = ("lifecycle", "stuck")
RESULTS = ("sent", "dropped", "failed")
# A queued request, or its raw protobuf body when it holds no heartbeat, and the spans in it
Queued = tuple[ExportTraceServiceRequest | bytes, int]


@dataclass(slots=True, frozen=True)
class StuckEvent:
    """A pd.stuck span to send: the stuck leg as the judge saw it, and the family it diagnosed then."""

    leg: StuckLeg
    family: str


def traces_url(endpoint: str) -> str:
    """OTLP/HTTP convention: a base URL gets /v1/traces; a URL that already names it is kept."""
    endpoint = endpoint.strip().rstrip("/")
    if not endpoint.startswith(("http://", "https://")):
        raise ValueError(f"forward endpoint {endpoint!r} must be an http:// or https:// URL")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


def retry_after_s(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date), or None."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def stuck_resource_spans(events: Sequence[StuckEvent]) -> list[ResourceSpans]:
    """pd.stuck spans, one resource per cluster (contract section 10)."""
    by_cluster: dict[str, list[Span]] = {}
    for ev in events:
        leg = ev.leg
        attrs: dict[str, Any] = {c.A_ROLE: leg.role, c.A_STAGE: leg.stage, c.A_INSTANCE: leg.pd_instance,
                                 c.A_FAMILY: ev.family, c.A_REASON: leg.reason}
        if leg.rid:
            attrs[c.A_RID] = leg.rid
        if leg.room is not None:
            attrs[c.A_ROOM] = leg.room
        # Engine clock, as the leg's own spans: from stage entry to the detection.
        end_ns = max(leg.stuck_since_ns - leg.offset_ns, leg.stage_since_ns)
        span = Span(
            trace_id=bytes.fromhex(leg.trace_id),
            span_id=_span_id(),
            name=c.SPAN_STUCK,
            kind=Span.SPAN_KIND_INTERNAL,
            start_time_unix_nano=leg.stage_since_ns,
            end_time_unix_nano=end_ns,
            status=Status(code=Status.STATUS_CODE_ERROR,
                          message=stuck_description(leg.stage, leg.age_s, leg.threshold_s, leg.reason)),
        )
        add_attributes(span, attrs)
        if leg.span_id:
            span.parent_span_id = bytes.fromhex(leg.span_id)
        by_cluster.setdefault(leg.cluster, []).append(span)
    out = []
    for cluster, spans in by_cluster.items():
        resource = Resource()
        add_attributes(resource, {c.R_SERVICE_NAME: SERVICE_NAME, c.R_CLUSTER: cluster})
        out.append(ResourceSpans(resource=resource, scope_spans=[ScopeSpans(scope=SCOPE, spans=spans)]))
    return out


_rng = random.Random(int.from_bytes(os.urandom(8), "big"))


def _span_id() -> bytes:
    while True:
        sid = _rng.getrandbits(64)
        if sid:
            return sid.to_bytes(8, "big")


def drop_heartbeats(request: ExportTraceServiceRequest) -> int:
    """Remove every pd.heartbeat span, in place; returns the spans kept (lifecycle and foreign)."""
    kept = 0
    for rs in request.resource_spans:
        for ss in rs.scope_spans:
            spans = ss.spans
            # Backwards, deleting by index: usually one heartbeat per batch goes.
            for i in range(len(spans) - 1, -1, -1):
                if spans[i].name == c.SPAN_HEARTBEAT:
                    del spans[i]
            kept += len(spans)
    return kept


class Forwarder:
    """Bounded, non-blocking forwarding of spans to one OTLP/HTTP endpoint."""

    def __init__(
        self,
        endpoint: str,
        *,
        max_queue_spans: int = 65_536,
        max_stuck_queue: int = 4096,
        max_batch_spans: int = 4096,
        max_attempts: int = 6,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        timeout_s: float = 10.0,
        linger_s: float = 0.05,
        headers: dict[str, str] | None = None,
        certificate: str | None = None,
    ):
        self.url = traces_url(endpoint)
        self.max_queue_spans = max_queue_spans
        self.max_batch_spans = max_batch_spans
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.timeout_s = timeout_s
        self.linger_s = linger_s
        self.headers = {"Content-Type": "application/x-protobuf", **(headers or {})}
        self.verify: str | bool = certificate or True  # a CA file, else the system's trust store
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._requests: deque[Queued] = deque()
        self._queued_spans = 0
        self._stuck: deque[StuckEvent] = deque(maxlen=max_stuck_queue)
        self._thread: threading.Thread | None = None
        # Counters, read by ForwardCollector. Written by one thread each, or under _lock.
        self.spans = {(k, r): 0 for k in KINDS for r in RESULTS}
        self.requests_sent = 0
        self.retries = 0
        self.last_error = ""

    # ---- hot paths: append and return --------------------------------------

    def submit(self, request: ExportTraceServiceRequest, spans: int, raw: bytes | None = None) -> None:
        """Queue a parsed OTLP request of `spans` spans (heartbeats are removed later, on the worker).

        `raw` is the request's protobuf body when it holds no heartbeat: then it
        is forwarded as it came, with no filtering or re-encoding.
        """
        if not spans:
            return
        with self._lock:
            if self._queued_spans + spans <= self.max_queue_spans:
                self._requests.append((request if raw is None else raw, spans))
                self._queued_spans += spans
                self._wake.set()
                return
            # Full: count what would have been forwarded (rare path, so the scan is affordable).
            self.spans[("lifecycle", "dropped")] += sum(
                1 for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans
                if s.name != c.SPAN_HEARTBEAT)

    def stuck(self, legs: Sequence[StuckLeg], family: dict[str, str | None]) -> None:
        """From the judge, once per leg that became stuck: append, return."""
        with self._lock:
            for leg in legs:
                if len(self._stuck) == self._stuck.maxlen:
                    self.spans[("stuck", "dropped")] += 1  # the deque drops its oldest
                self._stuck.append(StuckEvent(leg, family.get(leg.cluster) or UNKNOWN_FAMILY))
            self._wake.set()

    # ---- state ---------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        """Spans waiting: lifecycle spans (heartbeats included until the worker strips them) plus pd.stuck."""
        return self._queued_spans + len(self._stuck)

    def start(self) -> Forwarder:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pdwatch-forward", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (one attempt each, no more retries) within timeout_s, then stop."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    # ---- worker --------------------------------------------------------------

    def _take(self) -> tuple[list[StuckEvent], list[Queued]]:
        with self._lock:
            stuck = list(self._stuck)
            self._stuck.clear()
            batch: list[Queued] = []
            n = 0
            while self._requests and (not batch or n + self._requests[0][1] <= self.max_batch_spans):
                req, k = self._requests.popleft()
                batch.append((req, k))
                n += k
                self._queued_spans -= k
            if not self._requests and not self._stuck:
                self._wake.clear()
        return stuck, batch

    def _run(self) -> None:
        with httpx.Client(timeout=self.timeout_s, verify=self.verify) as client:
            while True:
                self._wake.wait(0.5)
                stopping = self._stop.is_set()
                # Linger a moment for a fuller batch (as the SDK's batch processor
                # does): one POST per ingested request would cost the sidecar more
                # CPU than the spans themselves. pd.stuck spans go at once.
                if not stopping and self._requests and not self._stuck \
                        and self._queued_spans < self.max_batch_spans:
                    self._stop.wait(self.linger_s)
                stuck, batch = self._take()
                if stuck or batch:
                    try:
                        self._forward(client, stuck, batch)
                    except Exception:  # a bug here must not kill forwarding for good
                        log.exception("forwarding failed")
                    continue
                if stopping:
                    return

    def _forward(self, client: httpx.Client, stuck: list[StuckEvent], batch: list[Queued]) -> None:
        # Serialized messages concatenate into one whose repeated fields are
        # the union (protobuf's merge rule), so a batch is the requests' bytes
        # joined: no span is copied from one message into another.
        parts, n_stuck, n_life = [], 0, 0
        if stuck:
            out = ExportTraceServiceRequest(resource_spans=stuck_resource_spans(stuck))
            parts.append(out.SerializeToString())
            n_stuck = len(stuck)
        for req, n in batch:
            if isinstance(req, bytes):  # no heartbeat in it: as received
                n_life += n
                parts.append(req)
                continue
            kept = drop_heartbeats(req)
            if kept:
                n_life += kept
                parts.append(req.SerializeToString())
        if not parts:
            return
        rejected = self._post(client, b"".join(parts))
        with self._lock:
            if rejected is None:
                self.spans[("stuck", "failed")] += n_stuck
                self.spans[("lifecycle", "failed")] += n_life
                return
            # Partial success: the store names how many it refused, not which; charge lifecycle first.
            life_bad = min(rejected, n_life)
            stuck_bad = min(rejected - life_bad, n_stuck)
            self.spans[("lifecycle", "sent")] += n_life - life_bad
            self.spans[("lifecycle", "failed")] += life_bad
            self.spans[("stuck", "sent")] += n_stuck - stuck_bad
            self.spans[("stuck", "failed")] += stuck_bad

    def _post(self, client: httpx.Client, body: bytes) -> int | None:
        """POST with retries; returns spans the store rejected (0 = all taken), None if it never took them."""
        delay = self.backoff_s
        for attempt in range(1, self.max_attempts + 1):
            wait = None
            try:
                r = client.post(self.url, content=body, headers=self.headers)
            except httpx.HTTPError as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
            else:
                if 200 <= r.status_code < 300:
                    self.requests_sent += 1
                    return _rejected_spans(r)
                self.last_error = f"HTTP {r.status_code}"
                if r.status_code not in RETRYABLE:
                    log.warning("trace store at %s refused spans: %s %s", self.url, r.status_code, r.text[:200])
                    return None
                wait = retry_after_s(r.headers.get("retry-after"))
            if attempt == self.max_attempts:
                break
            # Past the stop deadline nothing waits: what is left is counted as failed.
            if self._stop.is_set():
                break
            pause = min(self.max_backoff_s, wait if wait is not None else delay * (0.5 + _rng.random()))
            self.retries += 1
            delay = min(self.max_backoff_s, delay * 2)
            if self._stop.wait(pause):
                break
        log.warning("giving up forwarding to %s: %s", self.url, self.last_error)
        return None


def _rejected_spans(response: httpx.Response) -> int:
    if not response.content or "protobuf" not in response.headers.get("content-type", ""):
        return 0
    try:
        # protobuf ships no types: the message is Any to mypy
        rejected: int = ExportTraceServiceResponse.FromString(response.content).partial_success.rejected_spans
    except Exception:
        return 0
    return rejected


class ForwardCollector:
    """The forwarder's metrics (contract FORWARD_METRICS), built fresh on each scrape."""

    def __init__(self, forwarder: Forwarder):
        self.fwd = forwarder

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        fwd = self.fwd
        spans = counter(c.FORWARD_SPANS)
        with fwd._lock:
            counts = dict(fwd.spans)
        for (kind, result), n in counts.items():
            spans.add_metric([kind, result], n)
        yield spans
        yield gauge(c.FORWARD_QUEUE_DEPTH, fwd.queue_depth)
        yield gauge(c.FORWARD_QUEUE_CAPACITY, fwd.max_queue_spans)
        yield counter(c.FORWARD_RETRIES, fwd.retries)
        yield counter(c.FORWARD_REQUESTS, fwd.requests_sent)


def from_settings(endpoint: str | None, headers: str = "", certificate: str | None = None,
                  **options: Any) -> Forwarder | None:
    """The sidecar's forwarder when PDWATCH_FORWARD_OTLP_ENDPOINT is set: its headers as the OTLP exporter's
    variable writes them (parse_env_headers), its CA file; `options` tune it (tests)."""
    if not endpoint:
        return None
    from opentelemetry.util.re import parse_env_headers

    return Forwarder(endpoint, headers=dict(parse_env_headers(headers, liberal=True)) if headers else None,
                     certificate=certificate, **options)
