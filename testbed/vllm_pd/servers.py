"""The processes of a live vLLM PD stack: one `vllm.entrypoints.openai.api_server` per instance.

Each is an `EngineProcess` (own process group, bounded log, never orphaned).
vLLM runs from its own environment (`vllm_python()`: build/vllm, made by
`make build/vllm/.installed` from requirements-vllm.lock). The flags and the
environment are the recipe measured on this kind of machine (../shared/NOTES.md,
"A vLLM PD pair on this CPU"): dummy weights, no tokenizer, eager mode, UCX
over TCP on loopback, one OpenMP thread per server pinned to a core, and the
adapter's NixlConnector loaded through `kv_connector_module_path`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from pdwatch import contract as c

from ..engine import Ready
from ..processes import CHECKOUT, EngineProcess, EngineStartError

VLLM_SITE = Path(__file__).resolve().parent / "vllm_site"
CONNECTOR_MODULE = "pdwatch.engine_patches.vllm.connector"
READY_LINE = "Application startup complete"
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
# The testbed's KV lease (vLLM's default is 30 s): shorter than the transfer stage's stuck floor (15 s),
# so a prefill whose blocks nobody reads gives them up, and names it, before its leg would be stuck
# (docs/vllm.md says what this means for a deployment with the default lease).
LEASE_S = 10
# Seconds an API server gives its engine to stop on SIGTERM (vLLM's default 0 kills the EngineCore at
# once: its connector never shuts down, and pdwatch's final heartbeat is never sent).
SHUTDOWN_TIMEOUT_S = 10


def vllm_python() -> str:
    """The Python vLLM is installed in: PDWATCH_VLLM_PYTHON, else the checkout's build/vllm."""
    given = os.environ.get(c.ENV_VLLM_PYTHON)
    if given:
        return given
    if CHECKOUT is not None and (CHECKOUT / "build" / "vllm" / "bin" / "python").exists():
        return str(CHECKOUT / "build" / "vllm" / "bin" / "python")
    raise EngineStartError(f"no vLLM environment: set {c.ENV_VLLM_PYTHON} to the Python vLLM is installed in, "
                           "or build the checkout's with `make build/vllm/.installed` (docs/vllm.md)")


def kv_config(role: str, *, lease_s: int = LEASE_S) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_connector_module_path": CONNECTOR_MODULE,
                       "kv_role": ROLES[role], "kv_buffer_device": "cpu",
                       "kv_connector_extra_config": {"num_threads": 1, "kv_lease_duration": lease_s}})


@dataclass(frozen=True)
class ServerPorts:
    http: int
    side_channel: int  # NIXL's handshake listener (VLLM_NIXL_SIDE_CHANNEL_PORT)


class VllmServer(EngineProcess):
    """One vLLM OpenAI API server in PD mode (API server, EngineCore and Worker processes)."""

    def __init__(self, instance: str, role: str, model: Path, ports: ServerPorts, env: dict[str, str], *,
                 core: int, max_model_len: int, max_num_seqs: int, lease_s: int = LEASE_S):
        self.ports = ports
        self.model = model
        self.sizes = (max_model_len, max_num_seqs)
        self.lease_s = lease_s
        env = {**env, "CUDA_VISIBLE_DEVICES": "", "VLLM_CPU_KVCACHE_SPACE": "1",
               # Each server's OpenMP thread pinned to a core of its own where it can: left unbound
               # ("nobind"), the loops of all three servers stalled for 4-8 s at a time here.
               "VLLM_CPU_OMP_THREADS_BIND": str(core), "OMP_NUM_THREADS": "1", "UCX_NET_DEVICES": "lo",
               "UCX_TLS": "tcp,self", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
               "VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports.side_channel), "HF_HUB_OFFLINE": "1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        super().__init__(instance, role, [], env)

    def command(self) -> list[str]:
        max_model_len, max_num_seqs = self.sizes
        return [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
                "--host", "127.0.0.1", "--port", str(self.ports.http), "--load-format", "dummy",
                "--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16",
                "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
                "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--disable-uvicorn-access-log",
                "--kv-transfer-config", kv_config(self.role, lease_s=self.lease_s)]

    def python_path(self) -> list[str]:
        # vllm_site first: the testbed's vLLM plugin (faults) is for these servers only.
        return [str(VLLM_SITE), *super().python_path()]

    def ready_info(self, line: str) -> Ready | None:
        if READY_LINE in line:
            return {"ready": True, "api_port": self.ports.http}
        return None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports.http}"
