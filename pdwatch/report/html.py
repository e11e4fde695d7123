"""report.html: the incident rendered through a Jinja2 template shipped in the package, autoescaped."""

from __future__ import annotations

import base64
import time
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import quote

from jinja2 import Environment, PackageLoader, StrictUndefined

from pdwatch.sidecar.diagnosis.facts import REPORT_AT

from .model import Incident
from .times import duration, utc

TEMPLATE = "report.html.j2"
ALERT_LABELS = ("severity", "cluster", "role", "stage", "pd_instance", "family")  # the ones a reader acts on


@cache
def _environment() -> Environment:
    # Every value is escaped (labels and trace ids come from the engines); a name the template misspells fails.
    env = Environment(loader=PackageLoader("pdwatch.report"), autoescape=True, undefined=StrictUndefined,
                      trim_blocks=True, lstrip_blocks=True)
    env.filters["utc"] = utc
    env.filters["duration"] = duration
    return env


def render_html(inc: Incident, figures: list[dict[str, Any]], out_dir: Path, *, title: str,
                trace_url: str | None) -> str:
    """The page, each figure's PNG (read from `out_dir`) embedded; trace ids linked through `trace_url`."""
    embedded = [{**fig, "png_base64": base64.b64encode((out_dir / fig["file"]).read_bytes()).decode("ascii")}
                for fig in figures]

    def trace_link(trace_id: str) -> str:
        assert trace_url is not None
        return trace_url.replace("{trace_id}", quote(trace_id, safe=""))

    return _environment().get_template(TEMPLATE).render(
        title=title, inc=inc, written=time.time(), figures=embedded,
        gpu_figure=any(f["file"] == "gpus.png" for f in figures),
        restarts=sorted((r, i.pd_instance) for i in inc.instances for r in i.restarts),
        alert_names=sorted({a.name for a in inc.alerts or []}), alert_labels=ALERT_LABELS,
        trace_url=trace_url, trace_link=trace_link, report_at=REPORT_AT,
    )
