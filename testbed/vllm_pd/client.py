"""The live vLLM stack's PD proxy and client: the two calls of vLLM's toy proxy, and the ground truth.

Test infrastructure. vLLM ships no PD router of its own (its toy proxy lives in
its tests), so the testbed sends each request as that proxy does: to the
prefill with `max_tokens: 1` and `kv_transfer_params.do_remote_decode`, then
the same prompt to a decode (round-robin) with the `kv_transfer_params` the
prefill answered (`remote_request_id`, `remote_block_ids`, `remote_engine_id`,
...). Every request carries a W3C traceparent of its own, on both calls, so
its trace id is known here without asking pdwatch; unlike SGLang's router, the
decode is chosen here, so the ground truth names it.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from ..router import RequestRecord, StackClient, close_sockets
from ..sglang_pd.model import VOCAB

# Seconds the proxy holds a request between its prefill's answer and its decode call (lease-expiry).
DecodeDelay = Callable[[RequestRecord], float]


class ProxyClient(StackClient):
    truth_copies = True  # a request still open in a truth stays open in it

    def __init__(self, model: str, prefill_port: int, decodes: dict[str, int], *, seed: int = 1,
                 traceparent: bool = True, max_open: int = 256, timeout_s: float = 900.0):
        super().__init__(traceparent=traceparent, max_open=max_open)
        self.model = model
        self.prefill_port = prefill_port
        self.decodes = dict(decodes)  # instance -> HTTP port
        self._order = sorted(self.decodes)
        self._rr = 0
        self.rng = random.Random(seed)  # the prompts' token ids
        self.timeout_s = timeout_s
        self.decode_delay: DecodeDelay | None = None
        self._open = 0
        self._conns: set[http.client.HTTPConnection] = set()
        self._stop = threading.Event()

    # ---- the decodes it routes to (as a router's worker list) ---------------

    def add(self, instance: str, port: int) -> None:
        with self._lock:
            self.decodes[instance] = port
            if instance not in self._order:
                self._order = sorted([*self._order, instance])

    def remove(self, instance: str) -> None:
        with self._lock:
            self._order = [d for d in self._order if d != instance]

    def open_on(self, instance: str) -> int:
        with self._lock:
            return sum(1 for r in self.records if r.decode == instance and r.done_at is None)

    # ---- sending ---------------------------------------------------------

    def send(self, prompt_tokens: int, max_tokens: int) -> RequestRecord | None:
        with self._lock:
            if not self._admit(self._open):
                return None
            if not self._order:
                self.rejected += 1
                return None
            decode = self._order[self._rr % len(self._order)]
            self._rr += 1
            tp = self._new_traceparent()
            rec = RequestRecord(index=len(self.records), room=-1, trace_id=tp.split("-")[1] if tp else "",
                                decode=decode, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                                sent_at=time.time(), traceparent=tp)
            ids = [self.rng.randrange(3, VOCAB) for _ in range(prompt_tokens)]
            self.records.append(rec)
            self._open += 1
        threading.Thread(target=self._run, args=(rec, ids), name=f"req-{rec.index}", daemon=True).start()
        return rec

    def _run(self, rec: RequestRecord, ids: list[int]) -> None:
        try:
            first = self._post(self.prefill_port, rec, {
                "model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                       "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                                       "remote_port": None}})
            if first is None:
                return
            params = first.get("kv_transfer_params")
            if not params:
                self._done(rec, "failed", f"the prefill answered no kv_transfer_params: {str(first)[:200]}")
                return
            delay = self.decode_delay(rec) if self.decode_delay is not None else 0.0
            if delay > 0 and self._stop.wait(delay):
                return
            with self._lock:
                port = self.decodes[rec.decode]
            out = self._post(port, rec, {
                "model": self.model, "prompt": ids, "max_tokens": rec.max_tokens, "temperature": 0,
                "ignore_eos": True, "kv_transfer_params": params})
            if out is None:
                return
            choice = (out.get("choices") or [{}])[0]
            rec.tokens = int((out.get("usage") or {}).get("completion_tokens") or 0)
            if choice.get("finish_reason") in ("length", "stop"):
                self._done(rec, "ok", None)
            else:
                self._done(rec, "failed", f"finish_reason {choice.get('finish_reason')!r}")
        finally:
            with self._lock:
                self._open -= 1

    def _post(self, port: int, rec: RequestRecord, body: dict[str, Any]) -> dict[str, Any] | None:
        """One call; None when it failed (recorded) or the client was closed meanwhile (left open)."""
        headers = {"Content-Type": "application/json"}
        if rec.traceparent:
            headers["traceparent"] = rec.traceparent
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=self.timeout_s)
        with self._lock:
            self._conns.add(conn)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        except Exception as e:
            if not self._closed:
                self._done(rec, "failed", f"{type(e).__name__}: {e}")
            return None
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
        if self._closed:
            return None  # an answer the stack's own stop caused: the request stays open in the truth
        if resp.status != 200:
            self._done(rec, "failed", f"HTTP {resp.status} from :{port}: {data[:200].decode(errors='replace')}")
            return None
        try:
            doc: dict[str, Any] = json.loads(data)
        except ValueError:
            self._done(rec, "failed", f"not JSON from :{port}: {data[:200]!r}")
            return None
        return doc

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        self._stop.set()
        close_sockets(conns)
