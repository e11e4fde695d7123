"""The upgrade guard: every hook target, read from the installed SGLang source with `ast`.

Nothing here imports SGLang, so it runs in a fraction of a second and fails
with the target's name when an SGLang upgrade renames or reshapes a hooked
method, a parameter a hook reads, or an attribute a hook reads. Attributes are
checked on the class the hook reads them from (and its bases, followed through
each module's imports): a name SGLang spells somewhere else does not count,
which is how `TokenizedGenerateReqInput.external_trace_header`, a field of
another class only, once passed here and failed on every live request.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
from functools import cache
from pathlib import Path

import pytest

from pdwatch.engine_patches.sglang import hooks
from pdwatch.engine_patches.sglang.targets import TARGETS, Target

# Modules that define the classes the hooks read fields of (Req, DecodeRequest,
# NextBatchPlan, KV managers, peer registrations, requests from the tokenizer).
OBJECT_MODULES = (
    "sglang.srt.managers.schedule_batch",
    "sglang.srt.managers.io_struct",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.disaggregation.base.conn",
    "sglang.srt.disaggregation.common.conn",
    "sglang.srt.disaggregation.nixl.conn",
    "sglang.srt.disaggregation.decode",
    "sglang.srt.disaggregation.prefill",
    "sglang.srt.managers.scheduler",
)


@cache
def sglang_root() -> Path:
    spec = importlib.util.find_spec("sglang")  # locates the package without importing it
    if spec is None or spec.origin is None:
        pytest.fail("sglang is not installed (make test installs it: the sglang extra, in requirements.lock)")
    return Path(spec.origin).parent.parent


@cache
def parsed(module: str) -> ast.Module:
    path = sglang_root() / (module.replace(".", "/") + ".py")
    assert path.is_file(), f"module {module} is missing from the installed SGLang ({path.name})"
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _imported_from(module: str, name: str) -> str | None:
    """The module `name` is imported from in `module`'s source (absolute or relative)."""
    for node in ast.walk(parsed(module)):
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level]
                return ".".join([*base, node.module] if node.module else base)
            return node.module
    return None


@cache
def find_class(name: str, module: str | None = None) -> tuple[str, ast.ClassDef] | None:
    """(module, class node) for a class name, in `module` or its imports, else in OBJECT_MODULES."""
    for mod in (module,) if module else OBJECT_MODULES:
        path = sglang_root() / (mod.replace(".", "/") + ".py")
        if not path.is_file():
            continue
        for node in parsed(mod).body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return mod, node
        if module:
            source = _imported_from(mod, name)
            if source and source.startswith("sglang."):
                return find_class(name, source)
    return None


@cache
def class_attributes(name: str, module: str | None = None) -> frozenset[str]:
    """Fields, class attributes, methods and `self.x = ...` names of a class and its SGLang bases."""
    found = find_class(name, module)
    if found is None:
        return frozenset()
    mod, cls = found
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
    for node in ast.walk(cls):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id == "self"):
            names.add(node.attr)
    for base in cls.bases:
        if isinstance(base, ast.Name):
            names |= class_attributes(base.id, mod)
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
def test_attributes_the_hook_reads_are_defined_on_their_class(target):
    missing = []
    for qualified in target.attrs:
        cls, _, attr = qualified.partition(".")
        assert attr, f"{target.path}: attribute {qualified!r} must be written Class.attr"
        if find_class(cls) is None:
            missing.append(f"{qualified} (class {cls} not found)")
        elif attr not in class_attributes(cls):
            missing.append(qualified)
    assert not missing, f"{target.path}: the hook reads {missing}, which SGLang no longer defines there"


@pytest.mark.parametrize("target", [t for t in TARGETS if t.kwonly], ids=lambda t: t.path.split("sglang.srt.")[-1])
def test_keyword_only_parameters_the_hook_reads_exist(target):
    fn = find_method(target)
    have = {a.arg for a in fn.args.kwonlyargs}
    missing = [p for p in target.kwonly if p not in have]
    assert not missing, f"{target.path}: the hook reads keyword-only {missing}; SGLang now has {sorted(have)}"
    hook = inspect.signature(getattr(hooks, target.hook))
    takes = any(p.kind is p.VAR_KEYWORD for p in hook.parameters.values())
    assert takes or set(target.kwonly) <= set(hook.parameters), f"{target.hook} cannot take {target.kwonly}"


def test_an_attribute_of_another_class_is_reported():
    """The 0.5.23 bug, kept as a check of the checker: the field lives on GenerateReqInput only."""
    assert "external_trace_header" in class_attributes("GenerateReqInput")
    assert "external_trace_header" not in class_attributes("TokenizedGenerateReqInput")
    assert "rid" in class_attributes("TokenizedGenerateReqInput")  # inherited from BaseReq


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
