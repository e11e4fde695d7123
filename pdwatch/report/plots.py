"""The report's figures, drawn with matplotlib's Agg canvas (files only, no display, no pyplot state).

Each figure is written as a PNG; `save` returns where each panel lies in it
(pixels, top-left origin) and which series it plots in which colour, so
scripts and tests can read the images back.
"""

from __future__ import annotations

from datetime import timezone
from pathlib import Path
from typing import Any

import matplotlib.dates as mdates
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .model import Incident, Series, sum_series
from .times import dates, utc

GPU_ROWS_MAX = 12  # instances drawn in the GPU figure; the rest are listed
DPI = 100
# Distinct colours for series that share a stage (prefill transfer vs decode transfer) or an instance;
# no red: red marks restarts and alerts.
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"]


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)  # attaches itself: drawing, sizes and savefig through Agg
    return fig


def _marks(ax: Any, inc: Incident, *, alerts: bool, label: bool, label_worst: bool = False) -> None:
    """Restarts (red dashed), alert firing (red band), the worst moment (black dotted)."""
    ymax = ax.get_ylim()[1]
    if alerts and inc.alerts:
        for a in inc.alerts:
            for a0, a1 in a.firing:
                ax.axvspan(*dates([a0, max(a1, a0 + 1)]), color="#d62728", alpha=0.08, lw=0)
    for i in inc.instances:
        for r in i.restarts:
            ax.axvline(dates([r])[0], color="#d62728", ls="--", lw=1.2)
            if label:
                ax.text(dates([r])[0], ymax, f" {i.pd_instance} restart", color="#d62728", fontsize=8,
                        va="top", ha="left")
    if inc.worst_at is not None:
        ax.axvline(dates([inc.worst_at])[0], color="#222", ls=":", lw=1.2)
        if label_worst:
            ax.text(dates([inc.worst_at])[0], ymax * 0.85, f"worst: {inc.worst_stuck} stuck ", fontsize=8,
                    ha="right", va="top")


