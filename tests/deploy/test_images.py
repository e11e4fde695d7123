"""The two image recipes, read offline (no image is built here): the sidecar's on a pinned base, as a
non-root user; the engine's on the SGLang image the builder names, adding pdwatch's wheel without moving
SGLang's packages and refusing to build when the plugin would not be active; one build context that
carries only what they copy."""

from __future__ import annotations

import fnmatch
import re
import shlex

import tomllib

from tests.deploy.kube import ROOT

SIDECAR = ROOT / "deploy" / "kubernetes" / "Dockerfile"
ENGINE = ROOT / "deploy" / "engine" / "Dockerfile"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def instructions(path) -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) in order, continuation lines joined, comments left out."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") and not pending:
            continue
        pending += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            if pending.strip():
                word, _, rest = pending.strip().partition(" ")
                out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def copied(path) -> list[str]:
    return [src for word, rest in instructions(path) if word == "COPY" for src in shlex.split(rest)[:-1]]


def ignored(path: str) -> bool:
    """Whether .dockerignore leaves `path` out of the build context: the last pattern that matches decides."""
    out = False
    for pattern in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = pattern.strip()
        if not pattern or pattern.startswith("#"):
            continue
        keep = pattern.startswith("!")
        if fnmatch.fnmatch(path, pattern.lstrip("!")):
            out = not keep
    return out


def test_the_sidecar_image_is_on_a_pinned_base_and_runs_as_no_one_in_particular():
    (base,) = [rest for word, rest in instructions(SIDECAR) if word == "FROM"]
    # One Python patch release on one Debian release, or a digest: a rebuild is the same image.
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-[a-z]+(@sha256:[0-9a-f]{64})?", base), base
    (user,) = [rest for word, rest in instructions(SIDECAR) if word == "USER"]
    uid, _, gid = user.partition(":")
    assert int(uid) > 0 and int(gid) > 0, user  # numeric, so runAsNonRoot can verify it


def test_the_engine_image_adds_the_wheel_without_moving_sglangs_packages_and_checks_the_plugin():
    steps = instructions(ENGINE)
    assert steps[0] == ("ARG", "SGLANG_IMAGE") and steps[1] == ("FROM", "${SGLANG_IMAGE}")  # no default: named
    (run,) = [rest for word, rest in steps if word == "RUN"]
    commands = [shlex.split(part) for part in run.split("&&")]
    wheel = f"/tmp/dist/pdwatch-{VERSION}-py3-none-any.whl"
    assert ["python3", "-m", "pip", "install", "--no-cache-dir", "--no-deps", wheel] in commands
    # The wheel's own requirements, held to the image's versions: exactly pyproject's, none more.
    (held,) = [cmd for cmd in commands if "-c" in cmd]
    assert held[held.index("-c") + 1] == "/tmp/image-constraints.txt"
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert held[held.index("-c") + 2:] == dependencies
    assert commands.index(["python3", "-m", "pip", "check"]) < commands.index(["pdwatch", "check"])
    assert copied(ENGINE) == [f"dist/pdwatch-{VERSION}-py3-none-any.whl"]


def test_the_build_context_carries_what_the_images_copy_and_nothing_else():
    for path in (*copied(SIDECAR), *copied(ENGINE)):
        assert not ignored(path), path
    for path in (".venv/bin/python", "build/vllm/bin/python", ".git/config", "tests/conftest.py",
                 "dist/pdwatch-0.1.0.tar.gz", "pdwatch.egg-info/PKG-INFO", ".env"):
        assert ignored(path), path
