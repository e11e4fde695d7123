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
