"""Test infrastructure: the SGLang plugin that lets PD servers run on a CPU, with faults.

Found only where `pdwatch.testbed.sglang_pd` puts this folder on PYTHONPATH (its
dist-info names the entry point), so a GPU deployment never loads it. It does
three things, none of them in pdwatch's own hooks:

- registers SGLang's CPU KV pool with NIXL as DRAM (SGLang labels it VRAM, and
  NIXL's UCX backend refuses that on a machine without CUDA);
- gives NIXL's progress thread a 1 ms delay (the Python API fixes 0, a busy
  poll of most of a core per agent: three of them would fill this machine);
- the `transfer-wedge` fault, at the transport boundary: once the testbed's
  fault file names a decode instance, the prefill's NIXL writes to that
  decode's agent are never posted and their state reads `PROC` for ever, as a
  transfer to a wedged peer does. SGLang's KV sender keeps polling, the
  request stays in its inflight queue; nothing in SGLang times it out.
- the `long-prompt-wedge` fault, at the same boundary: once the fault file
  gives `wedge_min_tokens`, every KV write of at least that many tokens (the
  pages of the write over the KV buffers it spans, times the page size) is
  never posted either, whichever decode it goes to.
- the `freeze-loop` fault, in SGLang's own scheduler: while the fault file
  names this server's instance, its scheduler thread blocks at the start of
  its next batch (`Scheduler.run_batch`), as a rank blocks in a collective or
  a kernel that never completes; its other threads (pdwatch's recorder and its
  heartbeats, NIXL, the bootstrap server) keep running. Taking the name out of
  the file lets the batch run on: a stall of any length.

Every process also reports its NIXL agent name and KV rank port to the
testbed's state folder, so the testbed can name a decode's agent.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import threading
import time
from collections.abc import Sized
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # At run time nixl._api is the nixl-cu12 wheel's module (the meta package puts it there).
    from nixl_cu12._api import nixl_agent, nixl_prepped_dlist_handle, nixl_xfer_handle

from pdwatch import contract as c

log = logging.getLogger("pdwatch.testbed.cpu")

STATE_DIR_ENV = c.ENV_TESTBED_STATE_DIR
FAULT_FILE = "faults.json"
PROGRESS_DELAY_US = 1000
# A wedged transfer's state is read in SGLang's spin loop (time.sleep(0)); the
# answer comes after this pause, so the spin does not take a core here.
WEDGED_POLL_S = 0.05


def plugin() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    mgr = "sglang.srt.disaggregation.nixl.conn.NixlKVManager.__init__"
    HookRegistry.register(mgr, _kv_pool_in_dram, HookType.BEFORE)
    HookRegistry.register(mgr, _report_agent, HookType.AFTER)
    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.run_batch", _maybe_freeze, HookType.BEFORE)
    _slow_progress_thread()
    _install_wedge()


# The hooks' arguments are SGLang's own objects (untyped: Any).
def _kv_pool_in_dram(self: Any, args: Any, *rest: Any, **kwargs: Any) -> None:
    ptrs = getattr(args, "kv_data_ptrs", None) or []
    args.kv_data_mem_kinds = ["DRAM"] * len(ptrs)
    # SGLang's prepped KV write lists each page once per KV buffer (repeat_indices_over_layers).
    WEDGE.kv_layout = (len(getattr(args, "kv_item_lens", None) or ptrs) or 1, int(getattr(args, "page_size", 1) or 1))


def _state_dir() -> str | None:
    return os.environ.get(STATE_DIR_ENV) or None


def _faults() -> dict[str, Any]:
    folder = _state_dir()
    if folder is None:
        return {}
    try:
        with open(os.path.join(folder, FAULT_FILE)) as f:
            faults: dict[str, Any] = json.load(f)  # the testbed's own file (SglangStack._write_faults)
            return faults
    except (OSError, ValueError):
        return {}


class _Freeze:
    """Whether this process's instance is frozen, read from the fault file at most every 0.2 s."""

    def __init__(self) -> None:
        self.instance = os.environ.get(c.ENV_INSTANCE, "")
        self._checked = 0.0
        self._frozen = False

    def frozen(self) -> bool:
        now = time.monotonic()
        if now - self._checked >= 0.2:
            self._checked = now
            self._frozen = self.instance in _faults().get("freeze_instances", ())
        return self._frozen


FREEZE = _Freeze()


