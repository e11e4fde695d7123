"""Reads the installed SGLang's source with `ast` against the hook table.

Nothing here imports SGLang: it finds the package and parses the modules the
targets name, so it answers in a fraction of a second and names the target
when a release renames or reshapes a hooked method, a parameter a hook reads,
or an attribute a hook reads. Attributes are looked up on the class the hook
reads them from (and its bases, followed through each module's imports): a
name SGLang spells somewhere else does not count, which is how
`TokenizedGenerateReqInput.external_trace_header`, a field of another class
only, once passed a looser check and failed on every live request.
Shared by the contract test and `pdwatch check`.
"""

from __future__ import annotations

import ast
import importlib.util
from functools import cache
from pathlib import Path

from .targets import Target

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

Function = ast.FunctionDef | ast.AsyncFunctionDef


@cache
def sglang_root() -> Path | None:
    """The folder holding the installed `sglang` package (found without importing it)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent.parent


def _path(module: str) -> Path | None:
    root = sglang_root()
    path = root / (module.replace(".", "/") + ".py") if root else None
    return path if path is not None and path.is_file() else None


@cache
def parsed(module: str) -> ast.Module | None:
    path = _path(module)
    if path is None:
        return None
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _imported_from(module: str, name: str) -> str | None:
    """The module `name` is imported from in `module`'s source (absolute or relative)."""
    tree = parsed(module)
    for node in ast.walk(tree) if tree else ():
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
        tree = parsed(mod)
        if tree is None:
            continue
        for node in tree.body:
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
    for sub in ast.walk(cls):
        if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                and isinstance(sub.value, ast.Name) and sub.value.id == "self"):
            names.add(sub.attr)
    for base in cls.bases:
        if isinstance(base, ast.Name):
            names |= class_attributes(base.id, mod)
    return frozenset(names)


def find_method(target: Target) -> Function | str:
    """The hooked method's node, or why there is none."""
    tree = parsed(target.module)
    if tree is None:
        return f"{target.path}: module {target.module} is missing from the installed SGLang"
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == target.cls), None)
    if cls is None:
        return f"{target.path}: class {target.cls} is gone from {target.module}"
    fn = next((n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
               and n.name == target.method), None)
    if fn is None:
        return f"{target.path}: method {target.method} is no longer defined on {target.cls}"
    return fn


def positional(fn: Function) -> list[str]:
    return [a.arg for a in fn.args.posonlyargs + fn.args.args]


def parameter_problems(target: Target) -> list[str]:
    """The method is there and takes the parameters the hook reads, in order (keyword-only ones by name)."""
    fn = find_method(target)
    if isinstance(fn, str):
        return [fn]
    out = []
    have = positional(fn)
    if have[: len(target.params)] != list(target.params):
        out.append(f"{target.path}: the hook reads parameters {list(target.params)} in this order, "
                   f"SGLang now has {have}")
    kwonly = {a.arg for a in fn.args.kwonlyargs}
    missing = [p for p in target.kwonly if p not in kwonly]
    if missing:
        out.append(f"{target.path}: the hook reads keyword-only {missing}; SGLang now has {sorted(kwonly)}")
    return out


def attribute_problems(target: Target) -> list[str]:
    """The attributes the hook reads, each defined on the class it is read from."""
    missing = []
    for qualified in target.attrs:
        cls, _, attr = qualified.partition(".")
        if not attr:
            missing.append(f"{qualified} (must be written Class.attr)")
        elif find_class(cls) is None:
            missing.append(f"{qualified} (class {cls} not found)")
        elif attr not in class_attributes(cls):
            missing.append(qualified)
    if not missing:
        return []
    return [f"{target.path}: the hook reads {missing}, which SGLang no longer defines there"]


def source_problems(target: Target) -> list[str]:
    return parameter_problems(target) + attribute_problems(target)
