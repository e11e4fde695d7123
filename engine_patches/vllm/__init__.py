"""pdwatch's vLLM adapter: the real engine emits the pdwatch telemetry contract.

Two parts, no fork. What records is `connector.NixlConnector`, vLLM's
NixlConnector with the hooks of one table (targets.py), loaded with the KV
transfer config's `kv_connector_module_path`; vLLM builds it in the EngineCore
(SCHEDULER role: every leg's stages) and in each Worker (WORKER role). `plugin()`
is the `vllm.general_plugins` entry point, which vLLM calls in each of its
processes: it checks the table against the running vLLM and says in the log
what a refused target costs, before a request arrives. Enable both with
PDWATCH_VLLM=1 in the server's environment; see docs/vllm.md.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from pdwatch import contract as c

from ..hook_table import Plan, Target, enabled, plan_for_running

log = logging.getLogger("pdwatch.vllm")

# What the last plugin() call found: "off", or the plan's state (active, partial, inactive).
status = "not loaded"
problems: list[str] = []
hook_errors = 0  # the API server's hooks (no recorder there): counted, logged nowhere yet


def plugin() -> None:
    """Entry point vLLM calls in every process: check every target of the table."""
    global status, problems
    if not enabled(c.ENV_VLLM):
        status = "off"
        return
    from . import targets

    plan = running_plan()
    problems = list(plan.refused)
    status = plan.state
    if plan.refused:
        log.warning("pdwatch: this vLLM lacks hook target(s); plugin state %s: %s", plan.state,
                    "; ".join(plan.refused))
    for t in plan.install:
        if t.path.startswith(targets.ASYNC_LLM + "."):
            _patch_before(t)


@functools.cache
def running_plan() -> Plan:
    """The guard's plan for the vLLM this process imports, made once: the entry point and the
    connector module both ask for it."""
    from . import targets

    return plan_for_running(targets.TARGETS, targets.GROUP_NEED, targets.HEARTBEAT_GROUPS)


def _patch_before(target: Target) -> None:
    """Run the hook before vLLM's coroutine method (the API server's AsyncLLM), once per process."""
    import importlib

    from . import hooks

    cls = getattr(importlib.import_module(target.module), target.cls)
    parent = cls.__dict__[target.method]
    if getattr(parent, "_pdwatch", False):
        return
    hook = getattr(hooks, target.hook)

    @functools.wraps(parent)
    async def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            hook(self, *args, **kwargs)
        except Exception:  # the engine must never suffer for pdwatch
            global hook_errors
            hook_errors += 1
        return await parent(self, *args, **kwargs)

    method._pdwatch = True  # type: ignore[attr-defined]
    setattr(cls, target.method, method)
