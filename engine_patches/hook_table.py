"""One table of hook targets per engine adapter, and the start-up guard that reads it.

Each adapter (engine_patches/sglang, engine_patches/vllm) lists every engine
function it hooks as a `Target`: its plugin registers from the table, the guard
resolves the table against the running engine before anything is hooked, and
the adapter's contract test reads the installed source against it.

A refused target refuses its whole group, and the group's need decides the
plugin state: an essential group refused leaves nothing to install (no
recorder, so no heartbeat either); a lifecycle target refused refuses the whole
lifecycle, since a partial set would record legs that enter stages and never
leave them, which the sidecar would report as stuck, and the plugin only
heartbeats (`inactive`); an optional group refused alone leaves the rest
installed (`partial`).
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from pdwatch import contract as c

# The hook of a gap row: on the row's releases the transition has no target pdwatch hooks (yet); the
# row stands refused, so the plan knows what it costs (a lifecycle gap: heartbeats only).
GAP = ""
ESSENTIAL, LIFECYCLE, OPTIONAL = "essential", "lifecycle", "optional"


def enabled(variable: str) -> bool:
    """An adapter records only where its enable variable (PDWATCH_SGLANG, PDWATCH_VLLM) says so."""
    return os.environ.get(variable, "").strip().lower() in ("1", "true", "yes", "on")


class Target(NamedTuple):
    path: str  # module.Class.method
    hook_type: str  # "before" | "after" | "around"
    hook: str  # name of the function in the adapter's hooks module; "": none (see GAP)
    transition: str  # what the hook records
    params: tuple[str, ...] = ()
    attrs: tuple[str, ...] = ()
    kwonly: tuple[str, ...] = ()  # keyword-only parameters the hook reads by name
    group: str = "lifecycle"  # what refusing it costs: GROUP_NEED; unclassified counts as lifecycle
    versions: str = ""  # the engine releases the row is for, a PEP 440 specifier; empty: every one

    @property
    def gap(self) -> bool:
        """A row with no hook: what the target records cannot be hooked on these releases (refused)."""
        return not self.hook

    @property
    def module(self) -> str:
        return self.path.rsplit(".", 2)[0]

    @property
    def cls(self) -> str:
        return self.path.rsplit(".", 2)[1]

    @property
    def method(self) -> str:
        return self.path.rsplit(".", 2)[2]


def problems_with(target: Target) -> list[str]:
    """What is missing for one target in the running engine (empty: all there)."""
    if target.gap:
        return [f"{target.path}: not hooked on this release ({target.transition})"]
    try:
        module = importlib.import_module(target.module)
    except Exception as exc:  # ImportError, or whatever the module raises on import
        return [f"{target.path}: module {target.module} does not import ({type(exc).__name__}: {exc})"]
    cls = getattr(module, target.cls, None)
    if not isinstance(cls, type):
        return [f"{target.path}: class {target.cls} not found in {target.module}"]
    fn = cls.__dict__.get(target.method)
    if fn is None:
        return [f"{target.path}: method {target.method} not defined on {target.cls}"]
    fn = inspect.unwrap(getattr(fn, "__func__", fn))
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return [f"{target.path}: signature unreadable"]
    return [f"{target.path}: parameter {p!r} missing" for p in target.params if p not in params]


def missing_targets(targets: Iterable[Target]) -> list[str]:
    out: list[str] = []
    for target in targets:
        out.extend(problems_with(target))
    return out


def short(target: Target) -> str:
    """Class.method, as pd.plugin.refused names a target."""
    return f"{target.cls}.{target.method}"


class Plan(NamedTuple):
    state: str  # c.PLUGIN_ACTIVE / PARTIAL / INACTIVE
    install: tuple[Target, ...]  # the targets to hook
    refused: tuple[str, ...]  # "Class.method: why", one per target not hooked
    lifecycle: bool  # lifecycle spans recorded (False: heartbeats only)
    heartbeats: bool  # a recorder is created at all


def plan(table: Iterable[Target], problems: Mapping[str, list[str]], group_need: Mapping[str, str],
         heartbeat_groups: frozenset[str] = frozenset()) -> Plan:
    """What to install, given each target's problems (by path; absent or empty: fine)."""
    table = tuple(table)
    broken: dict[str, str] = {}  # group -> its first refused target
    for t in table:
        if problems.get(t.path) or t.gap:
            broken.setdefault(t.group, short(t))
    need = {g: group_need.get(g, LIFECYCLE) for g in broken}
    essential = any(n == ESSENTIAL for n in need.values())
    lifecycle = not essential and not any(n == LIFECYCLE for n in need.values())
    install: list[Target] = []
    refused: list[str] = []
    for t in table:
        why = "; ".join(p.split(": ", 1)[-1] for p in problems.get(t.path, ())) or (
            f"not hooked on this release ({t.transition})" if t.gap else "")
        if essential:
            kept, why = False, why or f"not installed: the essential {_first(broken, need, ESSENTIAL)} is refused"
        elif not lifecycle and group_need.get(t.group, LIFECYCLE) != ESSENTIAL and t.group not in heartbeat_groups:
            kept, why = False, why or f"lifecycle refused with {_first(broken, need, LIFECYCLE)}"
        elif t.group in broken:
            kept, why = False, why or f"group {t.group} refused with {broken[t.group]}"
        else:
            kept = True
        if kept:
            install.append(t)
        else:
            refused.append(f"{short(t)}: {why}")
    if not lifecycle:  # essential refused too: nothing hooked, no heartbeat says so
        state = c.PLUGIN_INACTIVE
    else:
        state = c.PLUGIN_PARTIAL if refused else c.PLUGIN_ACTIVE
    return Plan(state, tuple(install), tuple(refused), lifecycle, not essential)


def _first(broken: Mapping[str, str], need: Mapping[str, str], kind: str) -> str:
    return next(target for group, target in broken.items() if need[group] == kind)


def plan_for_running(table: Iterable[Target], group_need: Mapping[str, str],
                     heartbeat_groups: frozenset[str] = frozenset()) -> Plan:
    """The plan for the engine this process imports (a plugin's start-up check)."""
    table = tuple(table)
    return plan(table, {t.path: problems_with(t) for t in table}, group_need, heartbeat_groups)
