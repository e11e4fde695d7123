"""The live vLLM PD stack: one prefill, one or two decodes, the testbed's PD proxy, load and faults.

    stack = VllmStack("transfer-wedge", otlp_endpoint="http://127.0.0.1:4318")
    stack.start()          # returns once a request goes through both legs (about a minute here)
    stack.poll_events()    # [{"event": "wedge", "instance": "decode-0", ...}, ...]
    stack.truth()          # what the proxy saw of every request (the decode included)
    stack.stop()           # bounded, leaves no process behind

vLLM runs from its own environment (servers.vllm_python()). Its servers
start together; each takes about 45 s here.
"""

from __future__ import annotations

import http.client
import json
import time
from typing import TYPE_CHECKING, Any

from pdwatch import contract as c

from ..live_stack import LiveStack
from ..processes import EngineStartError, free_port
from ..router import RequestRecord
from ..stack_base import StackArgs
from . import scenarios
from .client import ProxyClient
from .servers import ServerPorts, VllmServer

if TYPE_CHECKING:
    from typing_extensions import Unpack

MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 16
DRAIN_TIMEOUT_S = 120.0
IDLE_S = 20.0


class VllmStack(LiveStack[VllmServer]):
    catalogue = scenarios.CATALOGUE
    folder_prefix = "pdwatch-vllm-"
    defaults = StackArgs(rate=2.0, restart_at=10.0, traceparent=True, token_interval_s=0.02, ready_timeout_s=300.0,
                         stop_timeout_s=20.0)

    def __init__(self, scenario: str, *, plugin: bool = True, load: bool = True, **args: Unpack[StackArgs]):
        super().__init__(scenario, **args)
        self.plugin = plugin
        self.load = load

    # ---- processes ---------------------------------------------------------

    @property
    def model(self) -> str:
        return str(self.model_dir)

    def _env(self, instance: str) -> dict[str, str]:
        env = {c.ENV_TESTBED_STATE_DIR: str(self.state_dir), c.ENV_CLUSTER: self.cluster, c.ENV_INSTANCE: instance,
               c.ENV_HEARTBEAT: str(self.heartbeat_s), c.ENV_OTLP_ENDPOINT: self.otlp_endpoint,
               c.ENV_VLLM: "1" if self.plugin else "0"}
        return env

    def _new_server(self, instance: str, role: str, **kwargs: Any) -> VllmServer:
        # The prefill on core 0, the decodes on core 1 (two cores here).
        return VllmServer(instance, role, self.model_dir, ServerPorts(free_port(), free_port()), self._env(instance),
                          core=0 if role == "prefill" else 1, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS)

    def _launch(self) -> ProxyClient:
        self._make_folder()
        [prefill] = self._start_servers("prefill", ["prefill-0"])
        decodes = self._start_servers("decode", list(self.decode_names))
        client = ProxyClient(self.model, prefill.ports.http, {d.instance: d.ports.http for d in decodes},
                             seed=self.seed, traceparent=self.traceparent)
        self._wait_through(client)
        return client

    def _wait_through(self, client: ProxyClient) -> None:
        """Ready when one request per decode goes through both legs and back (the first READ from each
        decode makes its NIXL handshake with the prefill). These requests are not in the truth."""
        deadline = time.monotonic() + self.ready_timeout_s
        for decode in sorted(client.decodes):
            last = "no answer"
            while True:
                if time.monotonic() > deadline or self._stop.is_set():
                    raise EngineStartError(f"no request through {decode} after {self.ready_timeout_s:.0f} s "
                                           f"({last}):\n{self.servers[decode].tail()}")
                try:
                    self._one(client.prefill_port, client.decodes[decode])
                    break
                except (OSError, RuntimeError) as e:
                    last = f"{type(e).__name__}: {e}"
                    time.sleep(0.5)

    def _one(self, prefill_port: int, decode_port: int) -> None:
        prompt = [5, 6, 7, 8]
        first = post_completion(prefill_port, {"model": self.model, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}})
        post_completion(decode_port, {"model": self.model, "prompt": prompt, "max_tokens": 1,
                            "kv_transfer_params": first["kv_transfer_params"]})

    # ---- scenario actions ----------------------------------------------------

    def _action_wedge(self, instance: str) -> None:
        """From now on this decode's NIXL READs never complete."""
        self._write_faults("wedge_instances", [instance])
        self._event("wedge", instance=instance, agent=self.agents().get(instance))

    def _action_late_decodes(self, instance: str) -> None:
        """From now on the proxy holds every LATE_EVERY-th request LATE_BY_S before its decode call."""
        started = time.time()

        def delay(rec: RequestRecord) -> float:
            late = rec.sent_at >= started and rec.index % scenarios.LATE_EVERY == 0
            if late:
                self._event("held_late", trace_id=rec.trace_id, decode=rec.decode, seconds=scenarios.LATE_BY_S)
            return scenarios.LATE_BY_S if late else 0.0

        self._client().decode_delay = delay
        self._event("late_decodes", every=scenarios.LATE_EVERY, seconds=scenarios.LATE_BY_S)

    # ---- an operator's steps (the ordinary day) ---------------------------------

    def _client(self) -> ProxyClient:
        """The stack's own proxy client (the load's)."""
        assert isinstance(self.router, ProxyClient), "the stack is not started"
        return self.router

    def _drain(self, instance: str) -> None:
        """Until the proxy holds nothing on it for a heartbeat interval and a second (its last heartbeat
        must have said it holds nothing)."""
        t0, quiet_since = time.monotonic(), None
        while quiet_since is None or time.monotonic() - quiet_since < self.heartbeat_s + 1.0:
            if time.monotonic() - t0 > DRAIN_TIMEOUT_S:
                raise EngineStartError(f"{instance} still holds requests after {DRAIN_TIMEOUT_S:.0f} s")
            if self._stop.wait(0.5):
                return
            if self._client().open_on(instance) > 0:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
        self._event("drained", instance=instance, took_s=round(time.monotonic() - t0, 3))

    def _action_scale_down(self, instance: str) -> None:
        """Out of the proxy, drained, then SIGTERM: the decode leaves in order."""
        self._client().remove(instance)
        self._event("router_out", instance=instance)
        self._drain(instance)
        self._sigterm(instance)

    def _action_sigkill_idle(self, instance: str) -> None:
        """The load pauses, the decode holding nothing dies (SIGKILL) and leaves the proxy, the load resumes."""
        self._pause_load()
        self._client().remove(instance)
        self._drain(instance)
        self.engines[instance].kill()
        self._event("sigkilled", instance=instance)
        self._stop.wait(IDLE_S / 2)
        self._resume_load()

    def _action_idle(self, instance: str) -> None:
        """No traffic for IDLE_S, then traffic again."""
        self._pause_load()
        self._stop.wait(IDLE_S)
        self._resume_load()


def post_completion(port: int, body: dict[str, object], timeout_s: float = 60.0) -> dict[str, object]:
    """One POST /v1/completions to a vLLM API server on loopback; its JSON answer, or RuntimeError."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status} from :{port}: {data[:200]!r}")
        out: dict[str, object] = json.loads(data)
        return out
    finally:
        conn.close()


__all__ = ["VllmStack", "EngineStartError"]
