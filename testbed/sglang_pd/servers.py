"""The processes of a live SGLang PD stack: `sglang.launch_server` per role, and SGLang's router.

Each is an `EngineProcess` (own process group, bounded log, never orphaned)
with its own command line and readiness line. The flags are those that make
SGLang 0.5.23 (and the older releases of the version matrix) serve on a CPU (see ../shared/NOTES.md's measured facts):
torch-native attention and sampling, no CUDA graphs, no overlap scheduling
(it reaches `torch.cuda.Event` at the first prefix-cache hit), no decode
retraction backup (it reaches `cudaHostRegister`), and `--sleep-on-idle`, so
an idle scheduler waits on its sockets instead of spinning a core.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from pdwatch.engine_patches.sglang.targets import installed_version

from ..engine import Ready
from ..processes import EngineProcess

CPU_SITE = Path(__file__).resolve().parent / "cpu_site"
READY_LINE = "The server is fired up and ready to roll!"
# The prefill scheduler registers with its own bootstrap server, five tries
# over about 12 s; on a starved CPU the server can come up too late, and then
# every request hangs in bootstrap. Seen here when two servers started at once.
REGISTER_FAILED = "failed to register to bootstrap server"

# The environment SGLang needs on this CPU, plus pdwatch's plugin switched on.
BASE_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "CUDA_VISIBLE_DEVICES": "",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "UCX_NET_DEVICES": "lo",
    "UCX_TLS": "tcp,self",
    # One transfer worker per destination shard: a wedged destination blocks
    # its own shard only, as on a prefill serving many decodes. Shards are
    # picked by port sum modulo this; 64 makes two decodes share one rarely.
    "SGLANG_DISAGGREGATION_QUEUE_SIZE": "64",
}

CPU_FLAGS = (
    "--device", "cpu", "--load-format", "dummy", "--skip-tokenizer-init",
    "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
    "--disable-cuda-graph", "--disable-overlap-schedule", "--sleep-on-idle",
    "--dtype", "bfloat16", "--tp", "1",
    # SGLang's watchdog kills a server whose scheduler sits in one batch for 300 s; the
    # freeze-loop fault does exactly that on purpose, for as long as a test wants.
    "--watchdog-timeout", "3600",
)


# The decode's retraction backup and its flag came after 0.5.16 (the older releases of the version
# matrix run here too, and their servers refuse flags they do not know).
RETRACTION_BACKUP = "--disaggregation-decode-retraction-backup"
RETRACTION_BACKUP_SINCE = "0.5.17"


def has_retraction_backup() -> bool:
    """From the installed SGLang's metadata (importing sglang costs seconds); a version that does not
    parse (a source checkout) counts as new."""
    try:
        return Version(installed_version() or RETRACTION_BACKUP_SINCE) >= Version(RETRACTION_BACKUP_SINCE)
    except InvalidVersion:
        return True


@dataclass(frozen=True)
class ServerPorts:
    http: int
    nccl: int
    bootstrap: int = 0  # prefill only


class SglangServer(EngineProcess):
    """One `python -m sglang.launch_server` in PD mode, with pdwatch's plugin loaded."""

    def __init__(self, instance: str, role: str, model: Path, ports: ServerPorts, env: dict[str, str], *,
                 context_length: int, max_total_tokens: int, max_running: int, extra: tuple[str, ...] = ()):
        self.ports = ports
        self.model = model
        self.sizes = (context_length, max_total_tokens, max_running)
        self.extra = extra
        super().__init__(instance, role, [], env)

    def command(self) -> list[str]:
        context, total, running = self.sizes
        args = [
            sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.model), *CPU_FLAGS,
            "--host", "127.0.0.1", "--port", str(self.ports.http), "--nccl-port", str(self.ports.nccl),
            "--context-length", str(context), "--max-total-tokens", str(total),
            "--max-running-requests", str(running), "--chunked-prefill-size", "512",
            "--disaggregation-mode", self.role, "--disaggregation-transfer-backend", "nixl",
        ]
        if self.role == "prefill":
            args += ["--disaggregation-bootstrap-port", str(self.ports.bootstrap)]
        elif has_retraction_backup():
            args += [RETRACTION_BACKUP, "none"]
        return [*args, *self.extra]

    def python_path(self) -> list[str]:
        # cpu_site first: its sitecustomize, sgl_kernel and CPU plugin are for these servers only.
        return [str(CPU_SITE), *super().python_path()]

    def ready_info(self, line: str) -> Ready | None:
        if READY_LINE in line:
            return {"ready": True, "api_port": self.ports.http}
        return None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports.http}"

    def registration_failed(self) -> bool:
        return any(REGISTER_FAILED in line for line in self.log)


class SglangRouter(EngineProcess):
    """SGLang's PD router (the `sglang-router` package), round-robin over the decodes."""

    def __init__(self, port: int, metrics_port: int, prefill: SglangServer, decodes: list[SglangServer],
                 env: dict[str, str]):
        self.port = port
        self.metrics_port = metrics_port
        self.prefill = prefill
        self.decodes = decodes
        super().__init__("router", "router", [], env)

    def command(self) -> list[str]:
        args = [
            sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--prefill", self.prefill.url, str(self.prefill.ports.bootstrap),
        ]
        for d in self.decodes:
            args += ["--decode", d.url]
        return [
            *args, "--host", "127.0.0.1", "--port", str(self.port), "--policy", "round_robin",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
            # One client request, one pair of legs: a retry would start a new pair under
            # a new room, which the ground truth could not tell from the first.
            "--disable-retries", "--log-level", "warn",
        ]

    def python_path(self) -> list[str]:
        return [str(CPU_SITE), *super().python_path()]  # the launcher imports torchvision too

    def ready_info(self, line: str) -> Ready | None:
        return None  # readiness is asked over HTTP (SglangStack._wait_router)

    def mark_ready(self) -> None:
        self.info = {"ready": True, "api_port": self.port}
        self._ready.set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
