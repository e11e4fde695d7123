"""Renders every pdwatch dashboard to the JSON Grafana imports, and lists the
PromQL they contain (for tests that check expressions against Prometheus)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.cog.encoder import JSONEncoder

from pdwatch.dashboards import pdwatch_self, request_flow, stuck_requests

GENERATED_DIR = Path(__file__).resolve().parent / "generated"

# File name -> builder; the uid inside each is stable, so a push overwrites.
DASHBOARDS: dict[str, Callable[[], db.Dashboard]] = {
    "pd-request-flow.json": request_flow.build,
    "stuck-requests.json": stuck_requests.build,
    "pdwatch-self.json": pdwatch_self.build,
}


def as_dict(builder: db.Dashboard) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(json.dumps(builder.build(), cls=JSONEncoder))
    return doc


def render_all() -> dict[str, str]:
    """File name -> JSON text, keys sorted so that regenerating is byte-stable."""
    return {name: json.dumps(as_dict(build()), indent=2, sort_keys=True) + "\n" for name, build in DASHBOARDS.items()}


def write(out_dir: Path = GENERATED_DIR) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_all().items():
        path = out_dir / name
        path.write_text(text)
        written.append(path)
    return written


def stale(out_dir: Path = GENERATED_DIR) -> list[str]:
    """Names of generated files that are missing or differ from a fresh render."""
    return [name for name, text in render_all().items()
            if not (out_dir / name).is_file() or (out_dir / name).read_text() != text]


def load(out_dir: Path = GENERATED_DIR) -> dict[str, dict[str, Any]]:
    return {name: json.loads((out_dir / name).read_text()) for name in DASHBOARDS}


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def expressions(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every query of a dashboard: panel targets, annotations, variables."""
    out = []
    for panel in _panels(doc.get("panels", [])):
        for target in panel.get("targets", []):
            if target.get("expr"):
                out.append((f"panel {panel['title']!r} {target.get('refId', '')}", target["expr"]))
    for ann in doc.get("annotations", {}).get("list", []):
        if ann.get("expr"):
            out.append((f"annotation {ann['name']!r}", ann["expr"]))
    for var in doc.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            match = re.fullmatch(r"label_values\((.*),\s*\w+\)", var["query"])
            out.append((f"variable {var['name']!r}", match.group(1) if match else var["query"]))
    return out


def concrete(expr: str, *, rate_interval: str = "1m", cluster: str = ".*", role: str = ".*",
             instance: str = ".*") -> str:
    """An expression with Grafana's variables filled in, ready for Prometheus' API."""
    return (expr.replace("$__rate_interval", rate_interval).replace("$cluster", cluster)
            .replace("$role", role).replace("$instance", instance))
