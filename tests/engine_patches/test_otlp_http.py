"""The recorder's OTLP/HTTP transport against real loopback servers."""

from __future__ import annotations

import socket
import threading

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from pdwatch.engine_patches.config import RecorderConfig
from pdwatch.engine_patches.otlp_http import ExportError, HttpTransport
from tests.support.otlp_receiver import OtlpReceiver

BODY = ExportTraceServiceRequest().SerializeToString()


class ClosingServer:
    """HTTP/1.1 that answers one request per connection, says keep-alive, then hangs up:
    what an exporter meets when the server closed an idle kept-alive connection."""

    def __init__(self, connections: int):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.sock.settimeout(10)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1/traces"
        self.accepted = 0
        self.requests: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, args=(connections,), daemon=True)
        self.thread.start()

    def _serve(self, connections: int) -> None:
        for _ in range(connections):
            conn, _ = self.sock.accept()
            self.accepted += 1
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                self.requests.append(data.split(b"\r\n", 1)[0])
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: keep-alive\r\n\r\n")
        self.sock.close()


def test_a_connection_the_server_closed_is_replaced_once_and_the_request_sent():
    server = ClosingServer(connections=2)
    t = HttpTransport(server.url, timeout_s=5)
    t.post(BODY)
    server.thread.join(0.2)  # the server has hung up by now
    t.post(BODY)  # the kept-alive connection is stale: sent again on a new one
    server.thread.join(5)
    assert server.accepted == 2
    assert server.requests == [b"POST /v1/traces HTTP/1.1"] * 2
    t.close()


def test_refused_unreachable_and_non_2xx_raise_export_error():
    with OtlpReceiver(script=[(503, {"Retry-After": "1"})]) as receiver:
        t = HttpTransport(f"{receiver.url}/v1/traces", timeout_s=5)
        with pytest.raises(ExportError, match="HTTP 503"):
            t.post(BODY)
        t.post(BODY)  # the script is spent: taken
        assert len(receiver.requests) == 1
        t.close()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nobody listens there now
    with pytest.raises(ExportError, match="ConnectionRefused"):
        HttpTransport(f"http://127.0.0.1:{port}/v1/traces", timeout_s=1).post(BODY)


def test_endpoint_must_be_http_and_headers_come_from_the_otlp_variables():
    with pytest.raises(ValueError, match="not an http"):
        HttpTransport("127.0.0.1:4318/v1/traces", timeout_s=1)
    env = {"OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20abc,x-team=pd"}
    assert RecorderConfig(role="decode").resolved(env).headers == {"authorization": "Bearer abc", "x-team": "pd"}
    # The traces-only variable wins over the general one; an explicit argument over both.
    env["OTEL_EXPORTER_OTLP_TRACES_HEADERS"] = "authorization=Bearer%20t"
    assert RecorderConfig(role="decode").resolved(env).headers == {"authorization": "Bearer t"}
    assert RecorderConfig(role="decode", headers={}).resolved(env).headers == {}
    env["OTEL_EXPORTER_OTLP_CERTIFICATE"] = "ca.pem"
    assert RecorderConfig(role="decode").resolved(env).certificate == "ca.pem"
    assert RecorderConfig(role="decode").resolved(env).compression == "none"
    assert RecorderConfig(role="decode").resolved({"OTEL_EXPORTER_OTLP_COMPRESSION": "GZIP"}).compression == "gzip"
    with pytest.raises(ValueError, match="not none or gzip"):
        RecorderConfig(role="decode").resolved({"OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "zstd"})


def test_gzip_bodies_arrive_whole():
    request = ExportTraceServiceRequest()
    request.resource_spans.add().scope_spans.add().spans.add(name="pd.heartbeat")
    with OtlpReceiver() as receiver:
        t = HttpTransport(f"{receiver.url}/v1/traces", timeout_s=5, compression="gzip")
        t.post(request.SerializeToString())
        assert receiver.requests == [request]
        t.close()
