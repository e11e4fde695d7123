"""The emulated testbed stack: one prefill, two decodes (OS processes over NIXL), router here.

    stack = Stack("decode-restart", otlp_endpoint="http://127.0.0.1:4318")
    stack = Stack("tp-desync", gpus=GpuEmulator.for_demo())  # each engine process drives its own emulated GPU
    stack.start()                 # returns once every engine is ready
    stack.poll_events()           # [{"event": "restart", "instance": "decode-0", "t": ...}, ...]
    stack.truth()                 # the router's ground truth
    stack.stop()                  # bounded, leaves no process behind

What it shares with the live SGLang stack is in `stack_base.py`.
"""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdwatch import contract as c

from . import scenarios
from .gpu_emulation import GpuEmulator
from .gpu_feed import Feed, GpuFeed
from .processes import EngineProcess, EngineStartError, free_port
from .router import Router, Truth
from .stack_base import Event, StackArgs, StackBase
from .wire import Conn

if TYPE_CHECKING:
    from typing_extensions import Unpack

# desync-idle and kill-idle wait at most this long for their instance to hold no request.
IDLE_WAIT_S = 30.0
# A decode leaving in order waits at most this long for its requests to finish (and a restarted
# or new one for its first request to complete).
DRAIN_WAIT_S = 60.0
# A decode sent SIGTERM to leave in order gets this long to exit before it is killed.
LEAVE_WAIT_S = 15.0


