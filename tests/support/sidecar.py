"""The sidecar's test parts, shared by the tests and the benches: a fake clock, an engine whose
OTLP requests are kept in memory, and the real app under uvicorn on a loopback port."""

from __future__ import annotations

import threading
import time

from pdwatch.engine_patches.otlp_http import MemoryTransport
from pdwatch.engine_patches.recorder import Recorder, RecorderConfig
from pdwatch.sidecar.tracker import Tracker
from pdwatch.testbed.processes import free_port
from tests.support.otlp_spans import one_request
from tests.support.tracking import ingest

T0 = 1_800_000_000_000_000_000


class FakeClock:
    def __init__(self, start_ns: int = T0):
        self.now = start_ns

    def __call__(self) -> int:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += int(seconds * 1e9)


class Engine:
    """One engine process as the sidecar sees it: a recorder whose spans are handed over on demand."""

    def __init__(self, role: str, instance: str, clock, *, cluster: str = "default", tp_rank: int = 0,
                 tp_size: int = 1, heartbeat_s: float = 1.0, **cfg):
        self.transport = MemoryTransport()
        self.clock = clock
        self.rec = Recorder(
            RecorderConfig(role=role, instance=instance, cluster=cluster, heartbeat_s=heartbeat_s, tp_rank=tp_rank,
                           tp_size=tp_size, **cfg),
            transport=self.transport, clock=clock, environ={},
        )

    def request(self, heartbeat: bool = False):
        """Everything recorded so far (plus a heartbeat) as one OTLP request."""
        self.rec.drain()
        if heartbeat:
            self.rec.heartbeat()
        self.rec.flush()
        return one_request(self.transport)

    def send(self, tracker: Tracker, heartbeat: bool = True):
        return ingest(tracker, self.request(heartbeat))

    def walk(self, rid: str, room: int, stages, **arrive):
        self.rec.arrive(rid, bootstrap_room=room, **arrive)
        for stage in stages:
            self.rec.enter(rid, stage)


class LiveSidecar:
    """The real app under a real uvicorn server on a loopback port, in this process (so tests can read state)."""

    def __init__(self, settings, clock=time.time_ns, **options):
        import uvicorn

        from pdwatch.sidecar.app import create_app

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(settings, clock=clock, **options)
        self.sidecar = self.app.state.sidecar
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)

    def judge_now(self):
        """The judge's tick at once (a fake clock moved): what the API shows next."""
        return self.sidecar.judge_now()

    def read(self, fn, *args):
        """fn(*args) on the tracker's thread: tests read its state where ingest writes it."""
        return self.sidecar.worker.call(fn, *args)
