"""Installs what one SGLang release needs differently from the project's lock.

Run by a matrix venv's python (mk/sglang_matrix.mk), whose own site-packages
holds only that release and shadows the project venv's, seen after it. The
shared packages mostly fit; the ones that do not (transformers: a newer one
registers model names the older SGLang registers too, and then what that
transformers pins, tokenizers...) are installed into the release's venv,
--no-deps, until every requirement of what was installed there holds.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import site
import subprocess
import sys

from packaging.requirements import Requirement

# The packages whose pins are followed: the rest of SGLang's list names CUDA
# builds and serving extras a CPU check does not import.
FOLLOW = {"transformers", "tokenizers", "huggingface-hub", "safetensors"}


def _norm(name: str) -> str:
    return name.lower().replace("_", "-")


def unmet(dist: str) -> list[Requirement]:
    """The followed requirements of `dist` the visible packages do not meet."""
    out = []
    for text in md.requires(dist) or ():
        req = Requirement(text)
        if _norm(req.name) not in FOLLOW or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            have = None
        if have is None or not req.specifier.contains(have, prereleases=True):
            out.append(req)
    return out


def main() -> int:
    target = site.getsitepackages()[0]
    todo, done = ["sglang"], set()
    while todo:
        dist = todo.pop()
        for req in unmet(dist):
            spec = f"{req.name}{req.specifier}"
            if spec in done:
                sys.exit(f"{dist} still needs {spec} after installing it")
            done.add(spec)
            print(f"sglang {md.version('sglang')}: {dist} needs {spec}")
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                            "--upgrade", "--target", target, spec], check=True)
            importlib.invalidate_caches()  # metadata lookups see the new install
            todo.append(req.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