def _finish_axes(ax: Any, inc: Incident, title: str, ylabel: str) -> None:
    ax.set_title(title, loc="left", fontsize=10, fontweight="bold")
    ax.set_ylabel(ylabel, fontsize=9)
    ax.set_xlim(*dates([inc.start, inc.end]))
    ax.xaxis.set_major_locator(mdates.AutoDateLocator(tz=timezone.utc, minticks=3, maxticks=7))  # type: ignore[no-untyped-call]
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S", tz=timezone.utc))  # type: ignore[no-untyped-call]
    ax.grid(True, color="#e6e6e6", lw=0.6)
    ax.tick_params(labelsize=8)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _save(fig: Figure, path: Path, axes: dict[str, Any], plotted: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Writes the PNG; returns where each panel lies in it (pixels, top-left origin) and what it plots."""
    fig.canvas.draw()
    width, height = fig.canvas.get_width_height()
    panels = {}
    for name, ax in axes.items():
        b = ax.get_window_extent()
        legend = ax.get_legend()
        lb = legend.get_window_extent() if legend is not None else None
        panels[name] = {"box": [round(b.x0), round(height - b.y1), round(b.x1), round(height - b.y0)],
                        "legend": None if lb is None else [round(lb.x0), round(height - lb.y1), round(lb.x1),
                                                           round(height - lb.y0)],
                        "series": plotted.get(name, [])}
    fig.savefig(path, dpi=DPI)
    return {"file": path.name, "width": width, "height": height, "panels": panels}


def _width(k: int) -> float:
    return max(1.5, 5.0 - 2.0 * k)


def plot_flow(inc: Incident, path: Path) -> dict[str, Any]:
    """Open legs by stage, stuck legs by stage, finished ok per second: the incident's shape."""
    fig = _figure(12, 8.4)
    axes = fig.subplots(3, 1, sharex=True)
    plotted: dict[str, list[dict[str, Any]]] = {"open": [], "stuck": [], "finished": []}
    # Summed over instances per (role, stage): the cluster's flow through its stages.
    for panel, ax, attr in (("open", axes[0], "open"), ("stuck", axes[1], "stuck")):
        groups: dict[tuple[str, str, str], list[Series]] = {}
        for i in inc.instances:
            for stage, s in getattr(i, attr).items():
                key = (i.cluster, i.role, stage) if stage else (i.cluster, i.pd_instance, "")
                groups.setdefault(key, []).append(s)
        k = 0
        for (cl, who, stage), parts in sorted(groups.items()):
            s = sum_series(parts)
            if not any(s.v):
                continue  # a stage nothing ever sat in
            color = PALETTE[k % len(PALETTE)]
            name = f"{who} {stage}".strip() + (f" [{cl}]" if len(inc.clusters()) > 1 else "")
            # Each line thinner than the one before: two legs' identical counts stay both visible.
            ax.plot(dates(s.t), s.v, color=color, lw=_width(k), label=name)
            k += 1
            plotted[panel].append({"label": name, "color": color, "max": max(v or 0 for v in s.v)})
    for k, i in enumerate(x for x in inc.instances if x.ok_rate is not None):
        assert i.ok_rate is not None
        color = PALETTE[k % len(PALETTE)]
        ax = axes[2]
        ax.plot(dates(i.ok_rate.t), i.ok_rate.v, color=color, lw=_width(k), label=i.pd_instance)
        plotted["finished"].append({"label": i.pd_instance, "color": color,
                                    "max": max((v or 0) for v in i.ok_rate.v) if i.ok_rate.v else 0})
    titles = (("open", "open legs by stage"),
              ("stuck", "stuck legs by stage" if inc.stuck_by_stage_known else "stuck legs by instance (all stages)"),
              ("finished", "legs finished ok per second, by instance"))
    for ax, (name, title) in zip(axes, titles):
        ax.set_ylim(bottom=0, top=max(1.0, ax.get_ylim()[1] * 1.1))
        _finish_axes(ax, inc, title, "legs" if name != "finished" else "legs / s")
        _marks(ax, inc, alerts=True, label=name == "stuck", label_worst=name == "stuck")
        if plotted[name]:
            ax.legend(fontsize=8, loc="upper left", frameon=False, ncol=4)
        else:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", color="#888")
    axes[2].set_xlabel("time, UTC", fontsize=9)
    fig.suptitle(f"stage flow and stuck legs, {utc(inc.start)} – {utc(inc.end, False)}", fontsize=11, x=0.01,
                 ha="left")
    fig.tight_layout()
    return _save(fig, path, dict(zip(("open", "stuck", "finished"), axes)), plotted)


def plot_gpus(inc: Incident, path: Path) -> dict[str, Any] | None:
    """Per instance with GPUs: utilization % and power W against the limit, restarts and down/frozen bands."""
    with_gpus = [i for i in inc.instances if i.gpus][:GPU_ROWS_MAX]
    if not with_gpus:
        return None
    fig = _figure(12, 1.0 + 2.0 * len(with_gpus))
    axes = fig.subplots(len(with_gpus), 2, sharex=True, squeeze=False)
    panels: dict[str, Any] = {}
    plotted: dict[str, list[dict[str, Any]]] = {}
    for row, i in enumerate(with_gpus):
        ua, pa = axes[row]
        for k, g in enumerate(i.gpus):
            color = PALETTE[(k + 1) % len(PALETTE)]
            util = [None if v is None else v * 100 for v in g.utilization.v]
            ua.plot(dates(g.utilization.t), util, color=color, lw=_width(k), label=f"GPU {g.gpu}")
            pa.plot(dates(g.power_w.t), g.power_w.v, color=color, lw=_width(k), label=f"GPU {g.gpu}")
            plotted.setdefault(f"{i.pd_instance} util", []).append({"label": f"GPU {g.gpu}", "color": color})
            plotted.setdefault(f"{i.pd_instance} power", []).append({"label": f"GPU {g.gpu}", "color": color})
            if g.power_limit_w:
                pa.axhline(g.power_limit_w, color="#555", ls="--", lw=1)
        limit = max((g.power_limit_w or 0) for g in i.gpus)
        ua.set_ylim(0, 105)
        pa.set_ylim(0, (limit or max((v or 0) for g in i.gpus for v in g.power_w.v) or 1) * 1.1)
        for ax in (ua, pa):
            for series, color in ((i.up, "#888"), (i.frozen, "#f2a541")):
                if series is None:
                    continue
                bad = [v is not None and (v < 1 if series is i.up else v >= 1) for v in series.v]
                for a, b in _runs(series.t, bad):
                    ax.axvspan(*dates([a, b]), color=color, alpha=0.25, lw=0)
        _finish_axes(ua, inc, f"{i.pd_instance} ({i.role}): GPU utilization", "%")
        _finish_axes(pa, inc, f"{i.pd_instance}: GPU power" + (f", limit {limit:.0f} W dashed" if limit else ""), "W")
        for ax in (ua, pa):
            _marks(ax, inc, alerts=False, label=ax is ua)
            ax.legend(fontsize=7, loc="lower left", frameon=False, ncol=4)
        panels[f"{i.pd_instance} util"], panels[f"{i.pd_instance} power"] = ua, pa
    for ax in axes[-1]:
        ax.set_xlabel("time, UTC", fontsize=9)
    fig.tight_layout()
    return _save(fig, path, panels, plotted)


def _runs(t: list[float], flags: list[bool]) -> list[tuple[float, float]]:
    """Runs of samples where `flags` holds, as [start, end] intervals."""
    out: list[tuple[float, float]] = []
    begin: float | None = None
    for x, f in zip(t, flags):
        if f and begin is None:
            begin = x
        elif not f and begin is not None:
            out.append((begin, x))
            begin = None
    if begin is not None and t:
        out.append((begin, t[-1]))
    return out

