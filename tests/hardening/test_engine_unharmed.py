"""Engine unharmed: with the sidecar down, slow, or refusing (a real sidecar
over its memory limit answers 503), a real recorder exporting over OTLP/HTTP
keeps its queues within their bounds and counts what it drops; nothing raises
into the engine. (What it costs the scheduler thread is a timing claim:
bench/recorder_unharmed.py measures it against a healthy sidecar.)"""

from __future__ import annotations

import http.server
import threading
import time

import pytest

from pdwatch import contract as c
from pdwatch.engine_patches.recorder import Recorder, RecorderConfig
from pdwatch.testbed.sidecar_process import free_port

BUFFER_MAX, EXPORT_QUEUE = 2_000, 256


class SlowHandler(http.server.BaseHTTPRequestHandler):
    """Reads the request, then answers only after the exporter has given up."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        time.sleep(2.0)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def sidecar_endpoint(request, live_sidecar):
    mode = request.param
    if mode == "down":
        yield mode, f"http://127.0.0.1:{free_port()}"
    elif mode == "slow":
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SlowHandler)
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        yield mode, f"http://127.0.0.1:{server.server_address[1]}"
        server.shutdown()
        server.server_close()
    else:  # refusing: the real sidecar, over a memory limit no process is under
        sc = live_sidecar(max_rss_bytes=1)
        yield mode, sc.url
        assert sc.sidecar.guard.refused["memory"] > 0
        assert not sc.sidecar.tracker.open


@pytest.mark.parametrize("sidecar_endpoint", ["down", "slow", "refusing"], indirect=True)
def test_queues_stay_bounded_and_drops_are_counted(sidecar_endpoint):
    mode, endpoint = sidecar_endpoint
    rec = Recorder(RecorderConfig(role="prefill", instance=f"unharmed-{mode}", endpoint=endpoint, heartbeat_s=0.2,
                                  buffer_max=BUFFER_MAX, max_export_queue=EXPORT_QUEUE, export_timeout_s=0.3),
                   environ={}).start()
    peak_buf = peak_queue = 0
    try:
        deadline = time.monotonic() + 3.0
        i = 0
        while time.monotonic() < deadline and i < 20_000:  # bounded in count and time
            rid = f"r-{i}"
            rec.arrive(rid, bootstrap_room=i)
            for stage in ("bootstrap", "queued", "prefill", "transfer"):
                rec.enter(rid, stage)
            rec.finish(rid)
            i += 1
            if i % 50 == 0:
                peak_buf = max(peak_buf, len(rec._buf))
                peak_queue = max(peak_queue, rec.export.waiting)
        time.sleep(0.5)
        stats = rec.stats()
        hb = rec.heartbeat_attributes()
    finally:
        rec.shutdown(timeout_s=1)
    assert i > 1000
    assert peak_buf <= BUFFER_MAX and peak_queue <= EXPORT_QUEUE
    assert stats["hook_errors"] == 0 and stats["worker_errors"] == 0
    # No sidecar took anything: spans were exported and failed, or dropped at the full queue, and counted.
    # Which of the two depends on the machine's pace (CI once saw no failed export before the end of a
    # "down" run: every batch still in its retry), so the test asks for what the comment says: either.
    assert stats["spans_dropped"] + stats["export_failed_spans"] > 0, stats
    assert hb[c.H_QUEUE_DROPPED] == stats["spans_dropped"]
    assert hb["pdwatch.recorder.dropped"] == stats["dropped"]
