"""The decode engine: prealloc (bootstrap) -> transfer -> waiting queue -> decode.

Mirrors SGLang's decode side. A request takes a KV slot from a bounded pool
and registers its NIXL agent and the slot's address with the prefill's
bootstrap server for its room (`bootstrap`); then waits for the prefill's
NIXL notification naming the room (`transfer`) and checks the bytes that
arrived; waits for room in the running batch (`queued`); and generates tokens
at a steady rate, streaming each to the router (`decode`).

Every start gets a new NIXL agent name, as a restarted SGLang decode does, but
keeps its endpoint (the router and the prefill know it by that). A clean exit
(SIGTERM) deregisters the endpoint from the prefill's bootstrap server, so a
decode that leaves in order and starts again is known by its new agent; a
killed one cannot, which is the `decode-restart` incident.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from pdwatch import contract as c
from pdwatch.engine_patches import recorder as pdrec

from . import kv
from .engine import Ready
from .engine_status import StatusWriter
from .tp import IDLE_TURN_S, TpLeader
from .wire import Conn, LineServer, Message, WireError, room_of

log = logging.getLogger("pdwatch.testbed.decode")

# The contract's stage order for this role, by name.
BOOTSTRAP, TRANSFER, QUEUED, DECODE = c.STAGES["decode"]

MAX_UNEXPECTED_NOTIFS = 4096
TP_IDLE_SYNC_S = 0.02  # an idle TP group still meets this often (SGLang broadcasts new requests each iteration)


@dataclass
class DecodeReq:
    rid: str
    room: int
    prompt_tokens: int
    max_tokens: int
    traceparent: str | None
    conn: Conn
    arrived: float = field(default_factory=time.monotonic)
    stage_since: float = field(default_factory=time.monotonic)
    slot: int | None = None
    nbytes: int = 0
    tokens: int = 0


class BootstrapClient:
    """Registers rooms with the prefill's bootstrap server off the scheduler thread."""

    def __init__(self, port: int):
        self.port = port
        self.jobs: queue.SimpleQueue[tuple[DecodeReq, Message]] = queue.SimpleQueue()
        self.results: deque[tuple[DecodeReq, str | None]] = deque()  # (req, error or None)
        self._conn: Conn | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bootstrap-client", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, req: DecodeReq, msg: Message) -> None:
        self.jobs.put((req, msg))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                req, msg = self.jobs.get(timeout=0.1)
            except queue.Empty:
                continue
            self.results.append((req, self._register(msg)))

    def _register(self, msg: Message) -> str | None:
        for attempt in (1, 2):  # one reconnect: the prefill may have closed an idle connection
            try:
                if self._conn is None:
                    self._conn = Conn.connect(self.port, timeout_s=2.0)
                reply = self._conn.request(msg)
                return None if reply.get("ok") else str(reply.get("error") or "registration refused")
            except Exception as e:
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
                if attempt == 2:
                    return f"bootstrap server unreachable: {e}"
        return "unreachable"

    def stop(self) -> None:
        self._stop.set()
        if self._conn is not None:
            self._conn.close()


