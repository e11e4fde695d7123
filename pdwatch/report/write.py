"""The whole report: read the incident, draw it, render it, write report.html, its PNGs and report.json."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from pdwatch.settings import ClientSettings

from .html import render_html
from .model import ReportError
from .plots import plot_flow, plot_gpus
from .sources import DEFAULT_RANGE_S, from_prometheus, from_sidecar
from .times import utc


def write_report(out_dir: str | os.PathLike[str], settings: ClientSettings, *, start: float | None = None,
                 end: float | None = None, cluster: str | None = None, title: str | None = None) -> Path:
    """Writes report.html (plots embedded), its PNGs and report.json into `out_dir`; returns report.html's path.

    From `settings.prometheus` when set, else from `settings.sidecar`. `start`/`end`: Unix seconds; default
    the last 30 minutes (a sidecar keeps 10). Raises a RuntimeError (ReportError, the client's SidecarError,
    the diagnosis' PrometheusError) when the source cannot be read.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if settings.prometheus:
        end = time.time() if end is None else end
        start = end - DEFAULT_RANGE_S if start is None else start
        if end <= start:
            raise ReportError("the range must end after it starts")
        inc = from_prometheus(settings, start, end, cluster=cluster)
    else:
        inc = from_sidecar(settings, start, end, cluster=cluster)
    figures = [plot_flow(inc, out / "flow.png")]
    gpus = plot_gpus(inc, out / "gpus.png")
    if gpus is not None:
        figures.append(gpus)
    else:
        (out / "gpus.png").unlink(missing_ok=True)  # not one from an older report in the same folder
    title = title or f"pdwatch incident report, {utc(inc.worst_at or inc.end)}"
    page = out / "report.html"
    page.write_text(render_html(inc, figures, out, title=title, trace_url=settings.trace_url), encoding="utf-8")
    # What was plotted where: for scripts, and for the tests that read the PNGs back.
    (out / "report.json").write_text(json.dumps({
        "source": inc.source, "start_unix_s": inc.start, "end_unix_s": inc.end, "worst_at_unix_s": inc.worst_at,
        "worst_stuck": inc.worst_stuck, "restarts": {i.pd_instance: i.restarts for i in inc.instances if i.restarts},
        "alerts": None if inc.alerts is None else [dataclasses.asdict(a) for a in inc.alerts],
        "diagnosis": [dataclasses.asdict(d) for d in inc.diagnosis], "oldest": inc.oldest, "figures": figures,
        "notes": inc.notes,
    }, indent=1, default=str), encoding="utf-8")
    return page
