"""The live SGLang PD stack: one prefill, one or two decodes, SGLang's router, load and faults.

    stack = SglangStack("transfer-wedge", otlp_endpoint="http://127.0.0.1:4318")
    stack.start()          # returns once every server answers through the router (about a minute here)
    stack.poll_events()    # [{"event": "wedge", "instance": "decode-0", "agent": ..., "t": ...}, ...]
    stack.truth()          # what the client saw of every request
    stack.stop()           # bounded, leaves no process behind

The prefill starts first and alone: on two cores, a prefill that starts beside
a decode can miss its own bootstrap server's registration window, and then
every request hangs in bootstrap (seen here). The decodes follow together.
"""

from __future__ import annotations

import http.client
import json
import time
from typing import TYPE_CHECKING, Any

from pdwatch import contract as c

from ..live_stack import LiveStack
from ..processes import EngineStartError, free_port
from ..router import LoadGenerator
from ..stack_base import StackArgs
from . import scenarios
from .client import RouterClient
from .control import RouterWorkers, held
from .servers import BASE_ENV, ServerPorts, SglangRouter, SglangServer

if TYPE_CHECKING:
    from typing_extensions import Unpack

# Request slots. A prefill leg whose KV write hangs keeps its slot in SGLang's inflight queue, and a
# decode takes in transfer as many requests as its slots (3 x max_running with SGLang's default extra
# slots) and its KV pool allow: 14-16 here. A prefill with no more slots than that can lose every one
# to a single wedged decode; then nothing flows, a total wedge rather than the seed's incident (seen
# once in a fresh-clone test run). So the prefill has well more slots than one decode can pin.
DECODE_MAX_RUNNING = 16
PREFILL_MAX_RUNNING = 64
# The ordinary day's steps: how long a drain may take (SGLang may take up to live_stack.EXIT_TIMEOUT_S to
# exit on SIGTERM: its drain checks every 5 s), how long the load pauses, and how long and how hard the
# overload lasts.
DRAIN_TIMEOUT_S = 120.0
IDLE_S = 20.0
OVERLOAD_S = 90.0
OVERLOAD_FACTOR = 4.0  # times the scenario's rate, with the overload shape's longer generations


