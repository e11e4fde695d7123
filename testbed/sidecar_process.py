"""Start a sidecar as a child process on a free loopback port and talk to it.

Used by the demo and the integration tests, so both exercise the real sidecar
process (`python -m pdwatch.sidecar`, what `pdwatch serve` runs) under uvicorn
rather than an in-process app.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx

from .processes import free_port


class SidecarProcess:
    def __init__(self, *, port: int | None = None, env: dict[str, str] | None = None, args: Sequence[str] = ()):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._env = {**os.environ, **(env or {})}
        self._args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = httpx.Client(base_url=self.url, timeout=5.0)

    def start(self, timeout_s: float = 30.0) -> SidecarProcess:
        cmd = [sys.executable, "-m", "pdwatch.sidecar", "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd + self._args, env=self._env, stdin=subprocess.DEVNULL)
        atexit.register(self.stop)  # a caller that dies on an exception must not leave the sidecar running
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sidecar exited with status {self.proc.returncode} before it was ready")
            try:
                if self.client.get("/healthz").status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"sidecar not ready on {self.url} after {timeout_s:.0f} s")

    def get(self, path: str, **kw: Any) -> Any:
        """GET path's JSON; an error status raises."""
        r = self.client.get(path, **kw)
        r.raise_for_status()
        return r.json()

    def stop(self) -> None:
        self.client.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> SidecarProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
