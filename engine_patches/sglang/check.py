"""`pdwatch check`: would the SGLang plugin be active on the SGLang installed here?

Run it inside the engine image (or venv) before a rollout. It resolves every
hook target of the installed release the way the plugin does at start-up
(import, class, method, parameters: guard.py) and reads the source the way
the contract test does (parameter order, keyword-only parameters, the
attributes each hook reads: source_check.py), then plans as the plugin would.
Per target: ok, refused (and why), or untested (found, on a release the
matrix in docs/sglang.md has not checked). Exit status 0 only when the plugin
would be `active` (with --expect STATE: only when it would be STATE).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Sequence
from typing import Any

from pdwatch import contract as c

from . import guard, source_check, targets

# The plugin loader SGLang calls plugin() from; releases before 0.5.11 have none.
LOADER = "sglang.srt.plugins.hook_registry"
OK, REFUSED, UNTESTED = "ok", "refused", "untested"


def _loader_present() -> bool:
    try:
        return importlib.util.find_spec(LOADER) is not None
    except ImportError:  # sglang.srt.plugins itself missing
        return False


def _problems(rows: tuple[targets.Target, ...], version: str | None) -> dict[str, list[str]]:
    if version is None:
        return {t.path: ["sglang is not installed"] for t in rows}
    if not _loader_present():
        return {t.path: [f"this SGLang has no plugin loader ({LOADER}); it never calls plugin()"] for t in rows}
    return {t.path: guard.problems_with(t) or ([] if t.gap else source_check.source_problems(t)) for t in rows}


def run_check(table: Sequence[targets.Target] | None = None, version: str | None = None) -> dict[str, Any]:
    """What the plugin would do on the installed SGLang, as a JSON-ready dict."""
    if version is None:
        version = targets.installed_version()
    if table is not None:
        rows = tuple(table)
    else:  # without SGLang (nor, maybe, packaging), every row is refused anyway
        rows = targets.for_version(version) if version else targets.TARGETS
    problems = _problems(rows, version)
    plan = guard.plan(rows, problems)
    installed = {t.path for t in plan.install}
    why = dict(r.split(": ", 1) for r in plan.refused)
    tested = version in targets.TESTED
    out = []
    for t in rows:
        if t.path in installed:
            result, reason = (OK if tested else UNTESTED), ""
        else:
            result, reason = REFUSED, why.get(guard.short(t), "")
        out.append({"target": t.path, "hook": t.hook, "group": t.group, "result": result, "why": reason})
    return {
        "sglang": version,
        "tested": tested,
        "state": plan.state,
        "heartbeats": plan.heartbeats,
        "lifecycle": plan.lifecycle,
        "refused": list(plan.refused),
        "targets": out,
    }


def render(report: dict[str, Any]) -> str:
    lines = [f"sglang {report['sglang'] or '(not installed)'}"
             f"{'' if report['tested'] else ' (not a release the matrix tested)'}"]
    width = max((len(t["target"].removeprefix("sglang.srt.")) for t in report["targets"]), default=0)
    for t in report["targets"]:
        name = t["target"].removeprefix("sglang.srt.")
        lines.append(f"  {t['result']:<8} {name:<{width}}  {t['why']}".rstrip())
    what = ("every hook installed" if report["state"] == c.PLUGIN_ACTIVE else
            "lifecycle spans recorded, some hooks refused" if report["lifecycle"] else
            "heartbeats only: no lifecycle spans" if report["heartbeats"] else
            "nothing recorded, not even heartbeats: the instance would vanish")
    lines.append(f"plugin state: {report['state']} ({what})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdwatch check",
        description="Check the installed SGLang against pdwatch's hook table: per target ok/refused/untested, "
                    "and the plugin state it would run in. Exits non-zero unless that state is active.",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--expect", choices=c.PLUGIN_STATES,
                        help="exit 0 only when the state is this one (the version matrix)")
    args = parser.parse_args(argv)
    report = run_check()
    print(json.dumps(report, indent=2) if args.json else render(report))
    if report["sglang"] is None:
        return 2
    return 0 if report["state"] == (args.expect or c.PLUGIN_ACTIVE) else 1


if __name__ == "__main__":
    sys.exit(main())
