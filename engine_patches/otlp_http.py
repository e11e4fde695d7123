"""Where export requests go: OTLP/HTTP over one kept-alive connection, or memory.

A transport has one job, `post(body)`: send one serialized
ExportTraceServiceRequest, return when it was taken, raise ExportError when it
was not. Only the export thread calls it. The HTTP one is the standard
library's client rather than the OTLP exporter's `requests` session: both are
a POST of the same protobuf body, and this one costs the engine's GIL a
fraction as much per request (bench/recorder_cost.py). It honours the OTLP
exporter's header, certificate and compression variables (resolved in config.py).
"""

from __future__ import annotations

import gzip
import http.client
import ssl
import threading
import urllib.parse
from collections.abc import Mapping
from typing import Protocol

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class ExportError(Exception):
    """A request the receiver did not take (refused, timed out, not 2xx)."""


class Transport(Protocol):
    def post(self, body: bytes) -> None: ...

    def close(self) -> None: ...


# A kept-alive connection the server closed while idle fails like this on its
# next use; the request is sent once more, on a new connection.
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


class HttpTransport:
    def __init__(self, url: str, *, timeout_s: float, headers: Mapping[str, str] | None = None,
                 cafile: str | None = None, compression: str = "none") -> None:
        if compression not in ("none", "gzip"):
            raise ValueError(f"OTLP compression must be none or gzip, not {compression!r}")
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"OTLP endpoint {url!r} is not an http:// or https:// URL")
        self.url = url
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        self._path = parts.path or "/"
        self._timeout_s = timeout_s
        self._cafile = cafile
        self._gzip = compression == "gzip"
        self._headers = {"Content-Type": "application/x-protobuf", **(headers or {})}
        if self._gzip:
            self._headers["Content-Encoding"] = "gzip"
        self._conn: http.client.HTTPConnection | None = None

    def _connect(self) -> http.client.HTTPConnection:
        if self._https:
            return http.client.HTTPSConnection(self._host, self._port, timeout=self._timeout_s,
                                               context=ssl.create_default_context(cafile=self._cafile))
        return http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_s)

    def post(self, body: bytes) -> None:
        if self._gzip:
            body = gzip.compress(body, compresslevel=1)  # spans compress well at the cheapest level
        for _ in range(2):
            fresh = self._conn is None
            conn = self._conn = self._conn or self._connect()
            try:
                conn.request("POST", self._path, body=body, headers=self._headers)
                resp = conn.getresponse()
                text = resp.read()
            except _STALE as e:
                self.close()
                if fresh:
                    raise ExportError(f"{type(e).__name__}: {e}") from None
                continue
            except (OSError, http.client.HTTPException) as e:
                self.close()
                raise ExportError(f"{type(e).__name__}: {e}") from None
            if resp.will_close:
                self.close()
            if 200 <= resp.status < 300:
                return
            raise ExportError(f"HTTP {resp.status}: {text[:200]!r}")

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class MemoryTransport:
    """Keeps every request instead of sending it: for tests, and for a process without a sidecar."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self._lock = threading.Lock()

    def post(self, body: bytes) -> None:
        with self._lock:
            self.bodies.append(body)

    def take(self) -> list[bytes]:
        """The bodies kept so far, forgotten here."""
        with self._lock:
            bodies, self.bodies = self.bodies, []
        return bodies

    def requests(self) -> list[ExportTraceServiceRequest]:
        with self._lock:
            bodies = list(self.bodies)
        return [ExportTraceServiceRequest.FromString(b) for b in bodies]

    def close(self) -> None:
        pass