class DecodeEngine:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        if not args.prefill_bootstrap_port:
            raise SystemExit("decode needs --prefill-bootstrap-port")
        # A new agent name on every start, like a restarted SGLang decode.
        self.agent_name = f"{args.instance}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.api = LineServer(args.api_port, self._on_api)
        self.endpoint = f"127.0.0.1:{self.api.port}"
        self.prefill_address = f"127.0.0.1:{args.prefill_bootstrap_port}"
        # Its waiting queue is a deque taken from the front (_waiting_queue): fcfs.
        self.rec = pdrec.from_env("decode", service_name=args.service_name, engine_version="testbed",
                                  loop_idle_turn_s=IDLE_TURN_S, schedule_policy=c.SCHEDULE_FCFS,
                                  tp_size=args.tp_size, gpu_uuids=tuple(args.gpu_uuid or ()),
                                  peer_ids=(self.agent_name, self.endpoint))
        self.status = StatusWriter(args.status_file)
        self.agent = kv.make_agent(self.agent_name)
        self.pool = kv.SlotPool(self.agent, args.slots, args.slot_bytes)
        # After registering: the metadata carries the registrations the prefill writes into.
        self.metadata = kv.metadata_b64(self.agent)
        self.boot = BootstrapClient(args.prefill_bootstrap_port)
        self.inbox: deque[tuple[Message, Conn]] = deque()
        self.prealloc: deque[DecodeReq] = deque()
        self.registering: dict[int, DecodeReq] = {}
        self.transfer: dict[int, DecodeReq] = {}
        self.waiting: deque[DecodeReq] = deque()
        self.running: list[DecodeReq] = []
        self.unexpected: deque[str] = deque(maxlen=MAX_UNEXPECTED_NOTIFS)
        self.early: dict[int, str] = {}  # rooms whose KV arrived while still registering
        self.kv_bytes_checked = 0
        self._seq = 0
        self._next_step = 0.0
        self._stop = threading.Event()
        # Rank 0 of a TP group: every forward is a collective with the other rank.
        self.tp = TpLeader(args.tp_port, self.status, self._stop) if args.tp_size > 1 else None
        self._last_sync = 0.0
        # Fault `kv_leak`: finished requests no longer return their KV slot, so the pool drains.
        self.kv_leak = False
        self.leaked_slots = 0
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)

    # ---- server thread ---------------------------------------------------

    def _on_api(self, msg: Message, conn: Conn) -> Message | None:
        op = msg.get("op")
        if op == "generate":
            try:
                room_of(msg)
            except WireError as e:
                return {"done": True, "outcome": "failed", "reason": str(e)}
            # Tokens are streamed back on this connection by the scheduler.
            self.inbox.append((msg, conn))
            return None
        if op == "stats":
            return {"ok": True, "kv_bytes_checked": self.kv_bytes_checked, "agent": self.agent_name,
                    "free_slots": self.pool.free_count, "leaked_slots": self.leaked_slots,
                    "held": self.held(), "recorder_open": self.rec.stats()["open"],
                    "heartbeats": self.rec.heartbeat_seq}
        if op == "kv_leak":
            # Read by the scheduler thread on its next step; a bool store is atomic.
            self.kv_leak = True
            return {"ok": True, "free_slots": self.pool.free_count}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def held(self) -> int:
        """Requests the decode holds in any stage (read from the server thread: lengths only)."""
        return (len(self.inbox) + len(self.prealloc) + len(self.registering) + len(self.transfer)
                + len(self.waiting) + len(self.running))

    # ---- scheduler thread ------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            # A running batch keeps the GPU computing until the next step is due.
            computing = bool(self.running)
            self.rec.loop_tick()
            try:
                if self.tp is not None and not computing and t0 - self._last_sync >= TP_IDLE_SYNC_S:
                    self._last_sync = t0
                    if not self.tp.sync(False):
                        continue
                busy = self._step()
            except Exception:
                log.exception("scheduler step failed")
                busy = False
            if not busy:
                time.sleep(0.002)
            if computing:
                self.status.work(time.monotonic() - t0)

    def _step(self) -> bool:
        busy = self._take_inbox()
        busy |= self._prealloc_queue()
        busy |= self._transfer_queue()
        busy |= self._waiting_queue()
        busy |= self._decode_step()
        return busy

    def _take_inbox(self) -> bool:
        busy = False
        while self.inbox:
            msg, conn = self.inbox.popleft()
            busy = True
            self._seq += 1
            req = DecodeReq(rid=f"d-{self._seq}", room=int(msg["room"]), prompt_tokens=int(msg.get("prompt_tokens", 1)),
                            max_tokens=max(1, int(msg.get("max_tokens", 16))), traceparent=msg.get("traceparent"),
                            conn=conn)
            req.nbytes = min(max(1, req.prompt_tokens) * self.args.bytes_per_token, self.args.slot_bytes)
            self.rec.arrive(req.rid, bootstrap_room=req.room, traceparent=req.traceparent,
                            prompt_tokens=req.prompt_tokens, peer=self.prefill_address)
            self.rec.enter(req.rid, BOOTSTRAP)
            self.prealloc.append(req)
        return busy

    def _prealloc_queue(self) -> bool:
        busy = False
        now = time.monotonic()
        while self.prealloc:
            req = self.prealloc[0]
            slot = self.pool.alloc()
            if slot is None:
                break  # no KV memory: the rest wait in bootstrap
            self.prealloc.popleft()
            req.slot = slot
            self.pool.view(slot, req.nbytes)[:] = 0  # nothing stale can pass the check
            self.registering[req.room] = req
            self.boot.submit(req, {
                "op": "register", "room": req.room, "endpoint": self.endpoint, "instance": self.args.instance,
                "agent_name": self.agent_name, "agent_metadata": self.metadata,
                "addr": self.pool.addr(slot), "nbytes": self.args.slot_bytes,
            })
            busy = True
        for req in list(self.prealloc):
            if now - req.arrived > self.args.bootstrap_timeout_s:
                self.prealloc.remove(req)
                self._finish(req, "timeout", "bootstrap timed out waiting for KV memory")
        while self.boot.results:
            req, error = self.boot.results.popleft()
            busy = True
            if self.registering.pop(req.room, None) is None:
                continue
            early = self.early.pop(req.room, None)
            if error:
                self._finish(req, "failed", error)
                continue
            self.rec.enter(req.rid, TRANSFER)
            req.stage_since = now
            self.transfer[req.room] = req
            if early is not None:
                self._on_notif(f"kv:{req.room}".encode())
        return busy

    def _transfer_queue(self) -> bool:
        busy = False
        try:
            notifs = self.agent.get_new_notifs()
        except Exception:
            log.exception("get_new_notifs failed")
            notifs = {}
        for _peer, msgs in notifs.items():
            for raw in msgs:
                busy = True
                self._on_notif(raw)
        now = time.monotonic()
        for room, req in list(self.transfer.items()):
            if now - req.stage_since > self.args.waiting_timeout_s:
                del self.transfer[room]
                self._finish(req, "timeout", "KV cache did not arrive")
        return busy

    def _on_notif(self, raw: bytes) -> None:
        text = raw.decode(errors="replace")
        room = None
        if text.startswith("kv:"):
            try:
                room = int(text[3:])
            except ValueError:
                room = None
        req = self.transfer.pop(room, None) if room is not None else None
        if req is None:
            if room is not None and room in self.registering:
                # The KV landed before this thread saw the bootstrap reply: keep it for then.
                self.early[room] = text
                return
            self.unexpected.append(text)
            self.rec.counter("kv_unexpected_notifs")
            return
        assert req.slot is not None, "a request in transfer holds its KV slot"
        got = self.pool.view(req.slot, req.nbytes)
        if not np.array_equal(got, kv.kv_pattern(req.room, req.nbytes)):
            self.rec.counter("kv_checksum_errors")
            self._finish(req, "failed", "KV bytes differ from what the prefill computed")
            return
        self.kv_bytes_checked += req.nbytes
        self.rec.counter("kv_bytes_checked", req.nbytes)
        self.rec.transfer_info(req.rid, nbytes=req.nbytes, backend="nixl", peer=self.prefill_address)
        self.rec.enter(req.rid, QUEUED)
        self.waiting.append(req)

    def _waiting_queue(self) -> bool:
        busy = False
        while self.waiting and len(self.running) < self.args.max_running:
            req = self.waiting.popleft()
            self.rec.enter(req.rid, DECODE)
            self.running.append(req)
            busy = True
        return busy

    def _decode_step(self) -> bool:
        if not self.running:
            return False
        now = time.monotonic()
        if now < self._next_step:
            return False
        self._next_step = now + self.args.token_interval_s
        if self.tp is not None:
            # The forward is a collective: every rank must join before tokens come out.
            self._last_sync = now
            if not self.tp.sync(True):
                return False
        still = []
        for req in self.running:
            req.tokens += 1
            self.rec.token(req.rid, 1)
            done = req.tokens >= req.max_tokens
            try:
                req.conn.send({"token": req.tokens} if not done else
                              {"token": req.tokens, "done": True, "outcome": "ok", "kv_bytes": req.nbytes})
            except OSError:
                self._finish(req, "aborted", "router went away")
                continue
            if done:
                self._finish(req, "ok", None)
            else:
                still.append(req)
        self.running = still
        return True

    def _finish(self, req: DecodeReq, outcome: str, reason: str | None) -> None:
        self.rec.finish(req.rid, outcome, reason=reason)
        if outcome != "ok":
            try:
                req.conn.send({"done": True, "outcome": outcome, "reason": reason})
            except OSError:
                pass
        if req.slot is not None:
            if self.kv_leak:
                self.leaked_slots += 1  # the slot's KV memory is never given back
            else:
                self.pool.free(req.slot)
            req.slot = None

    # ---- life cycle ------------------------------------------------------

    def start(self) -> Ready:
        self.status.start()
        self.boot.start()
        self.api.serve_in_thread("api-server")
        self._thread.start()
        return {"role": "decode", "instance": self.args.instance, "agent": self.agent_name,
                "api_port": self.api.port, "endpoint": self.endpoint}

    def _deregister(self) -> None:
        """Tell the prefill's bootstrap server this endpoint's agent is gone (best effort, bounded)."""
        try:
            conn = Conn.connect(self.args.prefill_bootstrap_port, timeout_s=3.0)
        except OSError:
            return
        try:
            conn.sock.settimeout(3.0)
            conn.request({"op": "deregister", "endpoint": self.endpoint, "agent_name": self.agent_name})
        except (OSError, WireError):
            log.warning("deregistration from the prefill's bootstrap server failed", exc_info=True)
        finally:
            conn.close()

    def shutdown(self) -> None:
        self._stop.set()
        self.api.shutdown()
        self.api.server_close()
        self._thread.join(2.0)
        self._deregister()  # before anything slower: a starved CPU must not cost the prefill this news
        self.boot.stop()
        self.status.stop()
        if self.tp is not None:
            self.tp.close()
        self.rec.shutdown(timeout_s=2.0)
