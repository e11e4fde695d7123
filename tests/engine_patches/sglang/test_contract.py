"""The upgrade guard: every hook target, read from the installed SGLang source with `ast`.

The reading is engine_patches/sglang/source_check.py, shared with `pdwatch
check`; here each target of the installed release is a test that fails with
the target's name when an SGLang upgrade renames or reshapes a hooked method,
a parameter a hook reads, or an attribute a hook reads. `make test-matrix`
runs it against older releases too.
"""

from __future__ import annotations

import inspect

import pytest

from pdwatch.engine_patches.sglang import hooks, source_check
from pdwatch.engine_patches.sglang.source_check import class_attributes, positional
from pdwatch.engine_patches.sglang.targets import TARGETS as ALL_TARGETS
from pdwatch.engine_patches.sglang.targets import TESTED, Target, for_version, installed_version

# The rows for the installed release (targets.py keeps a row per range where releases differ),
# less its gap rows (a transition with nothing hooked there: refused, nothing to read).
TARGETS = tuple(t for t in for_version(installed_version()) if not t.gap)


def installed() -> None:
    if source_check.sglang_root() is None:
        pytest.fail("sglang is not installed (make test installs it: the sglang extra, in requirements.lock)")


def find_method(target: Target):
    installed()
    fn = source_check.find_method(target)
    assert not isinstance(fn, str), fn
    return fn


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
    installed()
    for qualified in target.attrs:
        assert "." in qualified, f"{target.path}: attribute {qualified!r} must be written Class.attr"
    missing = source_check.attribute_problems(target)
    assert not missing, missing[0]


@pytest.mark.parametrize("target", [t for t in TARGETS if t.kwonly], ids=lambda t: t.path.split("sglang.srt.")[-1])
def test_keyword_only_parameters_the_hook_reads_exist(target):
    find_method(target)
    missing = [p for p in source_check.parameter_problems(target) if "keyword-only" in p]
    assert not missing, missing[0]
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


@pytest.mark.parametrize("version", TESTED)
def test_table_has_one_entry_per_target(version):
    paths = [t.path for t in for_version(version)]
    assert len(paths) == len(set(paths)), "a target listed twice would be patched twice"
    assert all(t.versions for t in ALL_TARGETS if t.gap), "a gap row names the releases it is for"


def test_a_renamed_method_is_reported_by_name():
    ghost = Target("sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.pop_bootstrapped_v2", "after",
                   "on_prefill_bootstrapped", "renamed in a future SGLang", ("self",))
    with pytest.raises(AssertionError, match="PrefillBootstrapQueue.pop_bootstrapped_v2"):
        find_method(ghost)
    assert any("pop_bootstrapped_v2" in p for p in source_check.source_problems(ghost))
