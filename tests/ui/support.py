"""What the UI tests and bench/ui_render.py share: a live sidecar with the /ui router, a real
incident fed to it through real recorders under a fake clock, and headless Chromium.

The incident: a prefill (prefill-0) and two decodes (decode-0, decode-1), each on an
emulated GPU behind the NVML stub. Requests alternate between the decodes and finish
within a second. At RESTART_AT decode-0 restarts alone: the request it held at the kill
leaves a prefill leg in `transfer` towards a peer that is gone (stuck on evidence), and
every later request routed to it hangs in `transfer` on both legs (stuck past the
threshold), its GPU idle, while decode-1 keeps serving: stuck while others flow. One simulated second per step, each engine
heartbeats, the GPU sampler takes one pass and the judge one tick, so the history
the page and the report plot has one sample per second.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx

from pdwatch.sidecar.settings import Settings
from tests.support.sidecar import Engine, FakeClock, LiveSidecar

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "build" / "test-artifacts"
PB = {"content-type": "application/x-protobuf"}
PREFILL = ("bootstrap", "queued", "prefill", "transfer")
UUIDS = ("GPU-5c1e0a77-0000-4000-8000-00000000aa01", "GPU-5c1e0a77-0000-4000-8000-00000000aa02",
         "GPU-5c1e0a77-0000-4000-8000-00000000aa03")
RESTART_AT = 40  # simulated seconds
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


def start_sidecar(clock, *, nvml_library: str | None = None, **settings) -> LiveSidecar:
    """The real app (the /ui router included) and uvicorn on a loopback port."""
    settings.setdefault("gpu_interval_s", 3600.0)  # the incident samples by hand, once per simulated second
    settings.setdefault("evaluate_interval_s", 3600.0)  # and ticks the judge by hand
    sc = LiveSidecar(Settings(**settings), clock=clock, nvml_library=nvml_library)
    logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)
    return sc.__enter__()


def stub_library() -> str | None:
    """The NVML stub (make nvml-stub), built here when missing; None when it cannot be."""
    from pdwatch.testbed.gpu_emulation import STUB_LIBRARY

    if not STUB_LIBRARY.is_file():
        subprocess.run(["make", "-s", "nvml-stub"], cwd=REPO, check=False, capture_output=True)
    return str(STUB_LIBRARY) if STUB_LIBRARY.is_file() else None


class Incident:
    """Feeds the incident above to `sc`, step by step; `gpus` (a GpuEmulator) is optional."""

    def __init__(self, sc: LiveSidecar, clock: FakeClock, gpus=None, token: str | None = None,
                 restart_at: int = RESTART_AT):
        self.sc, self.clock, self.gpus, self.restart_at = sc, clock, gpus, restart_at
        headers = {**PB, **({"authorization": f"Bearer {token}"} if token else {})}
        self.http = httpx.Client(base_url=sc.url, headers=headers, timeout=10)
        self.prefill = self._engine("prefill", "prefill-0", 0)
        self.decodes = [self._engine("decode", "decode-0", 1), self._engine("decode", "decode-1", 2)]
        self.t = 0
        self.room = 0
        self.hung: list[str] = []  # trace ids of the requests that hang
        self.restart_unix_s: float | None = None
        self.finished_ok = 0
        self._next_step: float | None = None  # monotonic time of the next paced step

    def _engine(self, role: str, instance: str, gpu: int) -> Engine:
        # Each process's KV agent has a name of its own (a restart brings a new one): what peers call it.
        self.agents = getattr(self, "agents", 0) + 1
        agent = f"{instance}@nixl-{self.agents}"
        e = Engine(role, instance, self.clock, gpu_uuids=(UUIDS[gpu],), peer_ids=(agent, f"{instance}:8998"))
        e.agent = agent
        return e

    def trace_id(self, room: int) -> str:
        from pdwatch import contract as c

        return f"{c.room_trace_id(room):032x}"

    def _request(self, decode: Engine, hang: bool) -> None:
        """One request over both legs, 0.4 simulated seconds of it unless it hangs in transfer."""
        room, self.room = self.room, self.room + 1
        p, d, tick = self.prefill, decode, self.clock.advance
        p.rec.arrive(f"p-{room}", bootstrap_room=room, prompt_tokens=512, peer=d.agent)
        d.rec.arrive(f"d-{room}", bootstrap_room=room, prompt_tokens=512, peer="prefill-0")
        p.rec.enter(f"p-{room}", "bootstrap")
        d.rec.enter(f"d-{room}", "bootstrap")
        tick(0.04)
        p.rec.enter(f"p-{room}", "queued")
        tick(0.03)
        p.rec.enter(f"p-{room}", "prefill")
        tick(0.08)
        d.rec.enter(f"d-{room}", "transfer")
        p.rec.enter(f"p-{room}", "transfer")
        if hang:
            self.hung.append(self.trace_id(room))
            return
        tick(0.05)
        p.rec.finish(f"p-{room}")
        d.rec.enter(f"d-{room}", "queued")
        tick(0.02)
        d.rec.enter(f"d-{room}", "decode")
        tick(0.18)
        d.rec.token(f"d-{room}", 8)
        d.rec.finish(f"d-{room}", output_tokens=8)
        self.finished_ok += 2

    def _restart_decode0(self) -> None:
        old = self.decodes[0]
        old.rec.shutdown(timeout_s=1)
        self.decodes[0] = self._engine("decode", "decode-0", 1)
        self.restart_unix_s = self.clock.now / 1e9

    def _gpus(self) -> None:
        if self.gpus is None:
            return
        wedged = self.t >= self.restart_at
        wave = math.sin(self.t / 6)  # a little drift, as real load has
        with self.gpus.batch():
            self.gpus.busy(0, 0.6 + 0.05 * wave)
            if wedged:
                self.gpus.idle(1)
            else:
                self.gpus.busy(1, 0.82 + 0.04 * wave)
            self.gpus.busy(2, 0.86 + 0.04 * wave if wedged else 0.8 + 0.04 * wave)
        self.sc.sidecar.gpu.sample_once()

    def step(self) -> None:
        """One simulated second: two requests (one to each decode), heartbeats, a GPU pass, a judge tick."""
        if self.t == self.restart_at:
            self._restart_decode0()
        start = self.clock.now
        for decode in self.decodes:
            # Requests on decode-0 hang from one second before its restart: those it held at the kill
            # leave their prefill legs talking to a peer that is gone; later ones hang on the new process.
            self._request(decode, hang=decode is self.decodes[0] and self.t >= self.restart_at - 1)
        self.clock.now = start + 950_000_000
        for e in (self.prefill, *self.decodes):
            e.rec.loop_tick()
            r = self.http.post("/v1/traces", content=e.request(heartbeat=True).SerializeToString())
            r.raise_for_status()
        self._gpus()
        self.clock.advance(0.05)
        self.sc.judge_now()
        self.t += 1

    def run(self, seconds: int, pace_s: float | None = None) -> Incident:
        """`seconds` steps; with `pace_s`, one step every `pace_s` real seconds, the fake clock kept on
        the real one (for a Prometheus that stamps samples with its own clock)."""
        for _ in range(seconds):
            if pace_s is not None:
                self._next_step = self._next_step or time.monotonic()
                time.sleep(max(0.0, self._next_step - time.monotonic()))
                self._next_step += pace_s
                self.clock.now = max(self.clock.now, time.time_ns())
            self.step()
        return self

    def close(self) -> None:
        self.http.close()
        for e in (self.prefill, *self.decodes):
            e.rec.shutdown(timeout_s=1)


def feed_stuck_legs(sc: LiveSidecar, clock: FakeClock, n: int, token: str | None = None) -> None:
    """`n` prefill legs hung in transfer past its floor, and one that finished (others flow): n stuck legs."""
    chunk = 2048
    e = Engine("prefill", "prefill-0", clock, inventory_max=chunk, max_export_queue=1 << 20, buffer_max=1 << 22,
               max_open_legs=n + chunk)
    headers = {**PB, **({"authorization": f"Bearer {token}"} if token else {})}
    try:
        with httpx.Client(base_url=sc.url, headers=headers, timeout=60) as http:
            for start in range(0, n, chunk):
                for i in range(start, min(n, start + chunk)):
                    e.walk(f"p-{i}", i, PREFILL, prompt_tokens=256, peer=f"decode-{i % 4}")
                http.post("/v1/traces", content=e.request(heartbeat=True).SerializeToString()).raise_for_status()
            e.walk("p-ok", n, PREFILL)
            e.rec.finish("p-ok")
            clock.advance(20)
            e.rec.loop_tick()
            e.rec.drain()
            e.rec.heartbeat()
            e.rec.flush()
            http.post("/v1/traces", content=e.request().SerializeToString()).raise_for_status()
        sc.judge_now()
    finally:
        e.rec.shutdown(timeout_s=1)


def chrome(width: int = 1400, height: int = 1000, headers: dict | None = None):
    """Headless Debian Chromium through Debian's chromedriver; Selenium Manager is never asked."""
    os.environ["SE_OFFLINE"] = "true"  # selenium: never download a browser or a driver
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--hide-scrollbars", "--no-first-run",
                "--disable-extensions", "--disable-background-networking"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(30)
    if headers:
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": headers})
    return driver


def wait_rendered(driver, renders: int = 1, timeout_s: float = 20.0) -> None:
    """Until the page has finished `renders` full renders (the marker it sets on <html>)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        n = driver.execute_script("return Number(document.documentElement.dataset.renders || 0)")
        if n >= renders:
            return
        time.sleep(0.05)
    errors = driver.execute_script("return (window.pdwatchUI && window.pdwatchUI.errors) || []")
    raise AssertionError(f"the page did not render {renders} time(s) within {timeout_s} s; errors: {errors}")
