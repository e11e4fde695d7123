"""The lifecycle recorder engine adapters call at every stage transition.

Two halves. The engine (scheduler) thread calls `arrive`, `enter`, `token`,
`finish` ...: each takes a timestamp and appends one tuple to a bounded
buffer, nothing else, and never raises. A daemon worker thread drains the
buffer every `drain_interval_s`, keeps the open-leg table, writes spans with
the recorded times, sends a heartbeat with the open-leg inventory every
`heartbeat_s` and posts what it wrote (export_queue.py). A sidecar that is down or slow costs the engine nothing but
dropped telemetry, which is counted and reported in the next heartbeat.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry.util.types import AttributeValue

from pdwatch import contract as c

from . import otlp
from .config import RecorderConfig
from .export_queue import ExportQueue
from .legs import LegDone, LegTable, Piece, StageDone, room_from_key
from .otlp_http import HttpTransport, Transport

log = logging.getLogger("pdwatch.recorder")

# Record kinds in the hot-path buffer.
_ARRIVE, _ENTER, _XFER, _TOKEN, _FINISH, _COUNTER, _ERROR = range(7)
# (kind, rid or counter name, timestamp or 0, the kind's argument: one value or a tuple of them)
_Record = tuple[int, str, int, Any]

__all__ = ["Recorder", "RecorderConfig"]


class Recorder:
    def __init__(
        self,
        config: RecorderConfig,
        *,
        transport: Transport | None = None,
        clock: Callable[[], int] = time.time_ns,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.config = cfg = config.resolved(environ)
        self.instance_id = uuid.uuid4().hex
        self.start_ns = clock()
        self._clock = clock
        self._buf: deque[_Record] = deque()
        self._buf_max = cfg.buffer_max
        # Hot-path counters: plain ints written by engine threads, read by the worker.
        self.dropped = 0
        self.hook_errors = 0
        self.loop_iterations = 0
        self._engine_counters: dict[str, int] = {}
        self.legs = LegTable(cfg.role, cfg.max_open_legs, cfg.transfer_backend)
        if transport is None:
            transport = HttpTransport(f"{cfg.endpoint}/v1/traces", timeout_s=cfg.export_timeout_s,
                                      headers=cfg.headers, cafile=cfg.certificate,
                                      compression=cfg.compression or "none")
        self.export = ExportQueue(otlp.resource(cfg, self.instance_id, self.start_ns), transport,
                                  max_queue=cfg.max_export_queue)
        self.worker_errors = 0
        # The worker thread's own CPU seconds, as of its last wake-up: what pdwatch's span
        # building and export cost the engine process, apart from the hooks on its threads.
        self.worker_cpu_s = 0.0
        self.heartbeat_seq = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # serialises drains and heartbeats (worker vs flush)
        self._post_lock = threading.Lock()  # serialises posts, apart: a slow post must not hold up a drain

    # ---- engine thread: one append each, never raises -------------------

    def _put(self, record: _Record) -> None:
        if len(self._buf) >= self._buf_max:
            self.dropped += 1
            return
        self._buf.append(record)

    def arrive(self, rid: str, *, bootstrap_room: int | None = None, traceparent: str | None = None,
               prompt_tokens: int | None = None, peer: str | None = None, probe: bool = False,
               room_key: str | None = None, stage: str | None = None) -> None:
        """A leg arrives. room_key: a string both legs know, hashed to the room on the worker thread (an
        engine with no bootstrap room of its own; the hash is most of a microsecond). stage: the stage the
        leg enters at the same instant, in the same record (one clock read and one append, not two)."""
        try:
            self._put((_ARRIVE, rid, self._clock(),
                       (bootstrap_room, traceparent, prompt_tokens, peer, probe, room_key, stage)))
        except Exception:
            self.hook_errors += 1

    def enter(self, rid: str, stage: str) -> None:
        try:
            self._put((_ENTER, rid, self._clock(), stage))
        except Exception:
            self.hook_errors += 1

    def transfer_info(self, rid: str, *, nbytes: int | None = None, backend: str | None = None,
                      peer: str | None = None) -> None:
        try:
            self._put((_XFER, rid, self._clock(), (nbytes, backend, peer)))
        except Exception:
            self.hook_errors += 1

    def leg_error(self, rid: str, text: str) -> None:
        """An error the engine met for an open leg without ending it (a KV write it only logged, say)."""
        try:
            self._put((_ERROR, rid, 0, text))
        except Exception:
            self.hook_errors += 1

    def token(self, rid: str, n: int = 1) -> None:
        try:
            self._put((_TOKEN, rid, 0, n))
        except Exception:
            self.hook_errors += 1

    def finish(self, rid: str, outcome: str = "ok", *, reason: str | None = None,
               output_tokens: int | None = None) -> None:
        try:
            self._put((_FINISH, rid, self._clock(), (outcome, reason, output_tokens)))
        except Exception:
            self.hook_errors += 1

    def loop_tick(self) -> None:
        self.loop_iterations += 1

    def counter(self, name: str, n: int = 1) -> None:
        """Engine-specific monotonic counter, sent as heartbeat attribute pd.engine.<name>."""
        try:
            self._put((_COUNTER, name, 0, n))
        except Exception:
            self.hook_errors += 1

    # ---- worker thread ---------------------------------------------------

    def start(self) -> Recorder:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pdwatch-recorder", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        cfg = self.config
        heartbeat_s = cfg.heartbeat_s
        assert heartbeat_s is not None  # resolved() sets it
        next_beat = time.monotonic()  # first heartbeat at once: the sidecar learns the instance
        interval = min(cfg.drain_interval_s, heartbeat_s)  # a heartbeat setting shorter than a drain is kept
        while not self._stop.is_set():
            try:
                self.drain()
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + heartbeat_s
                    self.heartbeat()
                self._post()
            except Exception:
                self.worker_errors += 1
                log.debug("pdwatch recorder worker error", exc_info=True)
            self.worker_cpu_s = time.thread_time()
            self._stop.wait(interval)

    def drain(self) -> int:
        """Apply buffered records and emit the spans they complete."""
        with self._lock:
            buf, legs, n = self._buf, self.legs, 0
            # Tokens are recorded without a clock read (the hottest hook); they
            # take the drain's time, late by at most one drain interval.
            now = self._clock()
            while buf:
                kind, rid, ts, arg = buf.popleft()
                n += 1
                try:
                    if kind == _ENTER:
                        done = legs.enter(rid, ts, arg)
                    elif kind == _TOKEN:
                        legs.token(rid, now, arg)
                        continue
                    elif kind == _ARRIVE:
                        room, traceparent, tokens, peer, probe, key, stage = arg
                        done = legs.arrive(rid, ts, room if key is None else room_from_key(key), traceparent,
                                           tokens, peer, probe)
                        if stage is not None:
                            done += legs.enter(rid, ts, stage)
                    elif kind == _FINISH:
                        done = legs.finish(rid, ts, *arg)
                    elif kind == _XFER:
                        legs.transfer_info(rid, ts, *arg)
                        continue
                    elif kind == _ERROR:
                        legs.error(rid, arg)
                        continue
                    else:
                        self._engine_counters[rid] = self._engine_counters.get(rid, 0) + arg
                        continue
                    if done and self.config.owns_requests:
                        self._emit(done)
                except Exception:
                    self.worker_errors += 1
                    log.debug("pdwatch could not apply record %r", kind, exc_info=True)
            return n

    def _emit(self, pieces: list[Piece]) -> None:
        role, export = self.config.role, self.export
        for piece in pieces:
            span = export.slot()
            if span is None:
                continue  # the export queue is full: dropped, counted there
            if isinstance(piece, StageDone):
                otlp.fill_stage(span, piece, role)
            elif isinstance(piece, LegDone):
                otlp.fill_leg(span, piece, role)

    def heartbeat_attributes(self) -> dict[str, AttributeValue]:
        cfg, legs = self.config, self.legs
        assert cfg.heartbeat_s is not None and cfg.inventory_max is not None  # resolved() sets both
        attrs: dict[str, AttributeValue] = {
            c.H_SEQ: self.heartbeat_seq,
            c.H_INTERVAL: float(cfg.heartbeat_s),
            c.H_LOOP: self.loop_iterations,
            c.H_COMPLETED: legs.completed,
            c.H_FAILED: legs.failed,
            c.H_TOKENS: legs.tokens_generated,
            # The engine side's health (contract v1.2), so the sidecar can tell lost telemetry from quiet.
            # spans_dropped counts both places the engine side drops: the export queue when full, and the
            # hot-path buffer when full (a dropped record is a stage or leg the sidecar never hears of).
            c.H_SPANS_DROPPED: self.export.dropped + self.dropped,
            c.H_EXPORTS_FAILED: self.export.failed_spans,
            c.H_HOOK_ERRORS: self.hook_errors,
            c.H_PLUGIN_STATE: cfg.plugin_state,
            # pdwatch's detail beside them: each place that drops, apart.
            c.H_DROPPED: self.dropped,
            c.H_QUEUE_DROPPED: self.export.dropped,
            c.H_WORKER_ERRORS: self.worker_errors,
            c.H_WORKER_CPU: self.worker_cpu_s,
            c.H_LEGS_EVICTED: legs.evicted,
        }
        if cfg.plugin_refused:
            attrs[c.H_PLUGIN_REFUSED] = list(cfg.plugin_refused)
        if cfg.loop_idle_turn_s is not None:
            attrs[c.H_LOOP_IDLE_TURN] = float(cfg.loop_idle_turn_s)
        for name, value in self._engine_counters.items():
            attrs[c.H_ENGINE_PREFIX + name] = value
        if cfg.owns_requests:
            attrs.update(legs.inventory(cfg.inventory_max))
        return attrs

    def _gauges(self) -> dict[str, float]:
        """The engine's own numbers for this heartbeat; a failure costs their fields, never the heartbeat."""
        if self.config.gauges is None:
            return {}
        try:
            return {name: float(value) for name, value in self.config.gauges().items()}
        except Exception:
            self.worker_errors += 1
            log.debug("pdwatch could not read the engine's gauges", exc_info=True)
            return {}

    def heartbeat(self, final: bool = False) -> None:
        """One heartbeat; `final` marks the process's last (contract v1.2): it leaves in order, and what
        its inventory still lists will never finish."""
        self.heartbeat_seq += 1
        gauges = self._gauges()  # the engine's code: outside the lock the engine's hooks take
        with self._lock:
            span = self.export.slot()
            if span is not None:
                attrs = self.heartbeat_attributes()
                attrs.update(gauges)
                if final:
                    attrs[c.H_FINAL] = True
                otlp.fill_heartbeat(span, attrs, self._clock())

    def stats(self) -> dict[str, int]:
        return {
            "open": len(self.legs.open),
            "completed": self.legs.completed,
            "failed": self.legs.failed,
            "dropped": self.dropped,
            "hook_errors": self.hook_errors,
            "worker_errors": self.worker_errors,
            "spans_queued": self.export.queued,
            "spans_dropped": self.export.dropped,
            "spans_sent": self.export.sent,
            "export_failed_spans": self.export.failed_spans,
            "heartbeats": self.heartbeat_seq,
        }

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Drain and export everything recorded so far (tests, shutdown); False if that took over timeout_s."""
        deadline = time.monotonic() + timeout_s
        self.drain()
        return self._post(deadline)

    def _post(self, deadline: float | None = None) -> bool:
        # One request for everything written since the last post: the resource is
        # copied and encoded once a post, not once a drain.
        with self._lock:
            self.export.seal()
        with self._post_lock:
            return self.export.post(deadline)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        try:
            self.drain()
            self.heartbeat(final=True)
            self._post(time.monotonic() + timeout_s)
            self.export.transport.close()
        except Exception:
            log.debug("pdwatch recorder shutdown error", exc_info=True)


def from_env(role: str, **overrides: Any) -> Recorder:
    """A started recorder configured from the environment (engine adapters)."""
    return Recorder(RecorderConfig(role=role, **overrides), environ=os.environ).start()
