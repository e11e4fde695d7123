"""Sidecar ingest rate with forwarding on, against the same with it off, in one run.

The same OTLP/HTTP bodies as bench/ingest_rate.py (the engine recorder's own
spans, 512 per request) are POSTed one at a time over a keep-alive loopback
connection to a real `pdwatch serve` (its own process):

  off  no forward endpoint;
  on   PDWATCH_FORWARD_OTLP_ENDPOINT at an OTLP/HTTP receiver in a process of
       its own, which stores the bodies and decodes them after the timing.

Rounds alternate off/on and the best of each is kept. After the "on" rounds the
receiver's span count is compared with what the sidecar says it sent, and the
forwarder's drops and failures are printed. Goal: forwarding costs ingest at
most 20% (on >= 0.8x off).

    python bench/ingest_forwarding.py [--requests 120] [--rounds 2]
"""

from __future__ import annotations

import argparse
import ast
import logging
import subprocess
import sys
import time

import httpx
from ingest_rate import build_bodies  # same directory: run as a script
from prometheus_client.parser import text_string_to_metric_families

from pdwatch import contract as c
from pdwatch.testbed.sidecar_process import SidecarProcess

RECEIVER = r"""
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

bodies = []

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):  # store now, decode when asked: the timing pays for the receipt only
        bodies.append(self.rfile.read(int(self.headers.get("content-length", 0))))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):
        counts = {}
        for body in bodies:
            for rs in ExportTraceServiceRequest.FromString(body).resource_spans:
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        counts[span.name] = counts.get(span.name, 0) + 1
        out = repr(counts).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass

server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


class Receiver:
    """An OTLP/HTTP receiver in its own process (so it does not share this client's interpreter)."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{int(self.proc.stdout.readline())}"

    def spans(self) -> tuple[int, int]:
        """(lifecycle spans, heartbeats) received."""
        counts = ast.literal_eval(httpx.get(self.url, timeout=60).text)
        beats = counts.pop(c.SPAN_HEARTBEAT, 0)
        return sum(counts.values()), beats

    def close(self):
        self.proc.terminate()
        self.proc.wait(10)


WATCHED = {m.series for m in (*c.FORWARD_METRICS, c.SPANS_RECEIVED)}


def metrics(client: httpx.Client) -> dict:
    out = {}
    for fam in text_string_to_metric_families(client.get("/metrics").text):
        for s in fam.samples:
            if s.name in WATCHED:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def one_round(bodies: list[bytes], spans_total: int, forward_to: str | None) -> tuple[float, dict]:
    env = {c.ENV_LOG_LEVEL: "warning", c.ENV_NVML: "off"}
    if forward_to:
        env[c.ENV_FORWARD] = forward_to
    with SidecarProcess(env=env) as sc:
        headers = {"Content-Type": "application/x-protobuf"}
        with httpx.Client(base_url=sc.url, timeout=30) as client:
            client.post("/v1/traces", content=bodies[0], headers=headers).raise_for_status()  # warm-up
            t = time.perf_counter()
            for body in bodies:
                client.post("/v1/traces", content=body, headers=headers).raise_for_status()
            elapsed = time.perf_counter() - t
            seen = metrics(client)
            deadline = time.monotonic() + 30  # let the forwarder drain before the sidecar stops
            while forward_to and time.monotonic() < deadline and seen.get((c.FORWARD_QUEUE_DEPTH.series, ())):
                time.sleep(0.1)
                seen = metrics(client)
    return spans_total / elapsed, seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--spans-per-request", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2, help="off/on pairs; the best of each is kept")
    args = ap.parse_args()
    logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)
    bodies, spans_total = build_bodies(args.requests, args.spans_per_request)
    print(f"{len(bodies)} OTLP/HTTP bodies, {spans_total} spans, "
          f"{sum(map(len, bodies)) / len(bodies) / 1024:.0f} KiB each")
    off_best = on_best = 0.0
    last_on: dict = {}
    receivers = []
    for _ in range(args.rounds):
        off, _ = one_round(bodies, spans_total, None)
        rcv = Receiver()
        receivers.append(rcv)
        on, last_on = one_round(bodies, spans_total, rcv.url)
        off_best, on_best = max(off_best, off), max(on_best, on)
        print(f"  round: off {off:9.0f} spans/s   on {on:9.0f} spans/s")
    print(f"forwarding off: POST /v1/traces                {off_best:10.0f} spans/s")
    print(f"forwarding on:  same, forwarder sending         {on_best:10.0f} spans/s   ({on_best / off_best:.2f}x off)")
    life, beats = receivers[-1].spans()
    for rcv in receivers:
        rcv.close()
    fwd = {dict(k[1]).get("result") + "/" + dict(k[1]).get("kind"): v for k, v in last_on.items()
           if k[0] == c.FORWARD_SPANS.series}
    sent = fwd.get("sent/lifecycle", 0)
    print(f"last 'on' round: receiver got {life} lifecycle spans and {beats} heartbeats; sidecar counted "
          f"sent {sent:.0f}, dropped {fwd.get('dropped/lifecycle', 0):.0f}, failed {fwd.get('failed/lifecycle', 0):.0f}, "
          f"{last_on.get((c.FORWARD_REQUESTS.series, ()), 0):.0f} POSTs")
    print(f"goal (on >= 0.8x off): {'met' if on_best / off_best >= 0.8 else 'NOT met'}")


if __name__ == "__main__":
    main()
