"""What an operator asks of a live SGLang PD stack over HTTP: the router's workers, and a server's load.

sglang-router 0.3.2 keeps its workers in a registry it serves at `/workers`:
`GET` lists them (`id`, `url`, `worker_type`, `is_healthy`, ...), `POST` with
`{"url", "worker_type"}` adds one and `DELETE /workers/{id}` removes one; both
are jobs the router runs in the background, so each call here waits until
the listing shows the change. A server's `/v1/loads` says what its scheduler
holds: running and waiting requests, and in PD mode its bootstrap, inflight,
prealloc and transfer queues.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable
from typing import Any

Json = Any


class ControlError(RuntimeError):
    pass


def call(port: int, method: str, path: str, body: Json = None, timeout_s: float = 30.0) -> tuple[int, Json]:
    """One HTTP call on loopback: (status, the JSON answer or the text)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read().decode(errors="replace")
    finally:
        conn.close()
    try:
        return resp.status, json.loads(text)
    except ValueError:
        return resp.status, text


class RouterWorkers:
    """The worker registry of one SGLang router."""

    def __init__(self, port: int, *, timeout_s: float = 60.0):
        self.port = port
        self.timeout_s = timeout_s

    def listed(self) -> list[Json]:
        status, doc = call(self.port, "GET", "/workers")
        if status != 200 or not isinstance(doc, dict):
            raise ControlError(f"GET /workers: HTTP {status}: {str(doc)[:200]}")
        workers: list[Json] = doc.get("workers", [])
        return workers

    def find(self, url: str) -> Json | None:
        return next((w for w in self.listed() if w.get("url") == url), None)

    def remove(self, url: str) -> float:
        """Take the worker out of the router; returns the seconds until the router no longer lists it."""
        t0 = time.monotonic()
        worker = self.find(url)
        if worker is None:
            raise ControlError(f"{url} is not one of the router's workers")
        status, doc = call(self.port, "DELETE", f"/workers/{worker['id']}")
        if status >= 300:
            raise ControlError(f"DELETE /workers/{worker['id']}: HTTP {status}: {str(doc)[:200]}")
        self._wait(lambda: self.find(url) is None, f"{url} still listed")
        return time.monotonic() - t0

    def add(self, url: str, worker_type: str = "decode") -> float:
        """Put a server in the router; returns the seconds until the router lists it healthy."""
        t0 = time.monotonic()
        status, doc = call(self.port, "POST", "/workers", {"url": url, "worker_type": worker_type})
        if status >= 300:
            raise ControlError(f"POST /workers {url}: HTTP {status}: {str(doc)[:200]}")
        self._wait(lambda: bool((self.find(url) or {}).get("is_healthy")), f"{url} not listed healthy")
        return time.monotonic() - t0

    def _wait(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise ControlError(f"after {self.timeout_s:.0f} s: {what}")
            time.sleep(0.2)


# The queues of /v1/loads a server holds requests in (PD mode adds its own).
_HELD = ("num_running_reqs", "num_waiting_reqs")
_HELD_PD = ("prefill_bootstrap_queue_reqs", "prefill_inflight_queue_reqs", "decode_prealloc_queue_reqs",
            "decode_transfer_queue_reqs", "decode_retracted_queue_reqs")


def held(port: int) -> int:
    """How many requests the server's schedulers hold right now, from its /v1/loads."""
    status, doc = call(port, "GET", "/v1/loads", timeout_s=10.0)
    if status != 200 or not isinstance(doc, dict):
        raise ControlError(f"GET /v1/loads: HTTP {status}: {str(doc)[:200]}")
    total = 0
    for load in doc.get("loads", []):
        total += sum(int(load.get(k) or 0) for k in _HELD)
        total += sum(int((load.get("disaggregation") or {}).get(k) or 0) for k in _HELD_PD)
    return total
