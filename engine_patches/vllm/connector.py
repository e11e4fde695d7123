"""vLLM's NixlConnector with pdwatch's hooks: load it with

    --kv-transfer-config '{"kv_connector": "NixlConnector",
                           "kv_connector_module_path": "pdwatch.engine_patches.vllm.connector", ...}'

and PDWATCH_VLLM=1 in the server's environment. The class keeps vLLM's name, so
vLLM's own checks on the connector name hold. Every row of the hook table
(targets.py) that the start-up guard keeps becomes an override here: vLLM's
method runs first and its result is returned untouched; the hook runs after
it, and whatever the hook raises is caught and counted (pd.recorder.hook_errors).
Without PDWATCH_VLLM=1, or where the guard keeps nothing, it is vLLM's class
unchanged.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector as VllmNixlConnector

from pdwatch import contract as c

from ..hook_table import Target, enabled
from . import hooks, running_plan, targets
from .state import state

log = logging.getLogger("pdwatch.vllm")


class NixlConnector(VllmNixlConnector):  # type: ignore[misc]  # vLLM is untyped here
    """vLLM's NixlConnector, recording each leg's stages for pdwatch."""


def _after(name: str, hook: Callable[..., None]) -> Callable[..., Any]:
    parent = getattr(VllmNixlConnector, name)

    @functools.wraps(parent)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = parent(self, *args, **kwargs)
        try:
            hook(result, self, *args, **kwargs)
        except Exception:  # the engine must never suffer for pdwatch
            hooks.counted_error()
        return result

    return method


def _around(name: str, hook: Callable[..., Any]) -> Callable[..., Any]:
    """The hook calls vLLM's method itself (call()) and returns what the method returns; if the hook
    raises, vLLM's own result stands (the method runs at most once)."""
    parent = getattr(VllmNixlConnector, name)

    @functools.wraps(parent)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        ran: list[Any] = []

        def call() -> Any:
            ran.append(parent(self, *args, **kwargs))
            return ran[0]

        try:
            return hook(call, self, *args, **kwargs)
        except Exception:
            hooks.counted_error()
            return ran[0] if ran else parent(self, *args, **kwargs)

    return method


def install(table: tuple[Target, ...]) -> None:
    """Connector rows become overrides of this class; the worker's rows are wrapped on each worker
    object as vLLM builds it (hooks.on_connector_built)."""
    for t in table:
        if t.path.startswith(targets.ASYNC_LLM + "."):
            continue  # the API server's: the entry point patches it (plugin())
        if t.path.startswith(targets.WORKER + "."):
            state.worker_rows.append(t)
        elif t.hook_type == "around":
            setattr(NixlConnector, t.method, _around(t.method, getattr(hooks, t.hook)))
        else:
            setattr(NixlConnector, t.method, _after(t.method, getattr(hooks, t.hook)))


if enabled(c.ENV_VLLM):
    _plan = running_plan()
    state.plan = _plan
    if _plan.refused:
        log.warning("pdwatch: this vLLM lacks hook target(s); plugin state %s: %s", _plan.state,
                    "; ".join(_plan.refused))
    install(_plan.install)
