"""A tensor-parallel decode group of two processes with a real per-step barrier.

Rank 0 is the decode engine (`pdwatch.testbed.decode`): it owns the requests, the
NIXL agent and the inventory. Before every forward (and every ~20 ms while
idle, as SGLang broadcasts new requests each scheduler iteration) it calls
`TpLeader.sync()`, which sends one byte to rank 1 over loopback TCP and waits
for rank 1's byte back: the collective. Rank 1 (`TpFollower`, its own process)
joins each step and heartbeats as rank 1 of the same `pd.instance`.

The fault (`desync`, SIGUSR1 to rank 1): rank 1 stops joining steps while its
heartbeats go on. Rank 0 then waits in `sync()` for good: its scheduler loop
(and its loop counter) freezes while its heartbeat thread keeps going, and
the wait is counted as spin time, which the GPU emulation shows as a GPU at
~100 % (NCCL kernels spinning on a flag).
"""

from __future__ import annotations

import argparse
import logging
import select
import socket
import threading
import time

from pdwatch.engine_patches import recorder as pdrec

from .engine import Ready
from .engine_status import StatusWriter

log = logging.getLogger("pdwatch.testbed.tp")

STEP_BUSY, STEP_IDLE, ACK = b"B", b"I", b"A"
POLL_S = 0.05  # how often a waiting rank looks at its stop flag
# The testbed's engine loops turn every few milliseconds while idle (a TP group meets every 20 ms):
# at most this long, with room to spare, which every emulated engine tells its recorder.
IDLE_TURN_S = 0.1


class TpLeader:
    """Rank 0's end: listens on `port` for rank 1; `sync()` is the per-step barrier."""

    def __init__(self, port: int, status: StatusWriter, stop: threading.Event):
        self.status = status
        self.stop = stop
        self.listener = socket.create_server(("127.0.0.1", port))
        self.port = self.listener.getsockname()[1]
        self.peer: socket.socket | None = None
        self.steps = 0

    def _accept(self) -> socket.socket | None:
        """Rank 1's connection, waited for at the first step; None if the engine stops first."""
        while self.peer is None:
            if self.stop.is_set():
                return None
            ready, _, _ = select.select([self.listener], [], [], POLL_S)
            if ready:
                conn, _ = self.listener.accept()
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.peer = conn
        return self.peer

    def sync(self, batch_running: bool) -> bool:
        """One collective step with rank 1. Blocks until rank 1 joins or the engine stops (then False)."""
        t0 = time.monotonic()
        try:
            peer = self._accept()
            if peer is None:
                return False
            peer.sendall(STEP_BUSY if batch_running else STEP_IDLE)
            while True:
                ready, _, _ = select.select([peer], [], [], POLL_S)
                if ready:
                    got = peer.recv(1)
                    if got == ACK:
                        self.steps += 1
                        return True
                    if not got:
                        # Rank 1 is gone: a real collective would hang, and so does this one.
                        self.stop.wait()
                        return False
                # Waiting for the peer inside the collective: the GPU spins, the loop is frozen.
                self.status.spin(time.monotonic() - t0)
                t0 = time.monotonic()
                if self.stop.is_set():
                    return False
        except OSError:
            log.exception("TP barrier failed")
            self.stop.wait()
            return False
        finally:
            # Every moment inside the collective is GPU spin; in a healthy step it is ~0.1 ms.
            self.status.spin(time.monotonic() - t0)

    def close(self) -> None:
        for s in (self.peer, self.listener):
            if s is not None:
                try:
                    s.close()
                except OSError:
                    pass


class TpFollower:
    """Rank 1 of a TP-2 decode group: joins rank 0's steps, heartbeats, owns no requests."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rec = pdrec.from_env("decode", service_name=args.service_name, engine_version="testbed",
                                  loop_idle_turn_s=IDLE_TURN_S,
                                  tp_rank=args.tp_rank, tp_size=args.tp_size, owns_requests=False,
                                  gpu_uuids=tuple(args.gpu_uuid or ()))
        self.status = StatusWriter(args.status_file)
        self._stop = threading.Event()
        self._desync = threading.Event()
        self.sock: socket.socket | None = None
        self._thread = threading.Thread(target=self._loop, name="tp-rank", daemon=True)

    def start(self) -> Ready:
        deadline = time.monotonic() + 20.0
        while True:
            try:
                self.sock = socket.create_connection(("127.0.0.1", self.args.tp_port), timeout=2.0)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.status.start()
        self._thread.start()
        return {"role": "decode", "instance": self.args.instance, "tp_rank": self.args.tp_rank}

    def fault(self) -> None:
        """Stop joining steps (called from the SIGUSR1 handler: only sets a flag)."""
        self._desync.set()

    def _loop(self) -> None:
        sock = self.sock  # connected before this thread starts
        if sock is None:
            return
        last, busy = time.monotonic(), False
        while not self._stop.is_set():
            if self._desync.is_set():
                log.warning("rank %d stops joining the collective", self.args.tp_rank)
                self._stop.wait()  # heartbeats go on from the recorder's thread
                return
            try:
                ready, _, _ = select.select([sock], [], [], POLL_S)
                if not ready:
                    continue
                got = sock.recv(1)
                if not got:
                    return  # rank 0 went away
                now = time.monotonic()
                if busy:
                    self.status.work(now - last)  # this rank computed its shard of the last step
                last, busy = now, got == STEP_BUSY
                self.rec.loop_tick()
                if self._desync.is_set():
                    continue  # the fault came while this step was in hand: it is never acknowledged
                sock.sendall(ACK)
            except OSError:
                if not self._stop.is_set():
                    log.exception("TP rank %d lost rank 0", self.args.tp_rank)
                return

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self.status.stop()
        if self.sock is not None:
            self.sock.close()
        self.rec.shutdown(timeout_s=2.0)
