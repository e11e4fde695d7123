"""The upgrade guard: every hook target, read from the installed SGLang source with `ast`.

Nothing here imports SGLang, so it runs in a fraction of a second and fails
with the target's name when an SGLang upgrade renames or reshapes a hooked
method, a parameter a hook reads, or an attribute a hook reads.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
from functools import lru_cache
from pathlib import Path

import pytest

from engine_patches.sglang import hooks
from engine_patches.sglang.targets import TARGETS, Target

# Modules that define the objects the hooks read fields of (Req, DecodeRequest,
# NextBatchPlan, KV managers, peer registrations, requests from the tokenizer).
OBJECT_MODULES = (
    "sglang.srt.managers.schedule_batch",
    "sglang.srt.managers.io_struct",
    "sglang.srt.managers.utils",
    "sglang.srt.disaggregation.base.conn",
    "sglang.srt.disaggregation.common.conn",
    "sglang.srt.disaggregation.nixl.conn",
    "sglang.srt.disaggregation.decode",
    "sglang.srt.disaggregation.prefill",
    "sglang.srt.managers.scheduler",
)


@lru_cache(maxsize=None)
def sglang_root() -> Path:
    spec = importlib.util.find_spec("sglang")  # locates the package without importing it
    if spec is None or spec.origin is None:
        pytest.skip("sglang is not installed (make test installs requirements-sglang.txt)")
    return Path(spec.origin).parent.parent


@lru_cache(maxsize=None)
def parsed(module: str) -> ast.Module:
    path = sglang_root() / (module.replace(".", "/") + ".py")
    assert path.is_file(), f"module {module} is missing from the installed SGLang ({path.name})"
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


@lru_cache(maxsize=None)
def identifiers(module: str) -> frozenset[str]:
    """Attribute, field, parameter and keyword names a module's source spells."""
    names: set[str] = set()
    for node in ast.walk(parsed(module)):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
        elif isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            names.add(node.value)  # getattr(obj, "name") and friends
    return frozenset(names)


def find_method(target: Target) -> ast.FunctionDef | ast.AsyncFunctionDef:
    tree = parsed(target.module)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == target.cls), None)
    assert cls is not None, f"{target.path}: class {target.cls} is gone from {target.module}"
    fn = next(
        (n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == target.method),
        None,
    )
    assert fn is not None, f"{target.path}: method {target.method} is no longer defined on {target.cls}"
    return fn


def positional(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    return [a.arg for a in fn.args.posonlyargs + fn.args.args]


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.path.split("sglang.srt.")[-1])
def test_target_exists_with_the_parameters_the_hook_reads(target):
    fn = find_method(target)
    have = positional(fn)
    assert have[: len(target.params)] == list(target.params), (
        f"{target.path}: the hook reads parameters {list(target.params)} in this order, "
        f"SGLang now has {have}"
    )


@pytest.mark.parametrize("target", [t for t in TARGETS if t.attrs], ids=lambda t: t.path.split("sglang.srt.")[-1])
def test_attributes_the_hook_reads_are_still_spelled_by_sglang(target):
    known = identifiers(target.module).union(*(identifiers(m) for m in OBJECT_MODULES))
    missing = [a for a in target.attrs if a not in known]
    assert not missing, f"{target.path}: the hook reads {missing}, which SGLang no longer spells anywhere"


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.hook)
def test_hook_signature_matches_its_target(target):
    """HookRegistry passes SGLang's own arguments, positionally or by SGLang's names."""
    hook = getattr(hooks, target.hook, None)
    assert callable(hook), f"{target.path}: hook {target.hook} is missing from engine_patches.sglang.hooks"
    params = [
        p.name for p in inspect.signature(hook).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    lead = {"before": 0, "after": 1, "around": 1}[target.hook_type]  # result / original first
    assert params[lead: lead + len(target.params)] == list(target.params), (
        f"{target.path}: hook {target.hook} takes {params}, expected {list(target.params)} after {lead} lead"
    )
    has_var = any(p.kind is p.VAR_POSITIONAL for p in inspect.signature(hook).parameters.values())
    assert has_var or len(params) - lead >= len(positional(find_method(target))), (
        f"{target.path}: hook {target.hook} cannot take every argument SGLang passes"
    )


def test_table_has_one_entry_per_target():
    paths = [t.path for t in TARGETS]
    assert len(paths) == len(set(paths)), "a target listed twice would be patched twice"


def test_a_renamed_method_is_reported_by_name():
    ghost = Target("sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.pop_bootstrapped_v2", "after",
                   "on_prefill_bootstrapped", "renamed in a future SGLang", ("self",))
    with pytest.raises(AssertionError, match="PrefillBootstrapQueue.pop_bootstrapped_v2"):
        find_method(ghost)
