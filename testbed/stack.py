"""The testbed stack: one prefill, two decodes (OS processes over NIXL), router here.

    stack = Stack("decode-restart", otlp_endpoint="http://127.0.0.1:4318")
    stack = Stack("tp-desync", gpus=GpuEmulator.for_demo())  # each engine process drives its own emulated GPU
    stack.start()                 # returns once every engine is ready
    stack.poll_events()           # [{"event": "restart", "instance": "decode-0", "t": ...}, ...]
    stack.truth()                 # the router's ground truth
    stack.stop()                  # bounded, leaves no process behind
"""

from __future__ import annotations

import atexit
import logging
import math
import random
import shutil
import signal
import tempfile
import threading
import time
import weakref
from pathlib import Path

from pdwatch import contract as c

from . import scenarios
from .gpu_emulation import GpuEmulator
from .gpu_feed import Feed, GpuFeed
from .processes import EngineProcess, EngineStartError, free_port
from .router import LoadGenerator, Router, Truth
from .wire import Conn

log = logging.getLogger("pdwatch.testbed.stack")

_live_stacks: weakref.WeakSet[Stack] = weakref.WeakSet()
# desync-idle waits at most this long for its instance to hold no request.
IDLE_WAIT_S = 30.0


@atexit.register
def _stop_all() -> None:
    for stack in list(_live_stacks):
        stack.stop()


