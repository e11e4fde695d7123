"""Checks the running SGLang still has every hook target, before anything is hooked.

The plugin hooks all of its targets or none: a partial set would record legs
that enter stages and never leave them, which the sidecar would report as
stuck. So a missing class, method or parameter disables the whole plugin.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable

from .targets import TARGETS, Target


def problems_with(target: Target) -> list[str]:
    """What is missing for one target in the running SGLang (empty: all there)."""
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


def missing_targets(targets: Iterable[Target] = TARGETS) -> list[str]:
    out: list[str] = []
    for target in targets:
        out.extend(problems_with(target))
    return out
