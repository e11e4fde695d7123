"""The tree shows the layers: each top-level folder is one subpackage of `pdwatch`, and
imports only flow down (contract names at the bottom, the CLI at the top)."""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# Folder -> what it may import of pdwatch. A new edge here is a design decision, not a fix.
ALLOWED = {
    "contract": set(),
    "engine_patches": {"contract"},
    "sidecar": {"contract"},
    "alerts": {"contract"},
    "dashboards": {"contract"},
    "testbed": {"contract", "engine_patches", "alerts"},
    "pdwatch": {"contract", "engine_patches", "sidecar", "alerts", "dashboards", "testbed"},
}


def folder_of(module: str) -> str:
    """The repository folder of a `pdwatch.*` module (`pdwatch.cli` lives in pdwatch/ itself)."""
    sub = module.split(".")[1] if "." in module else ""
    return sub if sub in ALLOWED and sub != "pdwatch" else "pdwatch"


def pdwatch_imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out.update(n for n in names if n == "pdwatch" or n.startswith("pdwatch."))
    return out


def test_imports_flow_down_the_layers():
    wrong = []
    for folder, allowed in ALLOWED.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            for module in pdwatch_imports(path):
                if module == "pdwatch":
                    continue
                target = folder_of(module)
                if target != folder and target not in allowed:
                    wrong.append(f"{path.relative_to(ROOT)} imports {module} ({folder} -> {target})")
    assert not wrong, "\n".join(wrong)