class StackBase:
    """What every testbed stack shares: timed scenario actions, events, the ground truth, load, stop.

    A stack sets `scenario`, `params`, `router` (anything with `truth()`),
    `loadgen` and `engines`, and defines `_action_<name>` for its scenario's actions.
    """

    def _init_common(self) -> None:
        self.engines: dict = {}
        self.router = None
        self.loadgen: LoadGenerator | None = None
        self.started_at: float | None = None
        self._events: list[dict] = []
        self._events_lock = threading.Lock()
        self._stop = threading.Event()
        self._stopped = False
        self._actions_thread: threading.Thread | None = None
        self._proc_lock = threading.Lock()

    # ---- scenario actions ----------------------------------------------------

    def _start_actions(self) -> None:
        self._actions_thread = threading.Thread(target=self._run_actions, name="scenario-actions", daemon=True)
        self._actions_thread.start()

    def _run_actions(self) -> None:
        t0 = time.monotonic()
        for at_s, action, instance in sorted(self.scenario.actions(self.params)):
            if self._stop.wait(max(0.0, at_s - (time.monotonic() - t0))):
                return
            try:
                getattr(self, f"_action_{action.replace('-', '_')}")(instance)
            except Exception as e:
                log.exception("scenario action %s on %s failed", action, instance)
                self._event("action_failed", action=action, instance=instance, error=str(e))

    def _action_freeze(self, instance: str) -> None:
        """SIGSTOP the engine's process group: it keeps its sockets and state but runs nothing,
        heartbeats included (stop sends SIGCONT first, so it can still exit cleanly)."""
        self.engines[instance].signal(signal.SIGSTOP)
        self._event("frozen", instance=instance)

    # ---- what callers read -----------------------------------------------------

    def _event(self, name: str, **fields) -> dict:
        event = {"event": name, "t": fields.pop("t", time.time()), **fields}
        with self._events_lock:
            self._events.append(event)
            del self._events[:-1000]  # bounded: a caller that never polls loses the oldest
        return event

    def poll_events(self) -> list[dict]:
        with self._events_lock:
            out, self._events = self._events, []
        return out

    def truth(self) -> Truth:
        if self.router is None:
            return Truth(requests=[])
        return self.router.truth()

    def logs(self, instance: str, n: int = 50) -> list[str]:
        return list(self.engines[instance].log)[-n:]

    def pids(self) -> dict[str, int | None]:
        return {name: proc.pid for name, proc in self.engines.items()}

    def stop(self) -> None:
        """Stop load, router and engines within about stop_timeout_s; idempotent."""
        with self._proc_lock:
            if self._stopped:
                return
            self._stopped = True
        self._stop.set()
        if self.loadgen is not None:
            self.loadgen.stop()
        if self.router is not None:
            self.router.close()
        if self._actions_thread is not None:
            self._actions_thread.join(self.stop_timeout_s)
        for proc in self.engines.values():
            proc.begin_stop()
        deadline = time.monotonic() + self.stop_timeout_s
        for proc in self.engines.values():
            proc.finish_stop(deadline)
        self._release()
        self._event("stopped")

    def _release(self) -> None:
        """What the stack holds beyond its processes (folders, emulated GPUs); stop() calls it once."""

    def stop_load(self) -> None:
        """End the load early; engines keep running (and open requests stay open)."""
        if self.loadgen is not None:
            self.loadgen.stop()

    @property
    def load_done(self) -> bool:
        return self.loadgen is not None and self.loadgen.finished

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class Stack(StackBase):
    def __init__(
        self,
        scenario: str,
        otlp_endpoint: str = c.DEFAULT_SIDECAR_URL,
        heartbeat_s: float = 1.0,
        rate: float = 4.0,
        restart_at: float = 8.0,
        seed: int = 1,
        decode_floor_s: float = 30.0,
        cluster: str = "default",
        duration_s: float | None = None,
        traceparent: bool = False,
        *,
        decodes: int = 2,
        token_interval_s: float = 0.05,
        max_requests: int | None = None,
        ready_timeout_s: float = 30.0,
        stop_timeout_s: float = 5.0,
        gpus: GpuEmulator | None = None,
    ):
        self.scenario = scenarios.get(scenario)
        for name, value in (("heartbeat_s", heartbeat_s), ("rate", rate), ("decode_floor_s", decode_floor_s),
                            ("token_interval_s", token_interval_s), ("ready_timeout_s", ready_timeout_s)):
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if restart_at < 0:
            raise ValueError(f"restart_at must not be negative, got {restart_at}")
        if duration_s is not None and not duration_s > 0:
            raise ValueError(f"duration_s must be positive or None, got {duration_s}")
        if decodes < 1:
            raise ValueError(f"decodes must be at least 1, got {decodes}")
        if not otlp_endpoint.startswith(("http://127.0.0.1", "http://localhost", "http://[::1]")):
            raise ValueError(f"otlp_endpoint must be a loopback http URL, got {otlp_endpoint!r}")
        self.params = scenarios.Params(rate=rate, restart_at=restart_at, decode_floor_s=decode_floor_s,
                                       token_interval_s=token_interval_s)
        self.decode_names = [f"decode-{i}" for i in range(decodes)]
        self.tp = self.scenario.tp_groups(self.params)  # decode instance -> TP size
        for name, size in self.tp.items():
            if name not in self.decode_names or size not in (1, 2):
                raise ValueError(f"scenario {self.scenario.name!r}: TP group {name}={size} needs a decode and size 1 or 2")
        self.otlp_endpoint = otlp_endpoint
        self.heartbeat_s = heartbeat_s
        self.cluster = cluster
        self.seed = seed
        self.duration_s = duration_s
        self.traceparent = traceparent
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        if max_requests is None:
            # Bounded even when no duration is given: one hour at the rate.
            horizon = duration_s if duration_s is not None else 3600.0
            max_requests = math.ceil(rate * horizon * 1.5) + 10
        self.max_requests = max_requests
        self._init_common()
        self.engines: dict[str, EngineProcess] = {}  # by instance; TP rank 1 of X is "X/tp1"
        self._tp_ports: dict[str, int] = {}
        self.gpus = gpus
        self.gpu_of: dict[str, int] = {}  # engine key -> emulated GPU index
        self._feed: GpuFeed | None = None
        self._status_dir: Path | None = None
        self.router: Router | None = None
        self._bootstrap_port = 0

    # ---- processes ---------------------------------------------------------

    def _engine_env(self, instance: str) -> dict[str, str]:
        return {
            c.ENV_CLUSTER: self.cluster,
            c.ENV_INSTANCE: instance,
            c.ENV_HEARTBEAT: str(self.heartbeat_s),
            c.ENV_OTLP_ENDPOINT: self.otlp_endpoint,
            "UCX_NET_DEVICES": "lo",
            "UCX_TLS": "tcp,self,sm",
        }

    def _engine(self, instance: str, role: str, args: list[str], key: str | None = None) -> EngineProcess:
        key = key or instance
        extra = self.scenario.engine_args(self.params, instance) if key == instance else []
        proc = EngineProcess(instance, role, [*args, *extra, *self._gpu_args(key)], self._engine_env(instance))
        self.engines[key] = proc
        return proc

    def _gpu_args(self, key: str) -> list[str]:
        """The engine's own emulated GPU (claimed once, kept across restarts) and its status file."""
        if self.gpus is None:
            return []
        if key not in self.gpu_of:
            self.gpu_of[key] = self.gpus.claim(1)[0]
        return ["--gpu-uuid", self.gpus.uuid(self.gpu_of[key]),
                "--status-file", str(self._status_path(key))]

    def _status_path(self, key: str) -> Path:
        if self._status_dir is None:
            self._status_dir = Path(tempfile.mkdtemp(prefix="pdwatch-testbed-status-"))
        return self._status_dir / (key.replace("/", "-") + ".json")

    def _decode_args(self, instance: str, port: int = 0) -> list[str]:
        args = ["--api-port", str(port), "--prefill-bootstrap-port", str(self._bootstrap_port),
                "--token-interval-s", str(self.params.token_interval_s), "--slots", "64"]
        if self.tp.get(instance, 1) > 1:
            args += ["--tp-size", str(self.tp[instance]), "--tp-port", str(self._tp_ports[instance])]
        return args

    def start(self) -> Stack:
        if self.started_at is not None:
            raise RuntimeError("Stack.start() was already called")
        _live_stacks.add(self)
        self.started_at = time.time()
        try:
            # The bootstrap port is chosen here so that all engines start at
            # once: a decode needs it only when its first request registers.
            self._bootstrap_port = free_port()
            prefill = self._engine("prefill-0", "prefill",
                                   ["--slots", "512", "--bootstrap-port", str(self._bootstrap_port)])
            for name, size in self.tp.items():
                if size > 1:
                    self._tp_ports[name] = free_port()
            decodes = [self._engine(name, "decode", self._decode_args(name)) for name in self.decode_names]
            followers = [self._engine(name, "decode", ["--tp-rank", "1", "--tp-size", str(self.tp[name]),
                                                       "--tp-port", str(port)], key=f"{name}/tp1")
                         for name, port in self._tp_ports.items()]
            for proc in (prefill, *decodes, *followers):
                proc.spawn()
            for proc in (prefill, *decodes, *followers):
                proc.wait_ready(self.ready_timeout_s, cancel=self._stop)
            if self.gpus is not None:
                self._feed = GpuFeed(self.gpus)
                for key, proc in self.engines.items():
                    self._feed.add(Feed(self.gpu_of[key], self._status_path(key),
                                        lambda p=proc: p.pid if p.alive() else None))
                self._feed.start()
        except BaseException:
            self.stop()
            raise
        self.router = Router(prefill.info["api_port"], {p.instance: p.info["api_port"] for p in decodes},
                             seed=self.seed, traceparent=self.traceparent)
        self._event("ready", instances={name: p.info.get("agent") for name, p in self.engines.items()},
                    startup_s=round(time.time() - self.started_at, 3))
        self.loadgen = LoadGenerator(self.router, lambda rng, i: self.scenario.shape(self.params, rng, i),
                                     rate=self.params.rate, seed=self.seed, duration_s=self.duration_s,
                                     max_requests=self.max_requests)
        self.loadgen.start()
        self._start_actions()
        return self

    # ---- scenario actions ----------------------------------------------------

    def _action_restart(self, instance: str) -> None:
        self.restart(instance)

    def restart(self, instance: str) -> dict:
        """Kill `instance` (SIGKILL) and start it again alone, on the same port, with a new NIXL agent."""
        proc = self.engines[instance]
        if proc.role != "decode" or self.tp.get(instance, 1) > 1:
            raise ValueError("only single-process decode instances are restarted by the testbed")
        with self._proc_lock:  # stop() must not miss a process spawned while it runs
            if self._stopped:
                raise RuntimeError("the stack is stopped")
            old_agent, port = proc.info.get("agent"), proc.info["api_port"]
            t = time.time()
            proc.kill()
            if self.router is not None:
                self.router.note_restart(instance, t)
            self._event("killed", instance=instance, t=t, agent=old_agent)
            proc.args = [*self._decode_args(instance, port), *self.scenario.engine_args(self.params, instance),
                         *self._gpu_args(instance)]
            proc.spawn()
        info = proc.wait_ready(self.ready_timeout_s, cancel=self._stop)
        return self._event("restart", instance=instance, t=t, old_agent=old_agent, new_agent=info.get("agent"),
                           ready_after_s=round(time.time() - t, 3))

    def _action_desync(self, instance: str) -> None:
        """Rank 1 of the instance's TP group stops joining the per-step collective."""
        key = f"{instance}/tp1"
        if key not in self.engines:
            raise ValueError(f"{instance} is not a TP group")
        self.engines[key].signal(signal.SIGUSR1)
        self._event("desync", instance=instance)

    def _action_desync_idle(self, instance: str) -> None:
        """Like desync, at a moment the group's leader holds no request (bounded wait; else at once)."""
        conn = Conn.connect(self.engines[instance].info["api_port"])
        idle, deadline = False, time.monotonic() + IDLE_WAIT_S
        try:
            while not self._stop.is_set() and time.monotonic() < deadline:
                if conn.request({"op": "stats"}).get("held") == 0:
                    idle = True
                    break
                time.sleep(0.005)
        finally:
            conn.close()
        self._action_desync(instance)
        self._event("desync_idle", instance=instance, idle=idle)

    def _action_kv_leak(self, instance: str) -> None:
        """From now on the decode never gives back the KV slot of a request it finishes."""
        conn = Conn.connect(self.engines[instance].info["api_port"])
        try:
            reply = conn.request({"op": "kv_leak"})
        finally:
            conn.close()
        self._event("kv_leak", instance=instance, free_slots=reply.get("free_slots"))

    def _action_burst(self, instance: str) -> None:
        """`params.burst_size` requests at once on top of the steady load (instance: unused, "router")."""
        if self.router is None:
            return
        rng = random.Random(self.seed + 7919)
        sent = 0
        for i in range(self.params.burst_size):
            if self._stop.is_set():
                break
            prompt, out = self.scenario.shape(self.params, rng, -1 - i)
            if self.router.send(prompt, out) is not None:
                sent += 1
        self._event("burst", sent=sent)

    # ---- stop ------------------------------------------------------------------

    def _release(self) -> None:
        if self._feed is not None:
            self._feed.stop()
        if self.gpus is not None:
            self.gpus.release(list(self.gpu_of.values()))
        if self._status_dir is not None:
            shutil.rmtree(self._status_dir, ignore_errors=True)
        _live_stacks.discard(self)

__all__ = ["Stack", "Truth", "EngineStartError"]