class SglangStack(LiveStack[SglangServer]):
    catalogue = scenarios.CATALOGUE
    folder_prefix = "pdwatch-sglang-"
    defaults = StackArgs(rate=2.0, restart_at=10.0, traceparent=True, token_interval_s=0.02, ready_timeout_s=240.0,
                         stop_timeout_s=15.0)

    def __init__(self, scenario: str, *, context_length: int = 2048, plugin: bool = True, load: bool = True,
                 **args: Unpack[StackArgs]):
        super().__init__(scenario, **args)
        self.context_length = context_length
        self.plugin = plugin
        self.load = load  # False: the caller sends the requests (benchmarks)
        self.sglang_router: SglangRouter | None = None

    # ---- processes ---------------------------------------------------------

    def _env(self, instance: str) -> dict[str, str]:
        env = {
            **BASE_ENV,
            c.ENV_TESTBED_STATE_DIR: str(self.state_dir),
            c.ENV_CLUSTER: self.cluster,
            c.ENV_INSTANCE: instance,
            c.ENV_HEARTBEAT: str(self.heartbeat_s),
            c.ENV_OTLP_ENDPOINT: self.otlp_endpoint,
            # pdwatch's plugin and the testbed's CPU support; nothing else SGLang may find.
            "SGLANG_PLUGINS": "pdwatch,pdwatch_testbed_cpu" if self.plugin else "pdwatch_testbed_cpu",
        }
        if self.plugin:
            env[c.ENV_SGLANG] = "1"
        return env

    def _new_server(self, instance: str, role: str, **kwargs: Any) -> SglangServer:
        ports = ServerPorts(free_port(), free_port(), free_port() if role == "prefill" else 0)
        return SglangServer(instance, role, self.model_dir, ports, self._env(instance),
                            context_length=self.context_length, max_total_tokens=4 * self.context_length,
                            max_running=PREFILL_MAX_RUNNING if role == "prefill" else DECODE_MAX_RUNNING)

    def _check_started(self, server: SglangServer) -> None:
        if server.registration_failed():
            raise EngineStartError(f"{server.instance} came up without its bootstrap registration:\n"
                                   + server.tail())

    def _launch(self) -> RouterClient:
        self._make_folder()
        [prefill] = self._start_servers("prefill", ["prefill-0"])
        decodes = self._start_servers("decode", list(self.decode_names))
        router = SglangRouter(free_port(), free_port(), prefill, decodes, {**BASE_ENV})
        self.sglang_router = self.engines["router"] = router
        router.spawn()
        self._wait_router(router)
        return RouterClient(router.port, seed=self.seed, traceparent=self.traceparent)

    def _wait_router(self, router: SglangRouter) -> None:
        """Ready when one request goes through the router to both legs and back."""
        deadline = time.monotonic() + self.ready_timeout_s
        body = json.dumps({"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 1}})
        last = "no answer"
        while time.monotonic() < deadline and not self._stop.is_set():
            if not router.alive():
                raise EngineStartError("SGLang's router exited before it was ready:\n" + router.tail())
            conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=30)
            try:
                conn.request("POST", "/generate", body=body, headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                text = resp.read()
                if resp.status == 200:
                    router.mark_ready()
                    return
                last = f"HTTP {resp.status}: {text[:200]!r}"
            except OSError as e:
                last = f"{type(e).__name__}: {e}"
            finally:
                conn.close()
            time.sleep(0.5)
        raise EngineStartError(f"SGLang's router not serving after {self.ready_timeout_s:.0f} s ({last}):\n"
                               + router.tail())

    # ---- scenario actions ----------------------------------------------------

    def _action_wedge(self, instance: str) -> None:
        """From now on the prefill's NIXL writes to this decode's agent never complete."""
        self._write_faults("wedge_instances", [instance])
        self._event("wedge", instance=instance, agent=self.agents().get(instance))

    def _action_wedge_long(self, instance: str) -> None:
        """From now on the prefill's NIXL writes of scenarios.LONG_PROMPT_TOKENS tokens or more never complete."""
        self._write_faults("wedge_min_tokens", scenarios.LONG_PROMPT_TOKENS)
        self._event("wedge_long", instance=instance, min_tokens=scenarios.LONG_PROMPT_TOKENS)

    def _action_freeze_loop(self, instance: str) -> None:
        """From now on this server's scheduler thread blocks at its next batch (heartbeats go on)."""
        self._write_faults("freeze_instances", [instance])
        self._event("loop_frozen", instance=instance)

    def _action_thaw_loop(self, instance: str) -> None:
        self._write_faults("freeze_instances", [])
        self._event("loop_thawed", instance=instance)

    # ---- an operator's steps (the ordinary day) ---------------------------------

    @property
    def router_workers(self) -> RouterWorkers:
        assert self.sglang_router is not None, "the stack is not started"
        return RouterWorkers(self.sglang_router.port)

    def _router_out(self, instance: str) -> None:
        took = self.router_workers.remove(self.servers[instance].url)
        self._event("router_out", instance=instance, took_s=round(took, 3))

    def _router_in(self, instance: str) -> None:
        took = self.router_workers.add(self.servers[instance].url)
        self._event("router_in", instance=instance, took_s=round(took, 3))

    def _drain(self, instance: str) -> None:
        """Wait until the server has held no request for a heartbeat interval and a second: one may still be
        on its way to it, and its last heartbeat must have said it holds nothing. (Killed sooner, a decode
        that had just finished its last request was seen holding it: the heartbeat before the kill listed
        the leg, and the leg's end was still in the exporter's queue.)"""
        server, t0, quiet_since = self.servers[instance], time.monotonic(), None
        while quiet_since is None or time.monotonic() - quiet_since < self.heartbeat_s + 1.0:
            if time.monotonic() - t0 > DRAIN_TIMEOUT_S:
                raise EngineStartError(f"{instance} still holds requests after {DRAIN_TIMEOUT_S:.0f} s")
            if self._stop.wait(0.5):
                return
            if held(server.ports.http) > 0:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
        self._event("drained", instance=instance, took_s=round(time.monotonic() - t0, 3))

    def _start_decode(self, instance: str) -> None:
        """Start a decode server (fresh ports, as a new pod gets) and put it in the router."""
        with self._proc_lock:  # stop() must not miss a process spawned while it runs
            if self._stopped:
                raise RuntimeError("the stack is stopped")
            t0 = time.time()
        try:
            self._start_servers("decode", [instance])
        finally:
            if self._stop.is_set() and instance in self.servers:
                self.servers[instance].kill()  # started while the stack stopped: stop() may have missed it
        self._event("started", instance=instance, t=t0, ready_after_s=round(time.time() - t0, 3),
                    agent=self.agents().get(instance))
        self._router_in(instance)

    def _action_scale_down(self, instance: str) -> None:
        """Out of the router, drained, then SIGTERM: the decode leaves in order."""
        self._router_out(instance)
        self._drain(instance)
        self._sigterm(instance)

    def _action_scale_up(self, instance: str) -> None:
        """A new decode started and added to the router while traffic flows."""
        self._start_decode(instance)

    def _action_rolling_restart(self, instance: str) -> None:
        """Every decode in the router, one at a time: out, drained, SIGTERM, started again, back in."""
        decodes = [name for name, server in self.servers.items()
                   if server.role == "decode" and self.router_workers.find(server.url) is not None]
        for name in decodes:
            if self._stop.is_set():
                return
            self._action_scale_down(name)
            self._start_decode(name)
            self._event("restarted_in_order", instance=name)

    def _action_sigkill_idle(self, instance: str) -> None:
        """The decode dies (SIGKILL) while it holds nothing, and the operator takes it out of the router.
        The load pauses around it: with traffic flowing, SGLang's router keeps sending to a dead decode
        until its health checks fail (the decode-restart scenario shows those requests hang)."""
        self._pause_load()
        self._drain(instance)
        self.engines[instance].kill()
        self._event("sigkilled", instance=instance)
        self._router_out(instance)
        self._stop.wait(IDLE_S / 2)
        self._resume_load()

    def _action_idle(self, instance: str) -> None:
        """No traffic for IDLE_S, then traffic again."""
        self._pause_load()
        self._stop.wait(IDLE_S)
        self._resume_load()

    def _action_overload(self, instance: str) -> None:
        """Arrivals well above capacity for OVERLOAD_S (OVERLOAD_FACTOR x the rate, longer generations)
        beside the usual load, then back."""
        extra = LoadGenerator(self._client(), lambda rng, i: scenarios.overload_shape(self.params, rng, i),
                              rate=self.params.rate * OVERLOAD_FACTOR, seed=self.seed + 1, duration_s=OVERLOAD_S,
                              max_requests=self.max_requests)
        self._event("overload", rate=extra.rate, seconds=OVERLOAD_S)
        extra.start()
        self._stop.wait(OVERLOAD_S)
        extra.stop()
        self._event("overload_end")

    def _client(self) -> RouterClient:
        assert isinstance(self.router, RouterClient), "the stack is not started"
        return self.router


__all__ = ["SglangStack", "EngineStartError"]
