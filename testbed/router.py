"""The router and load generator, run inside the Stack's own process.

Like SGLang's mini load balancer: each request gets a fresh random 63-bit
`bootstrap_room` (and, when asked, a W3C traceparent), goes to the prefill and
to a decode chosen round-robin, and the decode's token stream comes back here.
What the router sees is the testbed's ground truth (`Truth`).
"""

from __future__ import annotations

import http.client
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TypedDict

from pdwatch import contract as c

from .wire import Conn, Message

log = logging.getLogger("pdwatch.testbed.router")


class Restart(TypedDict):
    instance: str
    t: float  # wall clock of the kill


@dataclass
class RequestRecord:
    index: int
    room: int
    trace_id: str  # 32 lowercase hex digits, as pdwatch derives it
    decode: str
    prompt_tokens: int
    max_tokens: int
    sent_at: float  # wall clock, seconds
    traceparent: str | None = None
    done_at: float | None = None
    outcome: str | None = None  # None while open
    reason: str | None = None
    tokens: int = 0
    kv_bytes: int = 0


@dataclass
class Truth:
    """The router's view: every request sent, and the restarts the stack performed."""

    requests: list[RequestRecord]
    restarts: list[Restart] = field(default_factory=list)

    @property
    def open(self) -> list[RequestRecord]:
        return [r for r in self.requests if r.done_at is None]

    @property
    def completed(self) -> list[RequestRecord]:
        return [r for r in self.requests if r.outcome == "ok"]

    def outstanding_after_restart(self) -> list[RequestRecord]:
        """Requests sent to a restarted decode after its restart and still not done."""
        out = []
        for r in self.requests:
            if r.done_at is not None:
                continue
            if any(r.decode == ev["instance"] and r.sent_at >= ev["t"] for ev in self.restarts):
                out.append(r)
        return out


def close_sockets(conns: Iterable[http.client.HTTPConnection]) -> None:
    """Close each HTTP connection's socket under it: a thread blocked on its answer returns at once."""
    for conn in conns:
        sock = conn.sock
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass


class StackClient:
    """What sends a stack's requests and keeps what it saw of each (the ground truth).

    `Router` (the emulated stack's own) and `sglang_pd.client.RouterClient` (a client of
    SGLang's router) send differently and record alike, here.
    """

    # Whether truth() hands out copies, frozen as they are now, or the live records.
    truth_copies = False

    def __init__(self, *, traceparent: bool, max_open: int):
        # Ids differ on every run, as real clients' do: two runs of one seed into one sidecar (each
        # scenario its own cluster) must not share trace ids, or the second's legs read as the first's.
        self.ids = random.Random()
        self.traceparent = traceparent
        self.max_open = max_open
        self.records: list[RequestRecord] = []
        self.restarts: list[Restart] = []
        self.rejected = 0  # requests not sent because max_open were in flight
        self._lock = threading.Lock()
        self._closed = False

    def _admit(self, open_now: int) -> bool:
        """Under the lock: whether one more request may go out now (a refusal while open is counted)."""
        if self._closed:
            return False
        if open_now >= self.max_open:
            self.rejected += 1
            return False
        return True

    def _new_traceparent(self) -> str | None:
        """A fresh W3C traceparent when the client sends them, else None."""
        if not self.traceparent:
            return None
        return c.format_traceparent(self.ids.getrandbits(128) or 1, self.ids.getrandbits(64) or 1)

    @staticmethod
    def _done(rec: RequestRecord, outcome: str, reason: str | None) -> None:
        if rec.done_at is None:
            rec.outcome, rec.reason, rec.done_at = outcome, reason, time.time()

    def note_restart(self, instance: str, t: float) -> None:
        with self._lock:
            self.restarts.append({"instance": instance, "t": t})

    def truth(self) -> Truth:
        with self._lock:
            records = [replace(r) for r in self.records] if self.truth_copies else list(self.records)
            return Truth(requests=records, restarts=list(self.restarts))

    def send(self, prompt_tokens: int, max_tokens: int) -> RequestRecord | None:
        """Start one request (None: not sent, the client is closed or full)."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop sending; requests still open stay open in the truth."""
        raise NotImplementedError


