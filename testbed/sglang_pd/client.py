"""The testbed's client of SGLang's router: one HTTP `/generate` per request, and the ground truth.

It has the emulated router's `send` / `truth` / `close`, so the testbed's
`LoadGenerator` drives it unchanged. Every request carries a W3C traceparent
of its own, as a client would send it: SGLang's router passes it to both legs
and pdwatch's plugin keeps it, so a request's trace id is known here without
asking pdwatch. The router chooses the decode and the bootstrap room; neither
is visible to a client, so the ground truth names neither.
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import threading
import time

from pdwatch import contract as c

from ..router import RequestRecord, StackClient, close_sockets
from .model import VOCAB

log = logging.getLogger("pdwatch.testbed.sglang_pd.client")


class RouterClient(StackClient):
    # Copies: a request still open in a truth stays open in it, whatever comes later.
    truth_copies = True

    def __init__(self, port: int, *, seed: int = 1, traceparent: bool = True, max_open: int = 256,
                 timeout_s: float = 900.0):
        super().__init__(traceparent=traceparent, max_open=max_open)
        self.port = port
        self.rng = random.Random(seed)  # the prompts' token ids
        self.timeout_s = timeout_s
        self._open = 0
        self._conns: set[http.client.HTTPConnection] = set()

    def send(self, prompt_tokens: int, max_tokens: int) -> RequestRecord | None:
        """Start one request through the router; its answer is awaited on a thread of its own."""
        with self._lock:
            if not self._admit(self._open):
                return None
            tp = self._new_traceparent()
            parsed = c.parse_traceparent(tp)
            trace_id = f"{parsed[0]:032x}" if parsed else ""
            ids = [self.rng.randrange(3, VOCAB) for _ in range(prompt_tokens)]
            rec = RequestRecord(index=len(self.records), room=-1, trace_id=trace_id, decode="",
                                prompt_tokens=prompt_tokens, max_tokens=max_tokens, sent_at=time.time(),
                                traceparent=tp)
            self.records.append(rec)
            self._open += 1
        threading.Thread(target=self._run, args=(rec, ids), name=f"req-{rec.index}", daemon=True).start()
        return rec

    def _run(self, rec: RequestRecord, ids: list[int]) -> None:
        body = json.dumps({
            "input_ids": ids,
            # ignore_eos: random weights emit the EOS id now and then; lengths stay as asked.
            "sampling_params": {"max_new_tokens": rec.max_tokens, "temperature": 0, "ignore_eos": True},
        })
        headers = {"Content-Type": "application/json"}
        if rec.traceparent:
            headers["traceparent"] = rec.traceparent
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout_s)
        with self._lock:
            self._conns.add(conn)
        try:
            conn.request("POST", "/generate", body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            self._answer(rec, resp.status, data)
        except Exception as e:
            if not self._closed:
                self._done(rec, "failed", f"{type(e).__name__}: {e}")
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._open -= 1
            conn.close()

    def _answer(self, rec: RequestRecord, status: int, data: bytes) -> None:
        if self._closed:
            return  # an answer the stack's own stop caused: the request stays open in the truth
        try:
            doc = json.loads(data)
        except ValueError:
            doc = {}
        if status != 200 or not isinstance(doc, dict):
            self._done(rec, "failed", f"HTTP {status}: {data[:200].decode(errors='replace')}")
            return
        finish = (doc.get("meta_info") or {}).get("finish_reason") or {}
        rec.tokens = len(doc.get("output_ids") or [])
        kind = finish.get("type") if isinstance(finish, dict) else None
        if kind in ("length", "stop"):
            self._done(rec, "ok", None)
        else:
            message = finish.get("message") if isinstance(finish, dict) else None
            self._done(rec, "aborted" if kind == "abort" else "failed", message or str(finish))

    def close(self) -> None:
        """Stop sending; requests still waiting keep their open place in the truth."""
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        close_sockets(conns)
