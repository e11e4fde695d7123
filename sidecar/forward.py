"""Forwarding to a trace store: the engines' lifecycle spans, and a `pd.stuck`
span per leg that becomes stuck (contract section 10).

Ingest must never wait on the trace store, so the two entry points only
append to bounded deques under a short lock:

  submit(request)   from the ingest handler, after the tracker applied it
                    (with its raw body when it holds lifecycle spans only);
  on_stuck(...)     the tracker's callback, called under the tracker lock.

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
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Callable

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdwatch import contract as c

log = logging.getLogger("pdwatch.sidecar.forward")

# Spans worth a trace store: a leg and its stages. Heartbeats are the sidecar's
# own bookkeeping (one every 2 s per process) and would only clutter traces.
LIFECYCLE_SPANS = frozenset([c.SPAN_LEG, *(c.stage_span_name(s) for s in c.ALL_STAGES)])
# OTLP/HTTP's retryable answers (OTLP specification, "Failures").
RETRYABLE = frozenset((429, 502, 503, 504))
SERVICE_NAME = "pdwatch-sidecar"
SCOPE = InstrumentationScope(name="pdwatch.sidecar")
UNKNOWN_FAMILY = "unknown"
KINDS = ("lifecycle", "stuck")
RESULTS = ("sent", "dropped", "failed")


@dataclass(slots=True, frozen=True)
class StuckEvent:
    """What a pd.stuck span needs, copied off the leg at detection (the leg changes afterwards)."""

    trace_id: str
    parent_span_id: str | None
    cluster: str
    role: str
    stage: str
    pd_instance: str
    rid: str
    room: int | None
    start_ns: int  # stage entry, engine clock
    end_ns: int  # detection, engine clock
    age_s: float
    threshold_s: float


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


def _kv(key: str, value) -> KeyValue:
    if isinstance(value, bool):
        return KeyValue(key=key, value=AnyValue(bool_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    if isinstance(value, float):
        return KeyValue(key=key, value=AnyValue(double_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=str(value)))


def stuck_description(ev: StuckEvent) -> str:
    return f"stuck in {ev.stage} for {ev.age_s:.0f} s (threshold {ev.threshold_s:.0f} s)"


def stuck_resource_spans(events: list[StuckEvent], family_of: Callable[[str], str]) -> list[ResourceSpans]:
    """pd.stuck spans, one resource per cluster (contract section 10)."""
    by_cluster: dict[str, list[Span]] = {}
    for ev in events:
        attrs = [_kv(c.A_ROLE, ev.role), _kv(c.A_STAGE, ev.stage), _kv(c.A_INSTANCE, ev.pd_instance),
                 _kv(c.A_FAMILY, family_of(ev.cluster))]
        if ev.rid:
            attrs.append(_kv(c.A_RID, ev.rid))
        if ev.room is not None:
            attrs.append(_kv(c.A_ROOM, ev.room))
        span = Span(
            trace_id=bytes.fromhex(ev.trace_id),
            span_id=_span_id(),
            name=c.SPAN_STUCK,
            kind=Span.SPAN_KIND_INTERNAL,
            start_time_unix_nano=ev.start_ns,
            end_time_unix_nano=max(ev.end_ns, ev.start_ns),
            attributes=attrs,
            status=Status(code=Status.STATUS_CODE_ERROR, message=stuck_description(ev)),
        )
        if ev.parent_span_id:
            span.parent_span_id = bytes.fromhex(ev.parent_span_id)
        by_cluster.setdefault(ev.cluster, []).append(span)
    return [
        ResourceSpans(
            resource=Resource(attributes=[_kv(c.R_SERVICE_NAME, SERVICE_NAME), _kv(c.R_CLUSTER, cluster)]),
            scope_spans=[ScopeSpans(scope=SCOPE, spans=spans)],
        )
        for cluster, spans in by_cluster.items()
    ]


_rng = random.Random(int.from_bytes(os.urandom(8), "big"))


def _span_id() -> bytes:
    while True:
        sid = _rng.getrandbits(64)
        if sid:
            return sid.to_bytes(8, "big")


def keep_lifecycle(request: ExportTraceServiceRequest) -> int:
    """Remove every span that is not a lifecycle span, in place; returns the spans kept."""
    kept = 0
    for rs in request.resource_spans:
        for ss in rs.scope_spans:
            spans = ss.spans
            # Backwards, deleting by index: usually one heartbeat per batch goes.
            for i in range(len(spans) - 1, -1, -1):
                if spans[i].name not in LIFECYCLE_SPANS:
                    del spans[i]
            kept += len(spans)
    return kept


def _count_spans(request: ExportTraceServiceRequest) -> int:
    return sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)


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
        headers: dict | None = None,
        family_of: Callable[[str], str | None] | None = None,
        offset_of: Callable[[object], int] | None = None,
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
        self.family_of = family_of
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._requests: deque = deque()  # (request, spans in it)
        self._queued_spans = 0
        self._stuck: deque = deque(maxlen=max_stuck_queue)
        self._thread: threading.Thread | None = None
        # Counters, read by ForwardCollector. Written by one thread each, or under _lock.
        self.spans = {(k, r): 0 for k in KINDS for r in RESULTS}
        self.requests_sent = 0
        self.retries = 0
        self.last_error = ""

    # ---- hot paths: append and return --------------------------------------

    def submit(self, request: ExportTraceServiceRequest, raw: bytes | None = None) -> None:
        """Queue a parsed OTLP request (heartbeats are removed later, on the worker).

        `raw` is the request's protobuf body when it holds lifecycle spans only:
        then it is forwarded as it came, with no filtering or re-encoding.
        """
        n = _count_spans(request)
        if not n:
            return
        with self._lock:
            if self._queued_spans + n <= self.max_queue_spans:
                self._requests.append((request if raw is None else raw, n))
                self._queued_spans += n
                self._wake.set()
                return
        # Full: count only what would have been forwarded (rare path, so the scan is affordable).
        dropped = sum(1 for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans
                      if s.name in LIFECYCLE_SPANS)
        with self._lock:
            self.spans[("lifecycle", "dropped")] += dropped

    def on_stuck(self, leg, age_s: float, threshold_s: float, now_ns: int) -> None:
        """Tracker callback, under the tracker lock: copy a few fields, append, return."""
        offset = leg.inc.offset_ns() if leg.inc is not None else 0
        ev = StuckEvent(
            trace_id=leg.trace_id, parent_span_id=leg.span_id, cluster=leg.cluster, role=leg.role,
            stage=leg.stage or "", pd_instance=leg.pd_instance, rid=leg.rid, room=leg.room,
            start_ns=leg.stage_since_ns, end_ns=now_ns - offset, age_s=age_s, threshold_s=threshold_s,
        )
        with self._lock:
            if len(self._stuck) == self._stuck.maxlen:
                self.spans[("stuck", "dropped")] += 1  # the deque drops its oldest
            self._stuck.append(ev)
            self._wake.set()

    # ---- state ---------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        """Spans waiting: lifecycle spans (heartbeats included until the worker strips them) plus pd.stuck."""
        return self._queued_spans + len(self._stuck)

    def start(self) -> "Forwarder":
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

    def _take(self) -> tuple[list[StuckEvent], list[tuple[ExportTraceServiceRequest | bytes, int]]]:
        with self._lock:
            stuck = list(self._stuck)
            self._stuck.clear()
            batch, n = [], 0
            while self._requests and (not batch or n + self._requests[0][1] <= self.max_batch_spans):
                req, k = self._requests.popleft()
                batch.append((req, k))
                n += k
                self._queued_spans -= k
            if not self._requests and not self._stuck:
                self._wake.clear()
        return stuck, batch

    def _run(self) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
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

    def _family(self, cluster: str, cache: dict) -> str:
        if cluster not in cache:
            family = None
            if self.family_of is not None:
                try:
                    family = self.family_of(cluster)
                except Exception:
                    log.exception("diagnosis for pd.stuck failed")
            cache[cluster] = family or UNKNOWN_FAMILY
        return cache[cluster]

    def _forward(self, client: httpx.Client, stuck: list[StuckEvent], batch: list) -> None:
        # Serialized messages concatenate into one whose repeated fields are
        # the union (protobuf's merge rule), so a batch is the requests' bytes
        # joined: no span is copied from one message into another.
        parts, n_stuck, n_life = [], 0, 0
        if stuck:
            cache: dict = {}
            out = ExportTraceServiceRequest(
                resource_spans=stuck_resource_spans(stuck, lambda cl: self._family(cl, cache)))
            parts.append(out.SerializeToString())
            n_stuck = len(stuck)
        for req, n in batch:
            if isinstance(req, bytes):  # lifecycle spans only, as received
                n_life += n
                parts.append(req)
                continue
            kept = keep_lifecycle(req)
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
        return ExportTraceServiceResponse.FromString(response.content).partial_success.rejected_spans
    except Exception:
        return 0


class ForwardCollector:
    """pdwatch_forward_* metrics, built fresh on each scrape."""

    def __init__(self, forwarder: Forwarder):
        self.fwd = forwarder

    def describe(self):
        return []

    def collect(self):
        fwd = self.fwd
        spans = CounterMetricFamily(
            "pdwatch_forward_spans", "Spans forwarded to the trace store, by kind (lifecycle or pd.stuck) and result: "
            "sent, dropped (queue full) or failed (refused, or retries ran out).", labels=["kind", "result"])
        with fwd._lock:
            counts = dict(fwd.spans)
        for (kind, result), n in counts.items():
            spans.add_metric([kind, result], n)
        yield spans
        yield GaugeMetricFamily("pdwatch_forward_queue_depth", "Spans waiting to be forwarded.",
                                value=fwd.queue_depth)
        yield GaugeMetricFamily("pdwatch_forward_queue_capacity_spans", "Most lifecycle spans the queue holds.",
                                value=fwd.max_queue_spans)
        yield CounterMetricFamily("pdwatch_forward_retries", "Retried POSTs to the trace store.", value=fwd.retries)
        yield CounterMetricFamily("pdwatch_forward_requests", "POSTs the trace store accepted.",
                                  value=fwd.requests_sent)


def diagnosed_family(sidecar, cluster: str) -> str | None:
    """The family the sidecar's diagnosis currently names for a cluster (None when healthy or unknown)."""
    for v in sidecar.diagnosis():
        if v.get("cluster") == cluster:
            return v.get("family")
    return None


def from_settings(sidecar) -> Forwarder | None:
    """The sidecar's forwarder when PDWATCH_FORWARD_OTLP_ENDPOINT is set; tests tune it via settings.extra['forward']."""
    endpoint = sidecar.settings.forward_otlp_endpoint
    if not endpoint:
        return None
    return Forwarder(endpoint, family_of=lambda cluster: diagnosed_family(sidecar, cluster),
                     **sidecar.settings.extra.get("forward", {}))