class Router(StackClient):
    """Sends each request to the prefill and a decode (round robin) and reads the decode's tokens back.

    `seed` is taken as the live client takes it; nothing here draws from it (rooms and trace ids
    differ on every run, see StackClient).
    """

    def __init__(self, prefill_port: int, decodes: dict[str, int], *, seed: int = 1, traceparent: bool = False,
                 max_open: int = 1024, connect_timeout_s: float = 2.0):
        if not decodes:
            raise ValueError("the router needs at least one decode")
        super().__init__(traceparent=traceparent, max_open=max_open)
        self.prefill_port = prefill_port
        self.decodes = dict(decodes)  # instance -> api port
        self._order = sorted(self.decodes)
        self._rr = 0
        self.connect_timeout_s = connect_timeout_s
        self._prefill: Conn | None = None
        self._prefill_lock = threading.Lock()
        self._streams: set[Conn] = set()

    # ---- the decodes it routes to ------------------------------------------

    @property
    def routed(self) -> list[str]:
        """The decodes new requests go to now, in round-robin order."""
        with self._lock:
            return list(self._order)

    def add(self, instance: str, port: int) -> None:
        """Route new requests to `instance` (at `port`) too, as a Service adds a ready endpoint."""
        with self._lock:
            self.decodes[instance] = port
            if instance not in self._order:
                self._order = sorted([*self._order, instance])

    def remove(self, instance: str, *, if_idle_since: float | None = None,
               then: Callable[[], None] | None = None) -> bool:
        """Send no new request to `instance`; its requests in flight finish where they are.

        With `if_idle_since` (wall clock), only when none of its requests is open and none was sent
        since then (else False, nothing changed). `then` runs while no request can be routed, before
        the removal: a kill there lands on a decode the router is sure holds nothing.
        """
        with self._lock:
            if instance not in self._order:
                return False
            if if_idle_since is not None and any(r.decode == instance and (r.done_at is None or
                                                                          r.sent_at >= if_idle_since)
                                                 for r in self.records):
                return False
            if then is not None:
                then()
            self._order = [d for d in self._order if d != instance]
            return True

    def open_on(self, instance: str) -> int:
        """Requests sent to `instance` and not finished yet."""
        with self._lock:
            return sum(1 for r in self.records if r.decode == instance and r.done_at is None)

    # ---- sending ---------------------------------------------------------

    def _prefill_call(self, msg: Message) -> None:
        with self._prefill_lock:
            for attempt in (1, 2):
                try:
                    if self._prefill is None:
                        self._prefill = Conn.connect(self.prefill_port, self.connect_timeout_s)
                    reply = self._prefill.request(msg)
                    if not reply.get("ok"):
                        raise RuntimeError(reply.get("error") or "prefill refused the request")
                    return
                except OSError:
                    if self._prefill is not None:
                        self._prefill.close()
                        self._prefill = None
                    if attempt == 2:
                        raise

    def send(self, prompt_tokens: int, max_tokens: int) -> RequestRecord | None:
        """Start one request; its stream is read on a thread of its own."""
        with self._lock:
            if not self._admit(sum(1 for r in self.records if r.done_at is None)):
                return None
            if not self._order:
                self.rejected += 1  # every decode is out of the router (a scale-down to zero)
                return None
            room = self.ids.getrandbits(63)
            decode = self._order[self._rr % len(self._order)]
            self._rr += 1
            tp = self._new_traceparent()
            parsed = c.parse_traceparent(tp)
            trace_id = parsed[0] if parsed else c.room_trace_id(room)
            rec = RequestRecord(index=len(self.records), room=room, trace_id=f"{trace_id:032x}", decode=decode,
                                prompt_tokens=prompt_tokens, max_tokens=max_tokens, sent_at=time.time(),
                                traceparent=tp)
            self.records.append(rec)
        threading.Thread(target=self._run_request, args=(rec,), name=f"req-{rec.index}", daemon=True).start()
        return rec

    def _run_request(self, rec: RequestRecord) -> None:
        msg = {"op": "generate", "room": rec.room, "prompt_tokens": rec.prompt_tokens, "max_tokens": rec.max_tokens,
               "traceparent": rec.traceparent}
        try:
            conn = Conn.connect(self.decodes[rec.decode], self.connect_timeout_s)
        except OSError as e:
            self._done(rec, "failed", f"decode {rec.decode} unreachable: {e}")
            return
        with self._lock:
            self._streams.add(conn)
        try:
            conn.send({**msg, "prefill": "prefill-0"})
            try:
                self._prefill_call({**msg, "decode": rec.decode})
            except Exception as e:
                self._done(rec, "failed", f"prefill unreachable: {e}")
                return
            while True:
                try:
                    line = conn.recv()
                except Exception:
                    line = None
                if line is None:
                    if self._closed:
                        return  # the stack is stopping: the request stays open in the truth
                    # The decode went away mid-request: tell the prefill to drop its leg.
                    self._done(rec, "failed", f"decode {rec.decode} closed the stream")
                    self._abort(rec.room, "decode stream lost")
                    return
                if "token" in line:
                    rec.tokens = int(line["token"])
                if line.get("done"):
                    rec.kv_bytes = int(line.get("kv_bytes", 0))
                    outcome = line.get("outcome", "ok")
                    self._done(rec, outcome, line.get("reason"))
                    if outcome != "ok":
                        self._abort(rec.room, f"decode {rec.decode} ended the request: {outcome}")
                    return
        finally:
            with self._lock:
                self._streams.discard(conn)
            conn.close()

    def _abort(self, room: int, reason: str) -> None:
        if self._closed:
            return
        try:
            self._prefill_call({"op": "abort", "room": room, "reason": reason})
        except Exception:
            log.debug("abort of room %d not delivered", room, exc_info=True)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            streams = list(self._streams)
        for conn in streams:
            conn.close()
        with self._prefill_lock:
            if self._prefill is not None:
                self._prefill.close()
                self._prefill = None


