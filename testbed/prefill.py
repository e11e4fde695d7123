"""The prefill engine: bootstrap queue -> waiting queue -> forward -> KV sender.

Mirrors SGLang's prefill side. A request waits in `bootstrap` until its decode
registers the room with this engine's bootstrap server, in `queued` until the
scheduler has a KV slot and batches it, in `prefill` for a forward pass whose
cost grows with the prompt, and in `transfer` until the KV sender reports that
the NIXL WRITE to the decode's slot is DONE. Like SGLang, nothing times out a
leg in `transfer`.

The bootstrap state keeps "decode endpoint -> remote NIXL agent" from the
first time it sees that decode and refreshes it only when that decode
deregisters, which it does on a clean exit (SIGTERM) alone. After a decode is
killed and restarted (new agent, same endpoint), every transfer to it targets
the old agent and fails inside the KV sender, which only logs and counts the
error: the leg stays in `transfer` for good. That is the incident the testbed
reproduces; a decode that leaves in order and comes back is served again.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import random
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdwatch import contract as c
from pdwatch.engine_patches import recorder as pdrec

from . import kv
from .engine import Ready
from .engine_status import StatusWriter
from .tp import IDLE_TURN_S
from .wire import Conn, LineServer, Message, WireError, room_of

if TYPE_CHECKING:
    from nixl_cu12._api import nixl_agent, nixl_xfer_handle

log = logging.getLogger("pdwatch.testbed.prefill")

# The contract's stage order for this role, by name.
BOOTSTRAP, QUEUED, PREFILL, TRANSFER = c.STAGES["prefill"]

# KV sender status of a room (SGLang's KVPoll, reduced to what this side uses).
TRANSFERRING, SUCCESS, FAILED = "transferring", "success", "failed"
MAX_EARLY_REGISTRATIONS = 4096


@dataclass
class PrefillReq:
    rid: str
    room: int
    prompt_tokens: int
    traceparent: str | None
    arrived: float = field(default_factory=time.monotonic)
    reg: Message | None = None  # the decode's registration, once it came
    slot: int | None = None
    nbytes: int = 0
    aborted: bool = False


class BootstrapPeers:
    """Decode endpoint -> remote NIXL agent name, learned once, never refreshed.

    This is the degraded state of the incident: a decode that restarts keeps
    its endpoint but comes back with a new agent, and the entry still names
    the old one. Used only on the KV sender thread, which owns the agent.
    """

    def __init__(self, agent: nixl_agent):
        self.agent = agent
        self.by_endpoint: dict[str, str] = {}
        # Endpoints whose decode left in order (deregistered), from the bootstrap server's threads.
        self.left: queue.SimpleQueue[str] = queue.SimpleQueue()

    def forget(self, endpoint: str) -> None:
        """The decode at `endpoint` left in order: learn its agent again when it next registers."""
        self.left.put(endpoint)

    def resolve(self, reg: Message) -> str:
        while not self.left.empty():
            self.by_endpoint.pop(self.left.get_nowait(), None)
        endpoint = reg["endpoint"]
        known = self.by_endpoint.get(endpoint)
        if known is not None:
            return known
        try:
            added: str | bytes = self.agent.add_remote_agent(kv.metadata_bytes(reg["agent_metadata"]))
            name = added.decode() if isinstance(added, bytes) else str(added)
        except Exception as e:
            # NIXL refuses an agent name it already holds (NOT_ALLOWED); then it is usable as is.
            if "NOT_ALLOWED" not in str(e) and "NotAllowed" not in type(e).__name__:
                raise
            name = str(reg["agent_name"])
        self.by_endpoint[endpoint] = name
        return name


# Which KV writes a faulty transport never posts (the scenario's fault).
HangRule = Callable[[PrefillReq], bool]


class KVSender:
    """One thread that owns the NIXL agent's transfers, polling all in flight at once."""

    def __init__(self, agent: nixl_agent, pool: kv.SlotPool, rec: pdrec.Recorder, hangs: HangRule | None = None):
        self.agent = agent
        # Fault: which writes are never posted (a transport that swallows them); None: none.
        self.hangs = hangs
        self.hung = 0
        self.pool = pool
        self.rec = rec
        self.peers = BootstrapPeers(agent)
        self.jobs: queue.SimpleQueue[PrefillReq] = queue.SimpleQueue()
        self.status: dict[int, str] = {}  # room -> TRANSFERRING / SUCCESS / FAILED; read by the scheduler
        self.live: dict[int, tuple[PrefillReq, nixl_xfer_handle]] = {}  # room -> the xfer handle still held
        self.errors = 0
        self.bytes_sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, req: PrefillReq) -> None:
        self.status[req.room] = TRANSFERRING
        self.jobs.put(req)

    def forget(self, room: int) -> None:
        self.status.pop(room, None)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                req = self.jobs.get(timeout=0.002 if self.live else 0.05)
                self._begin(req)
            except queue.Empty:
                pass
            self._poll()

    def _fail(self, req: PrefillReq, what: str, err: object) -> None:
        # The KV sender of the incident: log, count, and move on. The room's
        # status stays TRANSFERRING, so the scheduler keeps the leg in transfer.
        self.errors += 1
        self.rec.counter("kv_transfer_errors")
        # Said to pdwatch too, as an error of the open leg: it stays open, which is the point.
        self.rec.leg_error(req.rid, f"KV write failed at {what}: {err}")
        log.error("KV transfer of room %d (%s) to %s failed at %s: %s",
                  req.room, req.rid, req.reg.get("endpoint") if req.reg else "?", what, err)

    def _begin(self, req: PrefillReq) -> None:
        if req.room not in self.status:
            return  # aborted before the sender got to it
        reg = req.reg or {}
        if self.hangs is not None and self.hangs(req):
            self.hung += 1  # never posted: the room stays TRANSFERRING, the leg in transfer, for good
            return
        try:
            peer = self.peers.resolve(reg)
            self.rec.transfer_info(req.rid, peer=peer)  # the agent it really writes to, stale or not
            assert req.slot is not None, "a request reaches the sender with its KV slot"
            local = self.agent.get_xfer_descs([(self.pool.addr(req.slot), req.nbytes, 0)], "DRAM")
            remote = self.agent.get_xfer_descs([(int(reg["addr"]), req.nbytes, 0)], "DRAM")
            handle = self.agent.initialize_xfer("WRITE", local, remote, peer, f"kv:{req.room}".encode())
        except Exception as e:
            self._fail(req, "initialize_xfer", e)
            return
        try:
            state = self.agent.transfer(handle)
        except Exception as e:
            self._release(handle)
            self._fail(req, "transfer", e)
            return
        if state == "ERR":
            self._release(handle)
            self._fail(req, "transfer", "state ERR")
            return
        self.live[req.room] = (req, handle)

    def _poll(self) -> None:
        for room, (req, handle) in list(self.live.items()):
            err: object
            try:
                state = self.agent.check_xfer_state(handle)
            except Exception as e:
                state, err = "ERR", e
            else:
                err = "state ERR"
            if state == "PROC":
                continue
            del self.live[room]
            self._release(handle)
            if state == "DONE":
                self.bytes_sent += req.nbytes
                if room in self.status:
                    self.status[room] = SUCCESS
            else:
                self._fail(req, "check_xfer_state", err)

    def _release(self, handle: nixl_xfer_handle) -> None:
        try:
            self.agent.release_xfer_handle(handle)
        except Exception:
            log.debug("release_xfer_handle failed", exc_info=True)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2.0)


