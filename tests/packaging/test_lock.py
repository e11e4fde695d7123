"""requirements.lock against what it is made from (pyproject.toml's extras) and what it makes (the venv).

`make lock` writes the lock; `make` installs it with --no-deps, so nothing checks at install time
that a requirement added to pyproject.toml is in the lock: these tests do, without a resolver.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements.lock"


def pins() -> dict[str, Version]:
    found: dict[str, Version] = {}
    for line in LOCK.read_text().splitlines():
        if not line or line[0] in "# \t":
            continue  # uv's header and its `# via` annotations
        req = Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==" and not req.extras and req.marker is None, line
        name = canonicalize_name(req.name)
        assert name not in found, f"{name} pinned twice"
        found[name] = Version(spec.version)
    return found


def declared() -> list[tuple[str, Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = {"(dependencies)": project["dependencies"], **project["optional-dependencies"]}
    return [(group, Requirement(text)) for group, reqs in groups.items() for text in reqs]


def test_the_lock_pins_every_requirement_of_every_extra_at_a_version_it_allows():
    locked = pins()
    for group, req in declared():
        name = canonicalize_name(req.name)
        if name == "pdwatch":
            continue  # an extra that names others (pdwatch[sidecar]); those are checked themselves
        assert name in locked, f"{req} ({group}) is not in requirements.lock: run `make lock`"
        assert req.specifier.contains(locked[name], prereleases=True), \
            f"requirements.lock pins {name}=={locked[name]}, {group} asks {req}: run `make lock`"


def test_the_venv_holds_what_the_lock_pins():
    wrong = {}
    for name, version in pins().items():
        try:
            installed = Version(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed != version:
            wrong[name] = (str(version), installed and str(installed))
    assert not wrong, f"(pinned, installed) differ, `make` reinstalls the lock: {wrong}"
