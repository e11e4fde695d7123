"""Shared set-up for the SGLang plugin tests: the real, pinned sglang wheel.

SGLang modules take seconds each to import on this machine, so they are
imported once per test process, by the session fixture `sglang_plugin`, which
also loads pdwatch through SGLang's own plugin loader.
"""

from __future__ import annotations

import sys
import types

import pytest

# CPU torch 2.13 beside PyPI's torchvision 0.28: torchvision's op registration
# modules fail (`torchvision::nms does not exist`) and SGLang's scheduler
# reaches `import torchvision.transforms`. The registrations are not needed
# here, so empty modules stand in for them (tests only; never in the plugin).
for _name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
    sys.modules.setdefault(_name, types.ModuleType(_name))


@pytest.fixture(scope="session")
def sglang_plugin():
    """SGLang imported, pdwatch loaded by `load_plugins()` and its hooks applied."""
    import importlib.util
    import os

    if importlib.util.find_spec("sglang") is None:
        pytest.fail("sglang is not installed (make test installs it: the sglang extra, in requirements.lock)")

    # The modules the hooks patch, imported once for the whole session.
    import sglang.srt.disaggregation.decode
    import sglang.srt.disaggregation.nixl.conn
    import sglang.srt.disaggregation.prefill
    import sglang.srt.managers.scheduler  # noqa: F401
    import sglang.srt.plugins as plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    import pdwatch.engine_patches.sglang as pd_plugin

    old_env = {k: os.environ.get(k) for k in ("PDWATCH_SGLANG", "SGLANG_PLUGINS")}
    os.environ["PDWATCH_SGLANG"] = "1"
    os.environ["SGLANG_PLUGINS"] = "pdwatch"
    HookRegistry.reset()
    plugins._plugins_loaded = False
    plugins.load_plugins()
    try:
        yield pd_plugin
    finally:
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
