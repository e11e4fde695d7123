"""pdwatch's SGLang plugin: the real engine emits the pdwatch telemetry contract.

SGLang discovers it through the entry-point group `sglang.srt.plugins` (name
`pdwatch`) and calls `plugin()` with no arguments in every process it starts
(`load_plugins()`), then applies the registered hooks. Enable it with
`PDWATCH_SGLANG=1` in the server's environment; see docs/sglang.md.
"""

from __future__ import annotations

import logging
import os

from pdwatch import contract as c

from . import targets

log = logging.getLogger("pdwatch.sglang")

ENABLE_ENV = c.ENV_SGLANG

# What the last plugin() call did, for logs and tests: "disabled", "off",
# "registered".
status = "not loaded"
problems: list[str] = []


def plugin() -> None:
    """Entry point SGLang calls: check every target, then register every hook."""
    global status, problems
    if os.environ.get(ENABLE_ENV, "").strip().lower() not in ("1", "true", "yes", "on"):
        status = "off"
        return
    from .guard import missing_targets

    problems = missing_targets(targets.TARGETS)
    if problems:
        status = "disabled"
        log.warning(
            "pdwatch: this SGLang lacks %d hook target(s); the plugin is disabled and the server "
            "runs without pdwatch telemetry: %s",
            len(problems), "; ".join(problems),
        )
        return
    register()
    status = "registered"


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from . import hooks

    for target in targets.TARGETS:
        HookRegistry.register(target.path, getattr(hooks, target.hook), HookType(target.hook_type))
