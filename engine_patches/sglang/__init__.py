"""pdwatch's SGLang plugin: the real engine emits the pdwatch telemetry contract.

SGLang discovers it through the entry-point group `sglang.srt.plugins` (name
`pdwatch`) and calls `plugin()` with no arguments in every process it starts
(`load_plugins()`), then applies the registered hooks. Enable it with
`PDWATCH_SGLANG=1` in the server's environment; see docs/sglang.md.
"""

from __future__ import annotations

import logging

from pdwatch import contract as c

from ..hook_table import enabled
from . import targets

log = logging.getLogger("pdwatch.sglang")

ENABLE_ENV = c.ENV_SGLANG

# What the last plugin() call did, for logs and tests: "off", "disabled" (nothing hooked),
# "registered" (hooks installed; `plan.state` says whether all of them).
status = "not loaded"
problems: list[str] = []


def plugin() -> None:
    """Entry point SGLang calls: check every target, then register what the plan keeps."""
    global status, problems
    if not enabled(ENABLE_ENV):
        status = "off"
        return
    from .guard import plan_for_running
    from .state import state

    table = targets.for_version(targets.installed_version())
    plan = plan_for_running(table)
    problems = list(plan.refused)
    state.plan = plan
    if plan.refused:
        log.warning(
            "pdwatch: this SGLang lacks hook target(s); plugin state %s (%s): %s", plan.state,
            "lifecycle spans recorded" if plan.lifecycle else
            "heartbeats only" if plan.heartbeats else "nothing recorded, no heartbeat",
            "; ".join(plan.refused),
        )
    if not plan.install:
        status = "disabled"
        return
    register(plan.install)
    status = "registered"


def register(table: tuple[targets.Target, ...] = targets.TARGETS) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from . import hooks

    for target in table:
        HookRegistry.register(target.path, getattr(hooks, target.hook), HookType(target.hook_type))
