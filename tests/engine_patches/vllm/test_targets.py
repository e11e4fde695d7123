"""The vLLM hook table against the installed vLLM: every target, parameter and attribute a hook reads.

Runs in vLLM's own environment (docs/vllm.md), not in `make test` yet:
    VLLM_ENV/bin/python -m pytest -q tests/engine_patches/vllm
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import textwrap

import pytest
import vllm  # noqa: F401  # fails loudly outside vLLM's environment

from pdwatch.engine_patches import hook_table
from pdwatch.engine_patches.vllm import targets

# Where the classes the hooks read fields of are defined.
OBJECT_CLASSES = {
    "Request": "vllm.v1.request",
    "SchedulerOutput": "vllm.v1.core.sched.output",
    "NewRequestData": "vllm.v1.core.sched.output",
    "CachedRequestData": "vllm.v1.core.sched.output",
    "KVConnectorOutput": "vllm.v1.outputs",
    "SamplingParams": "vllm.sampling_params",
    "NixlBaseConnector": "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector",
    "NixlBaseConnectorWorker": "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker",
}


def _assigned_on_self(cls: type) -> set[str]:
    """Names assigned as self.NAME anywhere in the class's (and its bases') methods."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        for node in ast.walk(tree):
            targets_ = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign) else [])
            for t in targets_:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    names.add(t.attr)
    return names


def has_attr(cls: type, name: str) -> bool:
    if any(name in vars(k) for k in cls.__mro__):
        return True  # a method, property, class attribute or declared field
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    if name in getattr(cls, "__annotations__", {}) or name in getattr(cls, "__struct_fields__", ()):
        return True
    return name in _assigned_on_self(cls)


def test_every_target_is_found_with_the_parameters_its_hook_reads():
    problems = {t.path: hook_table.problems_with(t) for t in targets.TARGETS}
    assert not any(problems.values()), {p: v for p, v in problems.items() if v}
    plan = hook_table.plan(targets.TARGETS, problems, targets.GROUP_NEED, targets.HEARTBEAT_GROUPS)
    assert plan.state == "active" and not plan.refused


@pytest.mark.parametrize("row", targets.TARGETS, ids=lambda t: f"{t.cls}.{t.method}")
def test_every_attribute_a_hook_reads_is_defined_on_its_class(row):
    for ref in row.attrs:
        cls_name, attr = ref.split(".", 1)
        module = importlib.import_module(OBJECT_CLASSES[cls_name])
        cls = getattr(module, cls_name)
        assert has_attr(cls, attr), f"{row.path}: {ref} is not defined in {module.__name__}"


def test_every_hook_the_table_names_exists():
    from pdwatch.engine_patches.vllm import hooks

    assert {t.hook for t in targets.TARGETS} <= set(dir(hooks))