def _maybe_freeze(self: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE Scheduler.run_batch: block the scheduler thread while the fault lasts (returns None)."""
    if not FREEZE.frozen():
        return None
    log.warning("pdwatch testbed fault: %s's scheduler loop blocks in run_batch", FREEZE.instance)
    while FREEZE.frozen():
        time.sleep(0.1)  # releases the GIL: every other thread of the server runs on
    log.warning("pdwatch testbed fault: %s's scheduler loop runs again", FREEZE.instance)
    return None


def _report_agent(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    folder = _state_dir()
    if folder is None:
        return
    instance = os.environ.get(c.ENV_INSTANCE, f"pid-{os.getpid()}")
    info = {"instance": instance, "agent": self.agent.name, "rank_port": int(self.rank_port),
            "pid": os.getpid(), "t": time.time()}
    path = os.path.join(folder, f"agent-{instance}.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)


def _nixl_api() -> Any:
    """NIXL's Python API module, as this plugin patches it in place (members replaced at run time)."""
    return importlib.import_module("nixl._api")


def _slow_progress_thread() -> None:
    api = _nixl_api()
    real = api.nixlBind

    class _Bind:
        """nixlBind with a progress-thread delay set on every agent config."""

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        @staticmethod
        def nixlAgent(name: str, config: Any) -> Any:  # the C++ binding's config and agent
            config.pthrDelay = PROGRESS_DELAY_US
            return real.nixlAgent(name, config)

    api.nixlBind = _Bind()


class _Wedge:
    """Which remote agents are wedged, read from the testbed's fault file when it changes."""

    def __init__(self) -> None:
        self.agents: frozenset[str] = frozenset()
        self._mtime = 0.0
        self._checked = 0.0
        self._lock = threading.Lock()
        self.handles: dict[int, str] = {}  # xfer or prepped-dlist handle value -> remote agent
        self.hung: set[int] = set()  # handles of writes that were never posted
        self.logged: set[str] = set()
        self.min_tokens = 0  # writes of at least this many tokens hang (0: none do)
        self.long: set[int] = set()  # handles of such writes, before their post
        self.kv_layout = (1, 1)  # (KV buffers a write spans, tokens a page)

    def refresh(self) -> frozenset[str]:
        now = time.monotonic()
        if now - self._checked < 0.2:
            return self.agents
        self._checked = now
        folder = _state_dir()
        if folder is None:
            return self.agents
        path = os.path.join(folder, FAULT_FILE)
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            return self.agents
        if mtime != self._mtime:
            self._mtime = mtime
            try:
                faults = _faults()
                self.min_tokens = int(faults.get("wedge_min_tokens") or 0)
                wanted = faults.get("wedge_instances", [])
                names = set()
                for instance in wanted:
                    with open(os.path.join(folder, f"agent-{instance}.json")) as f:
                        names.add(json.load(f)["agent"])
                self.agents = frozenset(names)
            except (OSError, ValueError, KeyError):
                log.warning("pdwatch testbed: unreadable fault file %s", path, exc_info=True)
        return self.agents

    def remember(self, handle: object, agent: str) -> None:
        with self._lock:
            if len(self.handles) >= 65536:
                self.handles.pop(next(iter(self.handles)))
            self.handles[_key(handle)] = agent

    def note_size(self, handle: object, indices: Sized) -> None:
        """At the making of a prepped write: remember it if it is long enough to hang."""
        self.refresh()
        if not self.min_tokens:
            return
        buffers, page = self.kv_layout
        tokens = len(indices) // buffers * page
        if tokens >= self.min_tokens:
            with self._lock:
                if len(self.long) >= 65536:
                    self.long.pop()
                self.long.add(_key(handle))
            if "long" not in self.logged:
                self.logged.add("long")
                log.warning("pdwatch testbed fault: NIXL writes of %d tokens and more hang from now on",
                            self.min_tokens)

    def hangs(self, handle: object) -> bool:
        """At the post: a write to a wedged agent, or a long one, is never posted, and hangs from then on."""
        key = _key(handle)
        agent = self.handles.get(key)
        long = key in self.long
        if not long and (agent is None or agent not in self.refresh()):
            return False
        with self._lock:
            self.long.discard(key)
            if len(self.hung) >= 65536:
                self.hung.pop()
            self.hung.add(key)
        if not long and agent is not None and agent not in self.logged:  # (not long: a wedged agent's)
            self.logged.add(agent)
            log.warning("pdwatch testbed fault: NIXL writes to agent %s hang from now on", agent)
        return True


def _key(handle: object) -> int:
    return int(getattr(handle, "value", id(handle)))


WEDGE = _Wedge()


def _install_wedge() -> None:
    agent_cls = _nixl_api().nixl_agent
    prep, make, init = agent_cls.prep_xfer_dlist, agent_cls.make_prepped_xfer, agent_cls.initialize_xfer
    transfer, state = agent_cls.transfer, agent_cls.check_xfer_state

    def prep_xfer_dlist(self: nixl_agent, agent_name: str, *args: Any, **kwargs: Any) -> nixl_prepped_dlist_handle:
        handle: nixl_prepped_dlist_handle = prep(self, agent_name, *args, **kwargs)
        if agent_name and agent_name != self.name:
            WEDGE.remember(handle, agent_name)
        return handle

    def make_prepped_xfer(self: nixl_agent, operation: str, local_side: nixl_prepped_dlist_handle, local_indices: Sized,
                          remote_side: nixl_prepped_dlist_handle, *args: Any, **kwargs: Any) -> nixl_xfer_handle:
        handle: nixl_xfer_handle = make(self, operation, local_side, local_indices, remote_side, *args, **kwargs)
        agent = WEDGE.handles.get(_key(remote_side))
        if agent is not None:
            WEDGE.remember(handle, agent)
        WEDGE.note_size(handle, local_indices)
        return handle

    def initialize_xfer(self: nixl_agent, operation: str, local_descs: Any, remote_descs: Any, remote_agent: str,
                        *args: Any, **kwargs: Any) -> nixl_xfer_handle:
        handle: nixl_xfer_handle = init(self, operation, local_descs, remote_descs, remote_agent, *args, **kwargs)
        WEDGE.remember(handle, remote_agent)
        return handle

    def transfer_(self: nixl_agent, handle: nixl_xfer_handle, *args: Any, **kwargs: Any) -> str:
        if WEDGE.hangs(handle):
            return "PROC"  # as a write to a peer that never answers
        posted: str = transfer(self, handle, *args, **kwargs)
        return posted

    def check_xfer_state(self: nixl_agent, handle: nixl_xfer_handle) -> str:
        if _key(handle) in WEDGE.hung:
            time.sleep(WEDGED_POLL_S)
            return "PROC"
        now: str = state(self, handle)
        return now

    agent_cls.prep_xfer_dlist = prep_xfer_dlist
    agent_cls.make_prepped_xfer = make_prepped_xfer
    agent_cls.initialize_xfer = initialize_xfer
    agent_cls.transfer = transfer_
    agent_cls.check_xfer_state = check_xfer_state
