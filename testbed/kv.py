"""KV cache memory for the testbed engines: a NIXL agent and a slot pool.

Each engine registers one DRAM buffer with its NIXL agent once and carves it
into fixed-size slots, like a paged KV pool. A request's KV bytes are a
pattern derived from its bootstrap room, so the decode can check that what
arrived over NIXL is exactly what the prefill computed.
"""

from __future__ import annotations

import base64
import importlib
import os
import threading
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    # The wheel the testbed pins; the `nixl` meta package, its fallback, has the same API.
    from nixl_cu12._api import nixl_agent

# UCX over loopback TCP: the only transport this machine is sure to have.
UCX_DEFAULTS = {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp,self,sm"}


def ucx_env() -> None:
    for key, value in UCX_DEFAULTS.items():
        os.environ.setdefault(key, value)


def _nixl_api() -> ModuleType:
    # The `nixl` meta package picks its backend wheel by CUDA version and, with
    # a CPU torch in the environment, imports all of torch to learn there is
    # none (2.5 s per engine start). The testbed pins the nixl-cu12 wheel, so it
    # loads that one directly and falls back to the meta package.
    try:
        return importlib.import_module("nixl_cu12._api")
    except ImportError:
        return importlib.import_module("nixl._api")


def make_agent(name: str) -> nixl_agent:
    ucx_env()
    api = _nixl_api()
    # No NIXL progress thread: the Python API starts it with no delay, so it
    # spins a whole core per engine. The engines' loops drive progress instead
    # (the decode polls notifications, the prefill's sender polls its transfers).
    agent: nixl_agent = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"], enable_prog_thread=False))
    return agent


def kv_pattern(room: int, nbytes: int) -> npt.NDArray[np.uint8]:
    """The KV bytes of one room: deterministic, different for every room."""
    rng = np.random.default_rng(int(room) & ((1 << 63) - 1))
    return rng.integers(0, 256, size=nbytes, dtype=np.uint8)


class SlotPool:
    """A registered buffer split into `slots` slots of `slot_bytes`; bounded free list."""

    def __init__(self, agent: nixl_agent, slots: int, slot_bytes: int):
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"pool needs slots >= 1 and slot_bytes >= 1, got {slots}, {slot_bytes}")
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.buf = np.zeros(slots * slot_bytes, dtype=np.uint8)
        self.buf[:] = 1  # touch every page before registering (NIXL pins what it registers)
        self.base = self.buf.ctypes.data
        self.reg = agent.register_memory([(self.base, self.buf.nbytes, 0, "")], "DRAM")
        self._free = list(range(slots - 1, -1, -1))
        self._lock = threading.Lock()

    def alloc(self) -> int | None:
        with self._lock:
            return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    @property
    def free_count(self) -> int:
        return len(self._free)

    def addr(self, slot: int) -> int:
        return self.base + slot * self.slot_bytes

    def view(self, slot: int, nbytes: int) -> npt.NDArray[np.uint8]:
        start = slot * self.slot_bytes
        return self.buf[start : start + nbytes]


def metadata_b64(agent: nixl_agent) -> str:
    return base64.b64encode(agent.get_agent_metadata()).decode("ascii")


def metadata_bytes(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))
