"""A tiny OTLP/HTTP trace receiver for tests: decodes what engines send, keeps it."""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

MAX_SPANS = 200_000


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


class OtlpSink:
    def __init__(self):
        self.spans: list[Span] = []
        self.requests = 0
        self.lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                sink._add(req)
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
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)

    def _add(self, req) -> None:
        batch = []
        for rs in req.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    batch.append(Span(
                        name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(), start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano, attrs={kv.key: _value(kv.value) for kv in s.attributes},
                        resource=resource, status_code=s.status.code,
                    ))
        with self.lock:
            self.requests += 1
            self.spans.extend(batch)
            del self.spans[:-MAX_SPANS]

    def named(self, name: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.name == name]

    def heartbeats(self, instance: str) -> list[Span]:
        return [s for s in self.named("pd.heartbeat") if s.resource.get("pd.instance") == instance]

    def last_heartbeat(self, instance: str) -> Span | None:
        beats = self.heartbeats(instance)
        return max(beats, key=lambda s: s.end_ns) if beats else None

    def __enter__(self) -> "OtlpSink":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
