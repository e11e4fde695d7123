"""Checks the running SGLang against the hook table, before anything is hooked,
and decides what the plugin installs: the engine-neutral guard (hook_table.py)
with SGLang's groups (targets.GROUP_NEED)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..hook_table import Plan, missing_targets, problems_with, short
from ..hook_table import plan as _plan
from .targets import GROUP_NEED, TARGETS, Target

# The optional groups a heartbeat-only plugin still installs: they touch no leg.
_HEARTBEAT = frozenset({"shutdown"})


def plan(table: Iterable[Target], problems: Mapping[str, list[str]]) -> Plan:
    """What to install, given each target's problems (by path; absent or empty: fine)."""
    return _plan(table, problems, GROUP_NEED, _HEARTBEAT)


def plan_for_running(table: Iterable[Target] = TARGETS) -> Plan:
    """The plan for the SGLang this process imports (the plugin's start-up check)."""
    table = tuple(table)
    return plan(table, {t.path: problems_with(t) for t in table})


__all__ = ["Plan", "missing_targets", "plan", "plan_for_running", "problems_with", "short"]