class LoadGenerator:
    """Sends requests at `rate` per second (Poisson arrivals), bounded in count and time."""

    def __init__(self, router: StackClient, shape: Callable[[random.Random, int], tuple[int, int]], *, rate: float,
                 seed: int, duration_s: float | None, max_requests: int):
        if not rate > 0:
            raise ValueError(f"rate must be positive, got {rate}")
        self.router = router
        self.shape = shape  # (rng, index) -> (prompt_tokens, max_tokens)
        self.rate = rate
        self.rng = random.Random(seed + 7919)
        self.duration_s = duration_s
        self.max_requests = max_requests
        self.sent = 0
        self._resume_at = 0.0  # monotonic: no request goes out before it (pause)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-generator", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        t0 = time.monotonic()
        next_at = t0
        for i in range(self.max_requests):
            if self._stop.wait(max(0.0, next_at - time.monotonic())):
                return
            while (resume_at := self._resume_at) > time.monotonic():  # paused: the arrivals resume after it
                # In slices: resume() may end an open pause early.
                if self._stop.wait(min(0.1, resume_at - time.monotonic())):
                    return
                next_at = max(next_at, time.monotonic())
            if self.duration_s is not None and time.monotonic() - t0 >= self.duration_s:
                return
            prompt_tokens, max_tokens = self.shape(self.rng, i)
            if self.router.send(prompt_tokens, max_tokens) is not None:
                self.sent += 1
            next_at += self.rng.expovariate(self.rate)

    def set_rate(self, rate: float) -> None:
        """Arrivals at `rate` per second from the next one on."""
        if not rate > 0:
            raise ValueError(f"rate must be positive, got {rate}")
        self.rate = rate  # read by the sending thread at each arrival; a float store is atomic

    def pause(self, seconds: float | None = None) -> None:
        """No arrival for `seconds` from now, or until resume() (None); the duration keeps counting."""
        self._resume_at = math.inf if seconds is None else time.monotonic() + seconds

    def resume(self) -> None:
        """Arrivals again from now (an open pause ends)."""
        self._resume_at = 0.0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2.0)

    @property
    def finished(self) -> bool:
        return not self._thread.is_alive()
