"""An OTLP/HTTP trace receiver for tests, standing in for a trace store or a
collector: decodes every POST to /v1/traces (protobuf, optionally gzip) and
keeps it; can answer from a script first (503 with Retry-After, ...)."""

from __future__ import annotations

import gzip
import ssl
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

MAX_REQUESTS = 20_000  # bounded: a long test keeps only the newest


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attrs: dict
    resource: dict
    status_code: int


class OtlpReceiver:
    def __init__(self, script=(), tls: tuple[str, str] | None = None):
        """tls: (certificate file, key file) to serve https instead of http."""
        self.script = list(script)  # (status, headers) answered, in order, before the first 200
        self.posts: list[tuple[float, bytes]] = []  # (monotonic arrival, raw body) of every POST
        self.headers: list[dict[str, str]] = []  # each POST's request headers, names lower-cased
        self.requests: list[ExportTraceServiceRequest] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                with outer.lock:
                    outer.posts.append((time.monotonic(), body))
                    del outer.posts[:-MAX_REQUESTS]
                    outer.headers.append({k.lower(): v for k, v in self.headers.items()})
                    del outer.headers[:-MAX_REQUESTS]
                    answer = outer.script.pop(0) if outer.script else None
                if self.path != "/v1/traces" or self.headers.get("content-type") != "application/x-protobuf":
                    answer = (400, {})
                if answer is not None:
                    self.send_response(answer[0])
                    for k, v in answer[1].items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest.FromString(body)
                with outer.lock:
                    outer.requests.append(request)
                    del outer.requests[:-MAX_REQUESTS]
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                pass  # an exporter hanging up at shutdown is not a test failure

        self.server = Server(("127.0.0.1", 0), Handler)
        scheme = "http"
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
            scheme = "https"
        self.url = f"{scheme}://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()

    def spans(self) -> list:
        """(resource attributes, span message) for every span received so far."""
        with self.lock:
            requests = list(self.requests)
        out = []
        for req in requests:
            for rs in req.resource_spans:
                res = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
                out.extend((res, s) for ss in rs.scope_spans for s in ss.spans)
        return out

    def named(self, name: str) -> list[Span]:
        return [
            Span(name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                 parent_span_id=s.parent_span_id.hex(), start_ns=s.start_time_unix_nano,
                 end_ns=s.end_time_unix_nano, attrs={kv.key: _value(kv.value) for kv in s.attributes},
                 resource=res, status_code=s.status.code)
            for res, s in self.spans() if s.name == name
        ]

    def heartbeats(self, instance: str) -> list[Span]:
        return [s for s in self.named("pd.heartbeat") if s.resource.get("pd.instance") == instance]

    def last_heartbeat(self, instance: str) -> Span | None:
        beats = self.heartbeats(instance)
        return max(beats, key=lambda s: s.end_ns) if beats else None

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> OtlpReceiver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
