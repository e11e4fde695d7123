"""What the live stacks (real SGLang, real vLLM) share beyond `StackBase`.

A folder of their own (the tiny model, and the state folder where each server's
testbed plugin reports its NIXL agent and reads the fault file), servers of
one role started together with retries on a taken port, the operator's
SIGTERM, the load paused and resumed, and the folder kept for a post-mortem
(PDWATCH_TESTBED_KEEP=1, with each server's last log lines). Each kind says how
to make one server (`_new_server`) and may check one once it is ready
(`_check_started`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import astuple
from pathlib import Path
from typing import Any, Generic, TypeVar

from pdwatch import contract as c

from .processes import EngineProcess, PortInUse
from .scenarios import Params
from .sglang_pd.model import write_model
from .stack_base import StackBase

log = logging.getLogger("pdwatch.testbed.live")

PORT_RETRIES = 2  # a server that finds a port taken is started this many more times
EXIT_TIMEOUT_S = 60.0  # how long a server may take to exit on SIGTERM
FAULT_FILE = "faults.json"

Server = TypeVar("Server", bound=EngineProcess)


class LiveStack(StackBase, Generic[Server]):
    folder_prefix = "pdwatch-live-"

    def __init__(self, scenario: str, **args: Any):
        super().__init__(scenario, **args)
        self._dir: Path | None = None
        self.servers: dict[str, Server] = {}

    # ---- what a kind provides ----------------------------------------------------

    def _new_server(self, instance: str, role: str, **kwargs: Any) -> Server:
        """A server on fresh ports (not started)."""
        raise NotImplementedError

    def _check_started(self, server: Server) -> None:
        """Raise EngineStartError if a ready server is not fit to serve."""

    def _check_decodes(self, decodes: int) -> None:
        if decodes not in (1, 2):
            raise ValueError(f"decodes must be 1 or 2 on this machine, got {decodes}")
        if any(a[2] == "decode-0" for a in self.scenario.actions(Params())) and decodes < 2:
            raise ValueError(f"scenario {self.scenario.name!r} faults decode-0 while others flow: it needs 2 decodes")

    def _check_restartable(self, instance: str) -> None:
        if self.servers[instance].role != "decode":
            raise ValueError("only decode servers are restarted by the testbed")

    # ---- the folder ------------------------------------------------------------

    @property
    def _folder(self) -> Path:
        assert self._dir is not None, "the stack is not started"
        return self._dir

    @property
    def state_dir(self) -> Path:
        return self._folder / "state"

    @property
    def model_dir(self) -> Path:
        return self._folder / "model"

    def _make_folder(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix=self.folder_prefix))
        self.state_dir.mkdir()
        write_model(self.model_dir)

    def agents(self) -> dict[str, str | None]:
        """Each server's current NIXL agent name, as its testbed plugin reported it."""
        out = {}
        for name in self.servers:
            try:
                out[name] = json.loads((self.state_dir / f"agent-{name}.json").read_text())["agent"]
            except (OSError, ValueError, KeyError):
                out[name] = None
        return out

    def _write_faults(self, key: str, value: list[str] | int) -> None:
        """Set one fault of the testbed plugin's fault file, keeping the others."""
        path = self.state_dir / FAULT_FILE
        try:
            faults = json.loads(path.read_text())
        except (OSError, ValueError):
            faults = {}
        faults[key] = value
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(faults))
        os.replace(tmp, path)

    # ---- servers -------------------------------------------------------------

    def _start_servers(self, role: str, names: list[str], **kwargs: Any) -> list[Server]:
        """Start servers together; one that finds a port taken starts again on fresh ports."""
        def fresh(name: str) -> Server:
            server = self._new_server(name, role, **kwargs)
            self.servers[name] = self.engines[name] = server
            return server

        servers = [fresh(name) for name in names]
        for server in servers:
            server.spawn()
        for i, server in enumerate(servers):
            for attempt in range(PORT_RETRIES + 1):
                try:
                    server.wait_ready(self.ready_timeout_s, cancel=self._stop)
                    break
                except PortInUse:
                    if attempt == PORT_RETRIES:
                        raise
                    server.kill()
                    ports = getattr(server, "ports", None)  # each kind's own ports dataclass
                    self._event("port_taken", instance=server.instance,
                                ports=list(astuple(ports)) if ports is not None else [])
                    server = servers[i] = fresh(server.instance)
                    server.spawn()
            self._check_started(server)
        return servers

    def _sigterm(self, instance: str) -> None:
        """SIGTERM to the server's parent process alone, as Kubernetes stops a pod; wait until it exits."""
        server = self.servers[instance]
        assert server.proc is not None
        t0 = time.time()
        os.kill(server.proc.pid, signal.SIGTERM)
        try:
            rc: int | None = server.proc.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        exited = time.time()
        server.kill()  # anything the engine left in the group (and the pipes)
        self._event("terminated", instance=instance, t=t0, exit_s=round(exited - t0, 3), returncode=rc)

    # ---- the load --------------------------------------------------------------

    def _pause_load(self) -> None:
        """No arrivals until _resume_load (the load's duration keeps counting, as an idle hour would)."""
        if self.loadgen is not None:
            self.loadgen.pause()
        self._event("load_paused")

    def _resume_load(self) -> None:
        if self._stop.is_set() or self.loadgen is None:
            return
        self.loadgen.resume()
        self._event("load_resumed")

    # ---- stop ------------------------------------------------------------------

    def _release(self) -> None:
        if self._dir is None:
            return
        if os.environ.get(c.ENV_TESTBED_KEEP) != "1":
            shutil.rmtree(self._dir, ignore_errors=True)
            return
        for name, proc in self.engines.items():  # the servers' last lines, for the post-mortem
            (self._dir / f"{name}.log").write_text("\n".join(proc.log) + "\n")
        log.warning("kept the stack's directory %s", self._dir)