def test_nothing_imports_bare_folder_names():
    """In the wheel only `pdwatch` exists: `import sidecar` works in a checkout and nowhere else."""
    bare = []
    for path in sorted(ROOT.glob("**/*.py")):
        if any(part.startswith(".") or part in ("build", "cpu_site") for part in path.relative_to(ROOT).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            bare.extend(f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in ALLOWED
                        and n.split(".")[0] != "pdwatch")
    assert not bare, "\n".join(bare)


def test_every_package_folder_is_mapped_into_the_namespace():
    tool = PYPROJECT["tool"]["setuptools"]
    mapped = tool["package-dir"]
    listed = set(tool["packages"])
    on_disk = set()
    for init in ROOT.glob("*/**/__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if rel.parts[0].startswith(".") or rel.parts[0] in ("tests", "build", "bench"):
            continue
        top = rel.parts[0]
        base = next(k for k, v in mapped.items() if v == top)
        on_disk.add(".".join([base, *rel.parts[1:]]))
    assert on_disk <= listed, f"packages missing from pyproject.toml: {sorted(on_disk - listed)}"
    # Past `pdwatch`, a listed package is a layer's or a folder of the top itself (pdwatch/report/).
    assert all(p.split(".")[1] in ALLOWED or (ROOT / "pdwatch" / p.split(".")[1]).is_dir() for p in listed if "." in p)
    assert set(mapped.values()) == set(ALLOWED), "each layer folder is mapped once"


# ---- inside the sidecar: the rooms of ../shared/DESIGN.md --------------------------------------

# Module (relative to sidecar/) -> room. Every module of the sidecar is in one room; a new module
# picks its room here, and the table below says what it may import.
SIDECAR_ROOMS = {
    # Parts that belong to no one data flow: settings, the GPU sampler and its join, stores with
    # their own locks, the classifier's inputs.
    "base": {"settings", "auth", "worker", "overload", "capture", "families", "gpu.sampler", "gpu.join",
             "diagnosis.facts", "diagnosis", "gpu"},  # the last two: empty package files
    # The one writer and the facts it keeps.
    "facts": {"tracker", "model", "samples", "durations", "spans", "otlp_body"},
    # What the judge publishes: immutable values.
    "values": {"evaluation"},
    # The judge, its rules and its own tables (history: the samples it keeps for the live page).
    "judge": {"judge", "rules", "engine_health", "thresholds", "verdicts", "contrast", "history", "diagnosis.classify",
              "diagnosis.from_evaluation"},
    # Readers: they see values, never facts or rules.
    "readers": {"metrics", "views", "forward", "ui", "diagnosis.collector", "gpu.collector",
                "diagnosis.from_prometheus"},
    # Wiring, the HTTP surface (ingest and reads) and the process's main.
    "top": {"service", "server", "app", "__main__"},
}
ROOM_MAY_IMPORT = {
    "base": {"base"},
    "facts": {"base", "facts", "values"},
    "values": {"base", "values"},
    "judge": {"base", "facts", "values", "judge"},
    "readers": {"base", "values", "readers"},
    "top": set(SIDECAR_ROOMS),
}


def sidecar_module(path: Path) -> str:
    rel = path.relative_to(ROOT / "sidecar").with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def room_of(module: str) -> str | None:
    for room, modules in SIDECAR_ROOMS.items():
        if module in modules:
            return room
    return None


def sidecar_imports(path: Path) -> set[str]:
    """The sidecar modules a file imports, relative or absolute, as names relative to sidecar/."""
    here = sidecar_module(path).split(".") if sidecar_module(path) else []
    package = here if path.name == "__init__.py" else here[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
            mod = [*base, *(node.module.split(".") if node.module else [])]
        elif node.module and node.module.startswith("pdwatch.sidecar"):
            mod = node.module.split(".")[2:]
        else:
            continue
        for alias in node.names:  # `from . import rules` names a module, `from .x import y` a member
            full = ".".join([*mod, alias.name])
            out.add(full if room_of(full) and (ROOT / "sidecar" / Path(*full.split("."))).with_suffix(".py").exists()
                    else ".".join(mod))
    return {m for m in out if m}


def test_every_sidecar_module_has_a_room():
    homeless = [sidecar_module(p) for p in sorted((ROOT / "sidecar").rglob("*.py"))
                if sidecar_module(p) and room_of(sidecar_module(p)) is None]
    assert not homeless, f"put these in SIDECAR_ROOMS: {homeless}"


def test_the_sidecar_rooms_import_only_down_the_data_flow():
    wrong = []
    for path in sorted((ROOT / "sidecar").rglob("*.py")):
        me = room_of(sidecar_module(path)) if sidecar_module(path) else "top"
        for module in sidecar_imports(path):
            room = room_of(module)
            if room is not None and room not in ROOM_MAY_IMPORT[me or "top"]:
                wrong.append(f"{path.relative_to(ROOT)} ({me}) imports {module} ({room})")
    assert not wrong, "\n".join(wrong)


# ---- benches and tests -------------------------------------------------------------------------


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
    return names


def test_benches_use_the_tests_support_code_only_and_tests_never_import_benches():
    """Shared test parts live in tests/support/ (or a folder's support.py); a test or a conftest is no library."""
    wrong = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "tests" and not (parts[1:2] == ["support"] or parts[-1] == "support"):
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    for path in sorted((ROOT / "tests").rglob("*.py")):
        wrong.extend(f"{path.relative_to(ROOT)} imports {name}" for name in _imports(path)
                     if name.split(".")[0] == "bench")
    for path in sorted((ROOT / "tests" / "support").glob("*.py")):
        wrong.extend(f"{path.relative_to(ROOT)} imports {name}" for name in _imports(path)
                     if name.startswith("tests.") and not name.startswith("tests.support"))
    assert not wrong, "\n".join(wrong)


# ---- no circle ---------------------------------------------------------------------------------

LAYER_FOLDERS = {"contract", "engine_patches", "sidecar", "alerts", "dashboards", "testbed", "pdwatch"}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts if parts[0] == "pdwatch" else ["pdwatch", *parts])


def module_imports(path: Path, known: set[str]) -> set[str]:
    """The pdwatch modules a file imports when it is loaded (imports inside functions run later, if ever)."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, ast.If):  # `if TYPE_CHECKING:` and the like: not run on load
            continue
        if isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join([*base, *([node.module] if node.module else [])])
            candidates = [f"{mod}.{a.name}" for a in node.names] + [mod]
        else:
            continue
        for cand in candidates:
            while cand and cand not in known:
                cand = cand.rpartition(".")[0]
            if cand and cand != name:
                out.add(cand)
                break
    return out


def test_no_module_imports_itself_round_a_circle():
    paths = [p for folder in LAYER_FOLDERS for p in (ROOT / folder).rglob("*.py")
             if "cpu_site" not in p.parts]
    known = {module_name(p) for p in paths}
    graph = {module_name(p): module_imports(p, known) for p in paths}
    # A package's __init__ importing its own submodules is how Python packages work, not a circle.
    graph = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
    done: set[str] = set()
    trail: list[str] = []

    def visit(m: str) -> list[str] | None:
        if m in trail:
            return trail[trail.index(m):] + [m]
        if m in done:
            return None
        trail.append(m)
        for dep in sorted(graph.get(m, ())):
            circle = visit(dep)
            if circle:
                return circle
        trail.pop()
        done.add(m)
        return None

    for m in sorted(graph):
        circle = visit(m)
        assert circle is None, " -> ".join(circle)
