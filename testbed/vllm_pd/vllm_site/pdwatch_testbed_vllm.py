"""Test infrastructure: the vLLM plugin of pdwatch's live vLLM testbed (faults, NIXL on a CPU).

Found only where `pdwatch.testbed.vllm_pd` puts this folder on PYTHONPATH (its
dist-info names the `vllm.general_plugins` entry point), so a real deployment
never loads it. vLLM calls it in each of a server's processes; it acts where
the testbed set its state folder, and touches nothing of pdwatch's hooks:

- gives NIXL's progress thread a 1 ms delay, as the SGLang testbed does (a
  busy poll of most of a core per agent otherwise);
- reports this server's NIXL agent name to the state folder when the Worker
  creates its agent, so the testbed can name a decode's agent;
- the `transfer-wedge` fault, at the transport boundary: once the testbed's
  fault file names this server's instance, every NIXL READ it posts from then
  on is never posted and its state reads `PROC` for ever, as a READ from a
  peer that never answers. vLLM's worker keeps polling it, its scheduler keeps
  the request in `WAITING_FOR_REMOTE_KVS` and keeps the prefill's lease alive
  with heartbeats; nothing in vLLM times it out.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import threading
import time
from typing import Any

from pdwatch import contract as c

log = logging.getLogger("pdwatch.testbed.vllm")

FAULT_FILE = "faults.json"
PROGRESS_DELAY_US = 1000
MAX_HUNG = 65536
# vLLM's engine steps without pause while a READ is pending; a wedged READ's state is answered after
# this pause, so the wedged decode's loop does not take a core of this two-core machine.
WEDGED_POLL_S = 0.05


_installed = False


def plugin() -> None:
    global _installed
    if not _state_dir() or _installed:
        return  # not one of the testbed's servers, or done (vLLM may load plugins again in a process)
    _installed = True
    api = importlib.import_module("nixl._api")
    _slow_progress_and_report(api)
    _install_wedge(api.nixl_agent)


def _state_dir() -> str | None:
    return os.environ.get(c.ENV_TESTBED_STATE_DIR) or None


def _instance() -> str:
    return os.environ.get(c.ENV_INSTANCE, f"pid-{os.getpid()}")


def _slow_progress_and_report(api: Any) -> None:
    real = api.nixlBind

    class _Bind:
        """nixlBind with a progress-thread delay on every agent config, and the agent's name reported."""

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        @staticmethod
        def nixlAgent(name: str, config: Any) -> Any:
            config.pthrDelay = PROGRESS_DELAY_US
            agent = real.nixlAgent(name, config)
            _report_agent(name)
            return agent

    api.nixlBind = _Bind()


def _report_agent(name: str) -> None:
    folder = _state_dir()
    if folder is None:
        return
    instance = _instance()
    path = os.path.join(folder, f"agent-{instance}.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"instance": instance, "agent": name, "pid": os.getpid(), "t": time.time()}, f)
    os.replace(tmp, path)


class _Wedge:
    """Whether this server's READs hang, read from the fault file at most every 0.2 s."""

    def __init__(self) -> None:
        self.instance = _instance()
        self._checked = 0.0
        self._on = False
        self.hung: set[int] = set()
        self._lock = threading.Lock()

    def on(self) -> bool:
        now = time.monotonic()
        if now - self._checked >= 0.2:
            self._checked = now
            folder = _state_dir()
            try:
                with open(os.path.join(folder or ".", FAULT_FILE)) as f:
                    faults = json.load(f)  # the testbed's own file (VllmStack._write_faults)
            except (OSError, ValueError):
                faults = {}
            was, self._on = self._on, self.instance in faults.get("wedge_instances", ())
            if self._on and not was:
                log.warning("pdwatch testbed fault: %s's NIXL READs hang from now on", self.instance)
        return self._on

    def hang(self, handle: object) -> None:
        with self._lock:
            if len(self.hung) >= MAX_HUNG:
                self.hung.pop()
            self.hung.add(_key(handle))


def _key(handle: object) -> int:
    return int(getattr(handle, "value", id(handle)))


WEDGE = _Wedge()


def _install_wedge(agent_cls: Any) -> None:
    transfer, state = agent_cls.transfer, agent_cls.check_xfer_state

    def transfer_(self: Any, handle: Any, *args: Any, **kwargs: Any) -> str:
        if WEDGE.on():
            WEDGE.hang(handle)
            return "PROC"  # never posted: as a READ from a peer that never answers
        posted: str = transfer(self, handle, *args, **kwargs)
        return posted

    def check_xfer_state(self: Any, handle: Any) -> str:
        if _key(handle) in WEDGE.hung:
            time.sleep(WEDGED_POLL_S)
            return "PROC"
        now: str = state(self, handle)
        return now

    agent_cls.transfer = transfer_
    agent_cls.check_xfer_state = check_xfer_state