def _waited(proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Whether the process exited within timeout_s."""
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return False
    return True


class Stack(StackBase):
    catalogue = scenarios.CATALOGUE

    defaults = StackArgs(rate=4.0, restart_at=8.0, traceparent=False, token_interval_s=0.05, ready_timeout_s=30.0,
                         stop_timeout_s=5.0)

    def __init__(self, scenario: str, *, gpus: GpuEmulator | None = None, tuning: Mapping[str, Any] | None = None,
                 **args: Unpack[StackArgs]):
        super().__init__(scenario, tuning=tuning, **args)
        self.tp = self.scenario.tp_groups(self.params)  # decode instance -> TP size
        for name, size in self.tp.items():
            if name not in self.decode_names or size not in (1, 2):
                raise ValueError(f"scenario {self.scenario.name!r}: TP group {name}={size} needs a decode and size 1 or 2")
        self._tp_ports: dict[str, int] = {}
        self.gpus = gpus
        self.gpu_of: dict[str, int] = {}  # engine key -> emulated GPU index
        self._feed: GpuFeed | None = None
        self._status_dir: Path | None = None
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
        self.engines[key] = proc  # by instance; TP rank 1 of X is "X/tp1"
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

    def _launch(self) -> Router:
        # The bootstrap port is chosen here so that all engines start at
        # once: a decode needs it only when its first request registers.
        self._bootstrap_port = free_port()
        prefill = self._engine("prefill-0", "prefill", ["--slots", "512", "--bootstrap-port", str(self._bootstrap_port)])
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
                self._feed.add(Feed(self.gpu_of[key], self._status_path(key), proc.live_pid))
            self._feed.start()
        return Router(prefill.info["api_port"], {p.instance: p.info["api_port"] for p in decodes},
                      seed=self.seed, traceparent=self.traceparent)

    def agents(self) -> dict[str, str | None]:
        """Each engine process's NIXL agent, from its ready line (a TP follower has none)."""
        return {name: p.info.get("agent") for name, p in self.engines.items()}

    # ---- scenario actions ----------------------------------------------------

    def _check_restartable(self, instance: str) -> None:
        if self.engines[instance].role != "decode" or self.tp.get(instance, 1) > 1:
            raise ValueError("only single-process decode instances are restarted by the testbed")

    def _before_respawn(self, instance: str) -> None:
        # Its old API port (the router finds it where it was) and its own emulated GPU again.
        self.engines[instance].args = [*self._decode_args(instance, self.engines[instance].info["api_port"]),
                                       *self.scenario.engine_args(self.params, instance), *self._gpu_args(instance)]

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

    # ---- an ordinary day: what operators and autoscalers do ----------------------

    def _routed(self) -> Router:
        if not isinstance(self.router, Router):
            raise RuntimeError("the stack has no router yet")
        return self.router

    def _drain(self, instance: str) -> bool:
        """Until neither the router nor the decode holds a request of it (bounded by DRAIN_WAIT_S)."""
        router = self._routed()
        deadline = time.monotonic() + DRAIN_WAIT_S
        while not self._stop.is_set() and time.monotonic() < deadline:
            if router.open_on(instance) == 0 and self._held(instance) == 0:
                return True
            time.sleep(0.05)
        return False

    def _leave_in_order(self, instance: str) -> Event:
        """Out of the router, drained, then SIGTERM, as Kubernetes ends a pod; returns once it exited."""
        self._check_restartable(instance)
        self._routed().remove(instance)
        drained = self._drain(instance)
        proc = self.engines[instance]
        t = time.time()
        proc.begin_stop()
        # Its clean exit (deregistration, final heartbeat) takes seconds on a starved CPU: wait for it.
        exited = proc.proc is not None and _waited(proc.proc, max(self.stop_timeout_s, LEAVE_WAIT_S))
        if not exited:
            proc.kill()
        return self._event("left", instance=instance, t=t, drained=drained, exited=exited,
                           exit_status=proc.proc.returncode if proc.proc is not None else None)

    def _start_again(self, instance: str) -> None:
        """Start a decode that left on its old ports (a new NIXL agent) and wait until it is ready."""
        proc = self.engines[instance]
        with self._proc_lock:  # stop() must not miss a process spawned while it runs
            if self._stopped:
                raise RuntimeError("the stack is stopped")
            self._before_respawn(instance)
            proc.spawn()
        proc.wait_ready(self.ready_timeout_s, cancel=self._stop)

    def _served_since(self, instance: str, t: float) -> bool:
        """Until a request sent to `instance` at or after `t` completed ok (bounded by DRAIN_WAIT_S)."""
        deadline = time.monotonic() + DRAIN_WAIT_S
        while not self._stop.is_set() and time.monotonic() < deadline:
            if any(r.decode == instance and r.sent_at >= t and r.outcome == "ok" for r in self.truth().requests):
                return True
            time.sleep(0.1)
        return False

    def _action_scale_down(self, instance: str) -> None:
        """Taken out of the router, drained, SIGTERM: the decode leaves for good."""
        left = self._leave_in_order(instance)
        self._event("scale_down", instance=instance, drained=left["drained"], exited=left["exited"])

    def _action_scale_up(self, instance: str) -> None:
        """A new decode starts and joins the router once ready (the load keeps flowing meanwhile)."""
        if instance in self.engines:
            raise ValueError(f"{instance} already exists")
        t = time.time()
        with self._proc_lock:
            if self._stopped:
                raise RuntimeError("the stack is stopped")
            self.decode_names.append(instance)
            proc = self._engine(instance, "decode", self._decode_args(instance))
            proc.spawn()
        proc.wait_ready(self.ready_timeout_s, cancel=self._stop)
        if self._feed is not None:
            self._feed.add(Feed(self.gpu_of[instance], self._status_path(instance), proc.live_pid))
        joined = time.time()
        self._routed().add(instance, proc.info["api_port"])
        self._event("scale_up", instance=instance, t=joined, agent=proc.info.get("agent"),
                    ready_after_s=round(joined - t, 3), served=self._served_since(instance, joined))

    def _action_rolling_restart(self, instance: str) -> None:
        """Every decode the router sends to (`instance`: unused, "decode"), one at a time: out of the
        router, drained, SIGTERM, started again, back in; the next once the last one served a request."""
        router = self._routed()
        for name in router.routed:
            if self._stop.is_set():
                return
            left = self._leave_in_order(name)
            router.note_restart(name, left["t"])
            old_agent = self.agents().get(name)
            self._start_again(name)
            back = time.time()
            router.add(name, self.engines[name].info["api_port"])
            self._event("restart", instance=name, t=left["t"], orderly=True, drained=left["drained"],
                        exited=left["exited"], old_agent=old_agent, new_agent=self.agents().get(name),
                        ready_after_s=round(back - left["t"], 3), served=self._served_since(name, back))
        self._event("rolling_restart_done", instances=router.routed)

    def _stats(self, instance: str) -> dict[str, Any] | None:
        """The decode's own counts (None: it does not answer)."""
        try:
            conn = Conn.connect(self.engines[instance].info["api_port"], timeout_s=1.0)
        except (OSError, KeyError):
            return None
        try:
            conn.sock.settimeout(2.0)
            return conn.request({"op": "stats"})
        except OSError:
            return None
        finally:
            conn.close()

    def _held(self, instance: str) -> int | None:
        """Requests the decode holds now, by its own count (None: it does not answer)."""
        stats = self._stats(instance)
        return None if stats is None or stats.get("held") is None else int(stats["held"])

    def _idle_since(self, instance: str) -> float | None:
        """A wall-clock time since which the decode has held nothing and its recorder has sent two
        heartbeats that listed nothing (None: it held something meanwhile, or did not answer)."""
        t = time.time()
        first = self._stats(instance)
        if not first or first.get("held") != 0 or first.get("recorder_open") != 0:
            return None
        deadline = time.monotonic() + 4 * self.heartbeat_s + 1.0
        while not self._stop.is_set() and time.monotonic() < deadline:
            now = self._stats(instance)
            if not now or now.get("held") != 0 or now.get("recorder_open") != 0:
                return None
            if now["heartbeats"] >= first["heartbeats"] + 2:  # the first built after t went out before this one
                return t
            time.sleep(0.05)
        return None

    def _action_kill_idle(self, instance: str) -> None:
        """SIGKILL at a moment the decode holds nothing and its last heartbeat said so (bounded wait; else
        at once), then out of the router, as a Service drops a dead pod."""
        router, proc = self._routed(), self.engines[instance]
        deadline = time.monotonic() + IDLE_WAIT_S
        idle = False
        while not self._stop.is_set() and time.monotonic() < deadline:
            since = self._idle_since(instance)
            # The kill happens under the router's lock, and only if nothing was routed to it since:
            # no request can reach it in between.
            if since is not None and router.remove(instance, if_idle_since=since,
                                                   then=lambda: proc.signal(signal.SIGKILL)):
                idle = True
                break
            time.sleep(0.02)
        t = time.time()
        if not idle:
            proc.signal(signal.SIGKILL)
            router.remove(instance)
        proc.kill()  # reaps it
        self._event("kill_idle", instance=instance, t=t, idle=idle)

    def _action_overload(self, instance: str) -> None:
        """Arrivals at overload_factor times the rate for overload_s, then back (instance: unused, "router")."""
        if self.loadgen is None:
            return
        peak = self.params.rate * self.params.overload_factor
        self.loadgen.set_rate(peak)
        self._event("overload", rate=peak, seconds=self.params.overload_s)
        self._stop.wait(self.params.overload_s)
        self.loadgen.set_rate(self.params.rate)
        self._event("overload_end", rate=self.params.rate)

    def _action_idle(self, instance: str) -> None:
        """No arrival for idle_s, then the load resumes (instance: unused, "router")."""
        if self.loadgen is None:
            return
        self.loadgen.pause(self.params.idle_s)
        self._event("idle", seconds=self.params.idle_s)
        if not self._stop.wait(self.params.idle_s):
            self._event("idle_end")

    # ---- stop ------------------------------------------------------------------

    def _release(self) -> None:
        if self._feed is not None:
            self._feed.stop()
        if self.gpus is not None:
            self.gpus.release(list(self.gpu_of.values()))
        if self._status_dir is not None:
            shutil.rmtree(self._status_dir, ignore_errors=True)


__all__ = ["Stack", "Truth", "EngineStartError"]