def _hang_rule(args: argparse.Namespace) -> HangRule | None:
    """The scenario's transport fault, if any: long prompts, or a random share of every write."""
    over: int = getattr(args, "hang_prompts_over", 0)
    share: float = getattr(args, "hang_fraction", 0.0)
    if over > 0:
        return lambda req: req.prompt_tokens > over
    if share > 0:
        rng = random.Random(int(os.environ.get(c.ENV_TESTBED_SEED, "1")))
        return lambda req: rng.random() < share
    return None


class PrefillEngine:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.agent_name = f"{args.instance}-{uuid.uuid4().hex[:8]}"
        self.api = LineServer(args.api_port, self._on_api)
        self.bootstrap_server = LineServer(args.bootstrap_port, self._on_bootstrap)
        # Decodes know this process by its bootstrap address; nobody else by its agent, but it is its KV name.
        peers = (self.agent_name, f"127.0.0.1:{self.bootstrap_server.port}")
        # Its waiting queue is a deque taken from the front, head of line first (_forward): fcfs.
        self.rec = pdrec.from_env("prefill", service_name=args.service_name, engine_version="testbed",
                                  loop_idle_turn_s=IDLE_TURN_S, schedule_policy=c.SCHEDULE_FCFS,
                                  gpu_uuids=tuple(args.gpu_uuid or ()), peer_ids=peers)
        self.status = StatusWriter(args.status_file)
        self.agent = kv.make_agent(self.agent_name)
        self.pool = kv.SlotPool(self.agent, args.slots, args.slot_bytes)
        self.sender = KVSender(self.agent, self.pool, self.rec, hangs=_hang_rule(args))
        # Filled by server threads, drained by the scheduler thread, in arrival order.
        self.inbox: deque[Message] = deque()
        self.registrations: OrderedDict[int, Message] = OrderedDict()
        self._reg_lock = threading.Lock()
        self.bootstrap: dict[int, PrefillReq] = {}
        self.waiting: deque[PrefillReq] = deque()
        self.inflight: dict[int, PrefillReq] = {}
        self.by_room: dict[int, PrefillReq] = {}
        self._deferred: list[PrefillReq] = []  # finished legs whose slot a WRITE may still read
        self._seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)

    # ---- server threads --------------------------------------------------

    def _on_api(self, msg: Message, conn: Conn) -> Message:
        op = msg.get("op")
        if op in ("generate", "abort"):
            try:
                room_of(msg)
            except WireError as e:
                return {"ok": False, "error": str(e)}
            self.inbox.append(msg)
            return {"ok": True}
        if op == "stats":
            return {"ok": True, "kv_bytes_sent": self.sender.bytes_sent, "kv_transfer_errors": self.sender.errors,
                    "open": len(self.by_room), "free_slots": self.pool.free_count}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def _on_bootstrap(self, msg: Message, conn: Conn) -> Message:
        if msg.get("op") == "deregister" and isinstance(msg.get("endpoint"), str):
            # A decode's clean exit (what an orderly scale-down or rolling restart does); a killed one never says it.
            self.sender.peers.forget(msg["endpoint"])
            return {"ok": True}
        if msg.get("op") != "register":
            return {"ok": False, "error": f"unknown op {msg.get('op')!r}"}
        missing = [k for k in ("room", "endpoint", "agent_name", "agent_metadata", "addr", "nbytes") if k not in msg]
        if missing:
            return {"ok": False, "error": f"registration lacks {', '.join(missing)}"}
        try:
            room_of(msg)
        except WireError as e:
            return {"ok": False, "error": str(e)}
        with self._reg_lock:
            self.registrations[int(msg["room"])] = msg
            while len(self.registrations) > MAX_EARLY_REGISTRATIONS:
                self.registrations.popitem(last=False)
        return {"ok": True, "room": msg["room"]}

    # ---- scheduler thread ------------------------------------------------

    def _loop(self) -> None:
        idle_sleep = 0.002
        while not self._stop.is_set():
            self.rec.loop_tick()
            try:
                busy = self._step()
            except Exception:
                log.exception("scheduler step failed")
                busy = False
            if not busy:
                time.sleep(idle_sleep)

    def _step(self) -> bool:
        busy = self._take_inbox()
        busy |= self._bootstrap_queue()
        busy |= self._forward()
        busy |= self._inflight_queue()
        if self._deferred:
            self._reclaim()
        return busy

    def _take_inbox(self) -> bool:
        busy = False
        while self.inbox:
            msg = self.inbox.popleft()
            busy = True
            room = int(msg["room"])
            if msg["op"] == "abort":
                self._abort(room, msg.get("reason") or "aborted by router")
                continue
            self._seq += 1
            req = PrefillReq(rid=f"p-{self._seq}", room=room, prompt_tokens=int(msg.get("prompt_tokens", 1)),
                             traceparent=msg.get("traceparent"))
            req.nbytes = min(max(1, req.prompt_tokens) * self.args.bytes_per_token, self.args.slot_bytes)
            self.rec.arrive(req.rid, bootstrap_room=room, traceparent=req.traceparent,
                            prompt_tokens=req.prompt_tokens, peer=msg.get("decode"))
            self.rec.enter(req.rid, BOOTSTRAP)
            self.bootstrap[room] = req
            self.by_room[room] = req
        return busy

    def _bootstrap_queue(self) -> bool:
        busy = False
        now = time.monotonic()
        for room, req in list(self.bootstrap.items()):
            with self._reg_lock:
                reg = self.registrations.pop(room, None)
            if reg is not None:
                req.reg = reg
                del self.bootstrap[room]
                self.rec.enter(req.rid, QUEUED)
                self.waiting.append(req)
                busy = True
            elif now - req.arrived > self.args.bootstrap_timeout_s:
                del self.bootstrap[room]
                self._finish(req, "timeout", "bootstrap timed out")
        return busy

    def _forward(self) -> bool:
        batch = []
        while self.waiting:
            slot = self.pool.alloc()
            if slot is None:
                break  # KV pool full: the rest stay queued
            req = self.waiting.popleft()
            req.slot = slot
            batch.append(req)
        if not batch:
            return False
        for req in batch:
            self.rec.enter(req.rid, PREFILL)
        # The forward pass: cost proportional to the prompt tokens of the batch.
        forward_s = self.args.forward_s_per_token * sum(r.prompt_tokens for r in batch)
        time.sleep(forward_s)
        self.status.work(forward_s)
        for req in batch:
            reg, slot = req.reg, req.slot
            assert reg is not None and slot is not None, "registered in bootstrap, given a slot for this batch"
            if req.nbytes > int(reg.get("nbytes", 0)):
                self._finish(req, "failed", f"decode slot of {reg.get('nbytes')} bytes < KV {req.nbytes}")
                continue
            self.pool.view(slot, req.nbytes)[:] = kv.kv_pattern(req.room, req.nbytes)
            self.rec.enter(req.rid, TRANSFER)
            self.rec.transfer_info(req.rid, nbytes=req.nbytes, backend="nixl", peer=reg.get("agent_name"))
            self.inflight[req.room] = req
            self.sender.submit(req)
        return True

    def _inflight_queue(self) -> bool:
        busy = False
        for room, req in list(self.inflight.items()):
            state = self.sender.status.get(room)
            if state == SUCCESS:
                del self.inflight[room]
                self._finish(req, "ok", None)
                busy = True
            elif state == FAILED:
                del self.inflight[room]
                self._finish(req, "failed", "KV transfer failed")
                busy = True
        return busy

    def _abort(self, room: int, reason: str) -> None:
        req = self.by_room.get(room)
        if req is None:
            return
        self.bootstrap.pop(room, None)
        self.inflight.pop(room, None)
        try:
            self.waiting.remove(req)
        except ValueError:
            pass
        self._finish(req, "aborted", reason)

    def _finish(self, req: PrefillReq, outcome: str, reason: str | None) -> None:
        self.rec.finish(req.rid, outcome, reason=reason)
        self.by_room.pop(req.room, None)
        self.sender.forget(req.room)
        # A slot whose WRITE may still be in flight is not reused; it is
        # returned once the sender lets go of it (see _reclaim).
        if req.slot is not None:
            if req.room in self.sender.live:
                self._deferred.append(req)
            else:
                self.pool.free(req.slot)
                req.slot = None

    def _reclaim(self) -> None:
        for req in list(self._deferred):
            if req.room not in self.sender.live and req.slot is not None:  # deferred legs hold a slot
                self._deferred.remove(req)
                self.pool.free(req.slot)
                req.slot = None

    # ---- life cycle ------------------------------------------------------

    def start(self) -> Ready:
        self.status.start()
        self.sender.start()
        self.api.serve_in_thread("api-server")
        self.bootstrap_server.serve_in_thread("bootstrap-server")
        self._thread.start()
        return {"role": "prefill", "instance": self.args.instance, "agent": self.agent_name,
                "api_port": self.api.port, "bootstrap_port": self.bootstrap_server.port}

    def shutdown(self) -> None:
        self._stop.set()
        for server in (self.api, self.bootstrap_server):
            server.shutdown()
            server.server_close()
        self._thread.join(2.0)
        self.sender.stop()
        self.status.stop()
        self.rec.shutdown(timeout_s=2.0)
