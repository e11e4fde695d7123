"""The testbed's engines, in one registry: what `pdwatch testbed`, `pdwatch demo` and the tests launch.

Each `Engine` names its stack (a `StackBase` kind, imported only when launched:
the live ones import their engine's client code), its scenario catalogue, the
incident the demo runs on it, and what starting it takes. Every stack takes
the same parameters (`stack_base.StackArgs`) and has the same interface
(`start()`, `poll_events()`, `truth()`, `stop()`).

A scenario name means the same fault on every engine where it exists; the
catalogues say per engine whether it applies and what it should give (its
`family`, or none: nothing stuck). `matrix()` lays that out side by side.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from . import scenarios
from .scenarios import Catalogue, Scenario
from .sglang_pd import scenarios as sglang_scenarios
from .stack_base import StackBase
from .vllm_pd import scenarios as vllm_scenarios


@dataclass(frozen=True)
class Engine:
    name: str
    summary: str  # one line for --help
    catalogue: Catalogue
    stack: str  # "module:Class" under pdwatch.testbed
    incident: str  # the demo's scenario: the brief's incident as this engine shows it
    starting: str | None = None  # printed before a start that takes a while

    def launcher(self) -> type[StackBase]:
        module, name = self.stack.split(":")
        kind: type[StackBase] = getattr(importlib.import_module(f"pdwatch.testbed.{module}"), name)
        return kind

    def scenario(self, name: str) -> Scenario | None:
        return self.catalogue.by_name.get(name)


ENGINES: dict[str, Engine] = {e.name: e for e in (
    Engine("emulated", "pdwatch's own engine processes, KV over real NIXL (start in seconds)",
           scenarios.CATALOGUE, "stack:Stack", incident="decode-restart"),
    Engine("sglang", "real SGLang 0.5.23 servers and SGLang's router on this CPU (about a minute to start)",
           sglang_scenarios.CATALOGUE, "sglang_pd.stack:SglangStack", incident="transfer-wedge",
           starting="starting SGLang's prefill, decodes and router (about a minute on two cores) ..."),
    Engine("vllm", "real vLLM 0.32 servers (its own environment, build/vllm) and the testbed's PD proxy "
                   "(about a minute to start)",
           vllm_scenarios.CATALOGUE, "vllm_pd.stack:VllmStack", incident="transfer-wedge",
           starting="starting vLLM's prefill and decodes (about a minute on two cores) ..."),
)}


def get(name: str) -> Engine:
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r} (choose from {', '.join(ENGINES)})") from None


def all_scenarios() -> list[str]:
    """Every scenario name of any engine: the emulated catalogue's order, then the others' new ones."""
    names: dict[str, None] = {}
    for engine in ENGINES.values():
        names.update(dict.fromkeys(engine.catalogue.by_name))
    return list(names)


def expectation(scenario: Scenario) -> str:
    """What a scenario should give, in a word: the family pdwatch names, ordinary, or nothing stuck."""
    if scenarios.ORDINARY in scenario.tags:
        return "ordinary"
    return scenario.family or "none-stuck"


def matrix() -> dict[str, dict[str, str | None]]:
    """scenario -> engine -> what it should give there (None: the scenario does not apply to that engine)."""
    return {name: {e.name: (expectation(s) if (s := e.scenario(name)) is not None else None)
                   for e in ENGINES.values()} for name in all_scenarios()}
