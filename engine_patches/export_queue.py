"""Spans waiting for export, and their posting, both on the recorder's worker thread.

The worker asks for a span slot and fills it in place; at each wake-up,
after draining and maybe a heartbeat, it seals what it added into one
serialized request (so the resource is copied and encoded once a wake-up,
not once a span) and posts what is sealed, joined: serialized protobuf
messages concatenate into their merge. One thread, one
wake-up per drain interval: each wake-up of a thread in the engine process
takes the GIL from a busy scheduler thread, which on a loaded machine can
wait a whole OS time slice for the waker to run, so the recorder wakes
rarely and does everything at once. A post that blocks (a slow sidecar)
holds up only the worker: the hot path keeps appending to its bounded
buffer. Past `max_queue` spans waiting a slot is refused and the span
dropped, counted. A failed request is not retried: telemetry must not pile
up behind a sidecar that is down, and the next heartbeat's inventory tells
the sidecar what is still open.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING

from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from . import otlp
from .otlp_http import Transport

if TYPE_CHECKING:
    from google.protobuf.internal.containers import RepeatedCompositeFieldContainer
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

log = logging.getLogger("pdwatch.recorder")


class ExportQueue:
    """Not thread-safe: the recorder fills and seals under its drain lock and posts under its post lock."""

    def __init__(self, resource: Resource, transport: Transport, *, max_queue: int, max_batch: int = 512) -> None:
        self.resource = resource
        self.transport = transport
        self.max_queue = max_queue
        self.max_batch = min(max_batch, max_queue)
        self.queued = 0
        self.dropped = 0
        self.taken = 0
        self.sent = 0
        self.failed_spans = 0
        self.failed_batches = 0
        self._open: ExportTraceServiceRequest | None = None
        self._open_spans: RepeatedCompositeFieldContainer[Span] | None = None
        self._open_count = 0
        self._sealed: deque[tuple[int, bytes]] = deque()  # (spans, serialized request)

    @property
    def waiting(self) -> int:
        """Spans added and not yet posted (or failed)."""
        return self.queued - self.taken

    def slot(self) -> Span | None:
        """A new, empty span to fill in place; None when the queue is full (the span is dropped, counted)."""
        if self.queued - self.taken >= self.max_queue:
            self.dropped += 1
            return None
        if self._open_spans is None:
            self._open, self._open_spans = otlp.new_request(self.resource)
        self.queued += 1
        self._open_count += 1
        span: Span = self._open_spans.add()
        return span

    def seal(self) -> None:
        """Close the request being filled: it is posted with the next `post()`."""
        if self._open is None:
            return
        self._sealed.append((self._open_count, self._open.SerializeToString()))
        self._open, self._open_spans, self._open_count = None, None, 0

    def post(self, deadline: float | None = None) -> bool:
        """Post everything sealed, up to `max_batch` spans a request, until `deadline` (monotonic);
        count what failed. False if the deadline left some unposted."""
        sealed = self._sealed
        while sealed:
            if deadline is not None and time.monotonic() > deadline:
                return False
            n, parts = 0, []
            while sealed and n < self.max_batch:
                count, body = sealed.popleft()
                n += count
                parts.append(body)
            try:
                self.transport.post(b"".join(parts))
                self.sent += n
            except Exception as e:  # a transport must never take the worker down
                self.failed_spans += n
                self.failed_batches += 1
                log.debug("pdwatch export of %d spans failed: %s", n, e)
            self.taken += n
        return True
