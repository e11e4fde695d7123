"""`pdwatch report`: a self-contained incident report, an HTML file with its plots embedded and PNGs beside it.

From a Prometheus that scraped the sidecars (`--prometheus URL`, over `--from`/`--to`,
the last 30 minutes by default), or from one sidecar's recent history (`--sidecar URL`,
the last 10 minutes at most: what it keeps). The report shows stage flow and stuck
legs per stage over time, GPU utilization and power per instance, restarts and alert
state marked, the diagnosis at the worst moment (the most stuck legs), and the oldest
stuck traces, linked to a trace store with `--trace-url`.

    pdwatch report --prometheus http://127.0.0.1:9090 --from 2h --to 1h30m --out incident-42
    pdwatch report --sidecar http://127.0.0.1:4318 --trace-url 'https://jaeger.example/trace/{trace_id}'
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from pdwatch import contract as c

DEFAULT_RANGE_S = 30 * 60
HISTORY_MAX_S = 600  # what a sidecar keeps (sidecar/history.py)
MAX_POINTS = 720  # per series: a step for a 30-minute range of 2.5 s
OLDEST_TOP = 20
GPU_ROWS_MAX = 12  # instances drawn in the GPU figure; the rest are listed
DPI = 100
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
STAGE_COLORS = {"bootstrap": "#8c6bb1", "queued": "#f2a541", "prefill": "#2f7ed8", "transfer": "#17a2b8",
                "decode": "#3cb371"}
# Distinct colours for series that share a stage (prefill transfer vs decode transfer) or an instance;
# no red: red marks restarts and alerts.
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"]


class ReportError(RuntimeError):
    pass


# ---- the incident, whatever its source ---------------------------------------------------------

@dataclass
class Series:
    t: list[float]
    v: list[float | None]

    def at(self, when: float) -> float | None:
        """The latest value at or before `when`."""
        best = None
        for t, v in zip(self.t, self.v):
            if t > when + 1e-6:
                break
            best = v
        return best


@dataclass
class Gpu:
    gpu: str
    uuid: str
    utilization: Series  # 0..1
    power_w: Series
    power_limit_w: float | None


@dataclass
class Instance:
    cluster: str
    pd_instance: str
    role: str
    open: dict[str, Series] = field(default_factory=dict)  # stage -> open legs
    stuck: dict[str, Series] = field(default_factory=dict)  # stage -> stuck legs ("" = all stages)
    ok_rate: Series | None = None  # legs finished ok per second
    up: Series | None = None  # 1 / 0
    frozen: Series | None = None  # 1 when the loop is frozen
    gpus: list[Gpu] = field(default_factory=list)
    restarts: list[float] = field(default_factory=list)  # Unix s


@dataclass
class Alert:
    name: str
    labels: dict[str, str]
    firing: list[tuple[float, float]]  # [start, end] intervals


@dataclass
class Incident:
    source: str
    start: float
    end: float
    instances: list[Instance] = field(default_factory=list)
    alerts: list[Alert] | None = None  # None: the source knows no alert state
    stuck_by_stage_known: bool = True
    diagnosis: list[dict[str, Any]] = field(default_factory=list)  # per cluster, at the worst moment
    oldest: list[dict[str, Any]] = field(default_factory=list)  # oldest stuck legs
    notes: list[str] = field(default_factory=list)
    worst_at: float | None = None
    worst_stuck: int = 0

    def stuck_total(self) -> Series:
        return _sum([s for i in self.instances for s in i.stuck.values()])

    def clusters(self) -> list[str]:
        return sorted({i.cluster for i in self.instances})


def _sum(series: list[Series]) -> Series:
    total: dict[float, float] = {}
    for s in series:
        for t, v in zip(s.t, s.v):
            key = round(t, 3)
            total[key] = total.get(key, 0.0) + (v or 0.0)
    keys = sorted(total)
    return Series(keys, [total[k] for k in keys])


# ---- time ------------------------------------------------------------------------------------

def parse_time(text: str | None, now: float) -> float:
    """`now`, a duration before now (`30m`, `now-2h`, `-90s`), Unix seconds, or ISO 8601 (UTC unless it says)."""
    if text is None or text.strip() in ("", "now"):
        return now
    s = text.strip()
    m = re.fullmatch(r"(?:now\s*)?-?\s*(\d+(?:\.\d+)?)\s*([smhd])", s)
    if m:
        return now - float(m[1]) * UNITS[m[2]]
    try:
        return float(s)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(s.replace("Z", "+00:00"))
    except ValueError:
        raise ReportError(f"cannot read the time {text!r}: use now, 30m, now-2h, Unix seconds or ISO 8601") from None
    return (dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)).timestamp()


def utc(t: float | None, with_date: bool = True) -> str:
    if t is None:
        return "–"
    fmt = "%Y-%m-%d %H:%M:%S UTC" if with_date else "%H:%M:%S"
    return datetime.fromtimestamp(t, timezone.utc).strftime(fmt)


def _dur(s: float | None) -> str:
    if s is None:
        return "–"
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


# ---- from Prometheus ---------------------------------------------------------------------------

def _range_query(client: httpx.Client, expr: str, start: float, end: float, step: float
                 ) -> list[tuple[dict[str, str], Series]]:
    from pdwatch.sidecar.diagnosis.from_prometheus import api_result

    result = api_result(client, "/api/v1/query_range",
                        {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"})
    out = []
    for item in result:
        values = item.get("values", [])
        out.append((item["metric"], Series([float(t) for t, _ in values],
                                           [None if v in ("NaN", "+Inf", "-Inf") else float(v) for _, v in values])))
    return out


def _step(start: float, end: float) -> float:
    return float(max(1, math.ceil((end - start) / MAX_POINTS)))


def from_prometheus(url: str, start: float, end: float, *, headers: dict[str, str] | None = None,
                    timeout_s: float = 10.0, cluster: str | None = None) -> Incident:
    step = _step(start, end)
    # A rate needs two scrapes inside its window; 30 s covers a 15 s scrape interval.
    window = f"{int(max(4 * step, 30))}s"
    inc = Incident(f"Prometheus {url}", start, end)
    sel = f'cluster="{cluster}"' if cluster else ""
    by_inst = "cluster, role, pd_instance"
    with httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s, headers=headers) as client:
        def q(expr: str) -> list[tuple[dict[str, str], Series]]:
            return _range_query(client, expr, start, end, step)

        instances: dict[tuple[str, str], Instance] = {}

        def inst(m: dict[str, str]) -> Instance:
            key = (m.get("cluster", ""), m.get("pd_instance", ""))
            if key not in instances:
                instances[key] = Instance(key[0], key[1], m.get("role", ""))
            return instances[key]

        for m, s in q(f"max by ({by_inst}) ({c.INSTANCE_UP.name}{{{sel}}})"):
            inst(m).up = s
        for m, s in q(f"sum by ({by_inst}, stage) ({c.INFLIGHT.name}{{{sel}}})"):
            inst(m).open[m.get("stage", "")] = s
        for m, s in q(f"sum by ({by_inst}, stage) ({c.STUCK.name}{{{sel}}})"):
            inst(m).stuck[m.get("stage", "")] = s
        ok = f'{c.FINISHED.series}{{outcome="ok"{"," + sel if sel else ""}}}'
        for m, s in q(f"sum by ({by_inst}) (rate({ok}[{window}]))"):
            inst(m).ok_rate = s
        for m, s in q(f"max by ({by_inst}) (pdwatch_engine_loop_frozen{{{sel}}})"):
            inst(m).frozen = s
        for m, s in q(f"max by ({by_inst}) ({c.INSTANCE_START.name}{{{sel}}})"):
            # A new start time under the same name is a restart; the first one seen is the process running at `start`.
            seen = [v for v in s.v if v is not None]
            inst(m).restarts = sorted({v for v in seen[1:] if v != seen[0]})
        gpus: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        gpu_sel = f'pd_instance!=""{"," + sel if sel else ""}'
        for metric, field_name in ((c.GPU_UTILIZATION, "utilization"), (c.GPU_POWER, "power_w"),
                                   (c.GPU_POWER_LIMIT, "power_limit_w")):
            for m, s in q(f"max by ({by_inst}, gpu, uuid) ({metric.name}{{{gpu_sel}}})"):
                key = (m.get("cluster", ""), m.get("pd_instance", ""), m.get("gpu", ""), m.get("uuid", ""))
                g = gpus.setdefault(key, {"m": m})
                g[field_name] = s
        for (_cl, _name, gpu, uuid), g in sorted(gpus.items()):
            limits = [v for v in (g.get("power_limit_w") or Series([], [])).v if v]
            empty = Series([], [])
            inst(g["m"]).gpus.append(Gpu(gpu, uuid, g.get("utilization", empty), g.get("power_w", empty),
                                         max(limits) if limits else None))
        inc.instances = sorted(instances.values(), key=_inst_order)
        _trim(inc)

        alerts = []
        for m, s in q('ALERTS{alertstate="firing"}'):
            labels = {k: v for k, v in m.items() if k not in ("__name__", "alertstate")}
            if cluster and labels.get("cluster") not in (None, cluster):
                continue
            alerts.append(Alert(labels.pop("alertname", "?"), labels, _intervals(s, step)))
        inc.alerts = sorted(alerts, key=lambda a: (a.firing[0][0] if a.firing else 0, a.name))

        # The oldest stuck legs: the sidecars expose their 20 oldest; over the range, the oldest of all seen.
        oldest: dict[tuple[str, str], dict[str, Any]] = {}
        for m, s in q(f"max by (cluster, role, stage, pd_instance, trace_id, rid, reason) ({c.STUCK_INFO.name}{{{sel}}})"):
            vals = [(t, v) for t, v in zip(s.t, s.v) if v is not None]
            if not vals:
                continue
            key = (m.get("trace_id", ""), m.get("role", ""))
            age = max(v for _, v in vals)
            if key not in oldest or age > oldest[key]["stage_age_s"]:
                oldest[key] = {"trace_id": key[0], "role": key[1], "rid": m.get("rid", ""),
                               "stage": m.get("stage", ""), "pd_instance": m.get("pd_instance", ""),
                               "cluster": m.get("cluster", ""), "reason": m.get("reason", ""),
                               "stage_age_s": age, "last_seen_unix_s": vals[-1][0]}
        inc.oldest = sorted(oldest.values(), key=lambda x: -x["stage_age_s"])[:OLDEST_TOP]

        _worst(inc)
        confidences: dict[tuple[str, str], Series] = {}
        for m, s in q(f"max by (cluster, family) (pdwatch_diagnosis_confidence{{{sel}}})"):
            confidences[(m.get("cluster", ""), m.get("family", ""))] = s
        live = None
        if end >= time.time() - max(60.0, 2 * step):
            # The range ends now: the classifier can reason over the same Prometheus, with its sentences.
            from pdwatch.sidecar.diagnosis.classify import verdict
            from pdwatch.sidecar.diagnosis.from_prometheus import gather

            try:
                live = {v["cluster"]: v for v in (verdict(f) for f in gather(url, timeout_s=timeout_s, headers=headers))}
            except RuntimeError as exc:
                inc.notes.append(f"the classifier could not read Prometheus at the end of the range: {exc}")
        inc.diagnosis = _diagnose(inc, confidences, live)
    if not inc.instances:
        inc.notes.append("Prometheus has no pdwatch series in this range (is it scraping the sidecars?)")
    return inc


def _trim(inc: Incident) -> None:
    """Starts the plots where the data does, when the range asked begins before it."""
    first = min((s.t[0] for i in inc.instances for s in (*i.open.values(), *i.stuck.values(), i.up) if s and s.t),
                default=None)
    if first is not None and first > inc.start + 1:
        inc.notes.append(f"the data begins at {utc(first)}, after the start of the range asked ({utc(inc.start)})")
        inc.start = max(inc.start, first - max(2.0, (inc.end - first) * 0.02))


def _intervals(s: Series, step: float) -> list[tuple[float, float]]:
    """Runs of samples at most one step apart, as [start, end] intervals."""
    out: list[tuple[float, float]] = []
    for t, v in zip(s.t, s.v):
        if v is None:
            continue
        if out and t - out[-1][1] <= step * 1.5:
            out[-1] = (out[-1][0], t)
        else:
            out.append((t, t))
    return out


def _inst_order(i: Instance) -> tuple[str, int, str]:
    return (i.cluster, {"prefill": 0, "decode": 1, "unified": 2}.get(i.role, 9), i.pd_instance)


# ---- from a sidecar ----------------------------------------------------------------------------

def from_sidecar(url: str, start: float | None, end: float | None, *, headers: dict[str, str] | None = None,
                 timeout_s: float = 10.0, cluster: str | None = None) -> Incident:
    base = url.rstrip("/")
    with httpx.Client(base_url=base, timeout=timeout_s, headers=headers) as client:
        def get(path: str, **params: Any) -> Any:
            try:
                r = client.get(path, params=params or None)
            except httpx.HTTPError as exc:
                raise ReportError(f"cannot reach the sidecar at {base}: {exc}") from None
            if r.status_code != 200:
                raise ReportError(f"{base}{path} answered {r.status_code}: {r.text[:200]}")
            return r.json()

        summary = get("/api/v1/summary")
        # The sidecar's clock, not this machine's, says what "now" is in its history.
        now = float(summary.get("at_unix_s") or time.time())
        end = now if end is None else min(end, now)
        start = max(end - DEFAULT_RANGE_S, now - HISTORY_MAX_S) if start is None else start
        if start < now - HISTORY_MAX_S:
            start = now - HISTORY_MAX_S
        if end <= start:
            raise ReportError(f"the sidecar keeps only its last {HISTORY_MAX_S} s; the range asked ends before that")
        history = get("/api/v1/history", seconds=max(1.0, now - start))
        stuck = get(c.PATH_STUCK)
        diagnosis = get(c.PATH_DIAGNOSIS)
    inc = Incident(f"sidecar {base}", start, end, alerts=None, stuck_by_stage_known=False)
    restarts = {(i["cluster"], i["pd_instance"]): i.get("restart_times_unix_s") or [] for i in summary["instances"]}
    for h in history["instances"]:
        if cluster and h["cluster"] != cluster:
            continue
        # History times are rounded to the millisecond, "now" to the microsecond: a millisecond of slack.
        keep = [k for k, t in enumerate(h["t"]) if start - 1e-3 <= t <= end + 1e-3]
        if not keep:
            continue
        t = [h["t"][k] for k in keep]

        def col(values: list[Any], t: list[float] = t, keep: list[int] = keep) -> Series:
            return Series(t, [None if values[k] is None else float(values[k]) for k in keep])

        ok = [h["finished_ok"][k] for k in keep]
        rate: list[float | None] = [None] + [
            (b - a) / (t2 - t1) if b >= a and t2 > t1 else None for a, b, t1, t2 in zip(ok, ok[1:], t, t[1:])]
        i = Instance(h["cluster"], h["pd_instance"], h["role"],
                     open={stage: col(v) for stage, v in h["open"].items()},
                     stuck={"": col(h["stuck"])}, ok_rate=Series(t, rate), up=col(h["up"]),
                     frozen=col(h["loop_frozen"]),
                     gpus=[Gpu(g["gpu"], g["uuid"], col(g["utilization"]), col(g["power_w"]), g.get("power_limit_w"))
                           for g in h["gpus"]],
                     restarts=[r for r in restarts.get((h["cluster"], h["pd_instance"]), []) if start <= r <= end])
        inc.instances.append(i)
    inc.instances.sort(key=_inst_order)
    _trim(inc)
    inc.oldest = [s for s in stuck if not cluster or s["cluster"] == cluster][:OLDEST_TOP]
    _worst(inc)
    live = {v["cluster"]: v for v in diagnosis}
    inc.diagnosis = _diagnose(inc, {}, live, live_at=now)
    inc.notes.append("from a sidecar: stuck legs are counted per instance, not per stage; no alert state "
                     "(Prometheus keeps it: use --prometheus); the oldest stuck legs and the classifier's "
                     f"evidence are as of {utc(now)}")
    if not inc.instances:
        inc.notes.append("the sidecar has no history in this range")
    return inc


# ---- the worst moment and the diagnosis there --------------------------------------------------

def _worst(inc: Incident) -> None:
    total = inc.stuck_total()
    best = None
    for t, v in zip(total.t, total.v):
        if v and (best is None or v >= best[1]):  # the latest moment at the peak
            best = (t, v)
    if best is not None:
        inc.worst_at, inc.worst_stuck = best[0], int(round(best[1]))


def _diagnose(inc: Incident, confidences: dict[tuple[str, str], Series], live: dict[str, dict] | None,
              live_at: float | None = None) -> list[dict[str, Any]]:
    from pdwatch.sidecar.diagnosis.classify import ACTIONS, REPORT_AT

    at = inc.worst_at if inc.worst_at is not None else inc.end
    out = []
    for cl in inc.clusters():
        found = sorted(((fam, v) for (c_, fam), s in confidences.items() if c_ == cl
                        for v in [s.at(at)] if v is not None and v >= REPORT_AT), key=lambda x: -x[1])
        now_verdict = (live or {}).get(cl)
        entry: dict[str, Any] = {"cluster": cl, "at_unix_s": at, "family": None, "confidence": None,
                                 "evidence": _evidence(inc, cl, at), "action": None, "others": [],
                                 "classifier": None}
        if found:
            entry["family"], entry["confidence"] = found[0]
            entry["action"] = ACTIONS.get(found[0][0])
            entry["others"] = found[1:]
        elif now_verdict and now_verdict.get("family") and not confidences:
            # No confidence history (a sidecar): the classifier's verdict now stands for the incident.
            entry["family"], entry["confidence"] = now_verdict["family"], now_verdict["confidence"]
            entry["action"] = now_verdict.get("action")
            entry["others"] = [(f["family"], f["confidence"]) for f in now_verdict.get("findings", [])[1:]]
        if now_verdict and now_verdict.get("family"):
            entry["classifier"] = {"at_unix_s": live_at or inc.end, "family": now_verdict["family"],
                                   "confidence": now_verdict["confidence"],
                                   "evidence": now_verdict.get("evidence", []), "action": now_verdict.get("action")}
            if entry["family"] == now_verdict["family"] and now_verdict.get("action"):
                entry["action"] = now_verdict["action"]  # it knows the restart skew behind a wedge
        out.append(entry)
    return out


def _evidence(inc: Incident, cl: str, at: float) -> list[str]:
    """What the series say at that moment, in sentences with their figures."""
    insts = [i for i in inc.instances if i.cluster == cl]
    out = []
    groups = []
    for i in insts:
        for stage, s in i.stuck.items():
            n = int(round(s.at(at) or 0))
            if n:
                groups.append(f"{i.pd_instance} {i.role} {stage}: {n}" if stage else f"{i.pd_instance}: {n}")
    total = sum(int(round(s.at(at) or 0)) for i in insts for s in i.stuck.values())
    out.append(f"{total} leg(s) stuck at {utc(at)}" + (f" ({', '.join(groups)})" if groups else ""))
    rate = sum((i.ok_rate.at(at) or 0) for i in insts if i.ok_rate is not None)
    out.append(f"meanwhile {rate:.1f} leg(s) per second finished ok in the cluster"
               + (": others were flowing" if rate > 0 else ": nothing was flowing"))
    for i in insts:
        if i.up is not None and (i.up.at(at) or 0) < 1:
            out.append(f"{i.pd_instance} was down (no heartbeats)")
        if i.frozen is not None and (i.frozen.at(at) or 0) >= 1:
            out.append(f"{i.pd_instance}'s scheduler loop was frozen")
        for r in i.restarts:
            if r <= at:
                out.append(f"{i.pd_instance} ({i.role}) restarted at {utc(r)}, {_dur(at - r)} before")
        stuck_here = any((s.at(at) or 0) > 0 for s in i.stuck.values())
        for g in i.gpus:
            u, w = g.utilization.at(at), g.power_w.at(at)
            if stuck_here and (u is not None or w is not None):
                limit = f" of {g.power_limit_w:.0f} W" if g.power_limit_w else ""
                util = "–" if u is None else f"{u * 100:.0f} %"
                power = "–" if w is None else f"{w:.0f} W"
                out.append(f"{i.pd_instance}: GPU {g.gpu} at {util} utilization, {power}{limit}")
    return out


# ---- plots ------------------------------------------------------------------------------------

def _mpl() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    return plt


def _dates(ts: list[float]) -> list[datetime]:
    return [datetime.fromtimestamp(t, timezone.utc) for t in ts]


def _marks(ax: Any, inc: Incident, *, alerts: bool, label: bool, label_worst: bool = False) -> None:
    """Restarts (red dashed), alert firing (red band), the worst moment (black dotted)."""
    ymax = ax.get_ylim()[1]
    if alerts and inc.alerts:
        for a in inc.alerts:
            for a0, a1 in a.firing:
                ax.axvspan(*_dates([a0, max(a1, a0 + 1)]), color="#d62728", alpha=0.08, lw=0)
    for i in inc.instances:
        for r in i.restarts:
            ax.axvline(_dates([r])[0], color="#d62728", ls="--", lw=1.2)
            if label:
                ax.text(_dates([r])[0], ymax, f" {i.pd_instance} restart", color="#d62728", fontsize=8,
                        va="top", ha="left")
    if inc.worst_at is not None:
        ax.axvline(_dates([inc.worst_at])[0], color="#222", ls=":", lw=1.2)
        if label_worst:
            ax.text(_dates([inc.worst_at])[0], ymax * 0.85, f"worst: {inc.worst_stuck} stuck ", fontsize=8,
                    ha="right", va="top")


def _finish_axes(ax: Any, inc: Incident, title: str, ylabel: str) -> None:
    import matplotlib.dates as mdates

    ax.set_title(title, loc="left", fontsize=10, fontweight="bold")
    ax.set_ylabel(ylabel, fontsize=9)
    ax.set_xlim(*_dates([inc.start, inc.end]))
    ax.xaxis.set_major_locator(mdates.AutoDateLocator(tz=timezone.utc, minticks=3, maxticks=7))
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S", tz=timezone.utc))
    ax.grid(True, color="#e6e6e6", lw=0.6)
    ax.tick_params(labelsize=8)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _save(fig: Any, path: Path, axes: dict[str, Any], plotted: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
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
    _mpl().close(fig)
    return {"file": path.name, "width": width, "height": height, "panels": panels}


def _width(k: int) -> float:
    return max(1.5, 5.0 - 2.0 * k)


def plot_flow(inc: Incident, path: Path) -> dict[str, Any]:
    """Open legs by stage, stuck legs by stage, finished ok per second: the incident's shape."""
    plt = _mpl()
    fig, axes = plt.subplots(3, 1, figsize=(12, 8.4), dpi=DPI, sharex=True)
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
            s = _sum(parts)
            if not any(s.v):
                continue  # a stage nothing ever sat in
            color = PALETTE[k % len(PALETTE)]
            name = f"{who} {stage}".strip() + (f" [{cl}]" if len(inc.clusters()) > 1 else "")
            # Each line thinner than the one before: two legs' identical counts stay both visible.
            ax.plot(_dates(s.t), s.v, color=color, lw=_width(k), label=name)
            k += 1
            plotted[panel].append({"label": name, "color": color, "max": max(v or 0 for v in s.v)})
    for k, i in enumerate(x for x in inc.instances if x.ok_rate is not None):
        assert i.ok_rate is not None
        color = PALETTE[k % len(PALETTE)]
        ax = axes[2]
        ax.plot(_dates(i.ok_rate.t), i.ok_rate.v, color=color, lw=_width(k), label=i.pd_instance)
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
    plt = _mpl()
    fig, axes = plt.subplots(len(with_gpus), 2, figsize=(12, 1.0 + 2.0 * len(with_gpus)), dpi=DPI, sharex=True,
                             squeeze=False)
    panels: dict[str, Any] = {}
    plotted: dict[str, list[dict[str, Any]]] = {}
    for row, i in enumerate(with_gpus):
        ua, pa = axes[row]
        for k, g in enumerate(i.gpus):
            color = PALETTE[(k + 1) % len(PALETTE)]
            util = [None if v is None else v * 100 for v in g.utilization.v]
            ua.plot(_dates(g.utilization.t), util, color=color, lw=_width(k), label=f"GPU {g.gpu}")
            pa.plot(_dates(g.power_w.t), g.power_w.v, color=color, lw=_width(k), label=f"GPU {g.gpu}")
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
                    ax.axvspan(*_dates([a, b]), color=color, alpha=0.25, lw=0)
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
    out, begin = [], None
    for x, f in zip(t, flags):
        if f and begin is None:
            begin = x
        elif not f and begin is not None:
            out.append((begin, x))
            begin = None
    if begin is not None and t:
        out.append((begin, t[-1]))
    return out


# ---- HTML ---------------------------------------------------------------------------------------

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;color:#1d2330;margin:0;background:#f5f6f8}
main{max-width:1240px;margin:0 auto;padding:20px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:16px;margin:22px 0 8px}
.meta{color:#6b7280}.card{background:#fff;border:1px solid #e3e6eb;border-radius:6px;padding:12px 16px;margin:10px 0}
.family{font-weight:700;text-transform:uppercase;color:#d62728}
table{border-collapse:collapse;width:100%;font-size:13px}th,td{text-align:left;padding:4px 8px;border-bottom:1px solid #eef0f3}
th{color:#6b7280;font-weight:600}.mono{font-family:ui-monospace,"DejaVu Sans Mono",Menlo,monospace;font-size:12.5px}
img{max-width:100%;border:1px solid #e3e6eb;border-radius:4px;background:#fff}.muted{color:#6b7280}
.kpis{display:flex;gap:12px;flex-wrap:wrap}.kpi{background:#fff;border:1px solid #e3e6eb;border-radius:6px;padding:8px 14px}
.kpi b{font-size:20px;display:block}
"""


def _link(trace_id: str, template: str | None) -> str:
    text = f'<span class="mono">{html.escape(trace_id)}</span>'
    if not template:
        return text
    href = template.replace("{trace_id}", trace_id)
    return f'<a href="{html.escape(href, quote=True)}">{text}</a>'


def render_html(inc: Incident, figures: list[dict[str, Any]], out_dir: Path, *, title: str,
                trace_url: str | None) -> str:
    e = html.escape
    parts = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{e(title)}</title>"
             f"<style>{CSS}</style></head><body><main>",
             f"<h1>{e(title)}</h1><div class='meta'>{e(utc(inc.start))} – {e(utc(inc.end))} · from {e(inc.source)}"
             f" · written {e(utc(time.time()))} by pdwatch report</div>"]
    restarts = sorted((r, i) for i in inc.instances for r in i.restarts)
    fired = inc.alerts or []
    parts.append("<div class='kpis'>")
    parts.append(f"<div class='kpi'><b>{inc.worst_stuck}</b>stuck legs at the worst moment"
                 f"<div class='muted'>{e(utc(inc.worst_at))}</div></div>")
    parts.append(f"<div class='kpi'><b>{len(restarts)}</b>restart(s)"
                 + "".join(f"<div class='muted'>{e(i.pd_instance)} {e(utc(r, False))}</div>" for r, i in restarts[:4])
                 + "</div>")
    if inc.alerts is not None:
        names = sorted({a.name for a in fired})
        parts.append(f"<div class='kpi'><b>{len(names)}</b>alert(s) fired"
                     + "".join(f"<div class='muted'>{e(n)}</div>" for n in names[:5]) + "</div>")
    parts.append(f"<div class='kpi'><b>{len(inc.instances)}</b>instance(s) in {len(inc.clusters())} cluster(s)</div>")
    parts.append("</div>")

    parts.append("<h2>Diagnosis at the worst moment</h2>")
    if not inc.diagnosis:
        parts.append("<div class='card muted'>Nothing to diagnose: no instance reported in this range.</div>")
    for d in inc.diagnosis:
        parts.append("<div class='card'>")
        head = (f"<span class='family'>{e(d['family'].replace('_', ' '))}</span> (confidence {d['confidence']:.2f})"
                if d["family"] else "no failure family suspected")
        parts.append(f"<div><b>{e(d['cluster'])}</b> at {e(utc(d['at_unix_s']))}: {head}</div>")
        parts.append("<ul>" + "".join(f"<li>{e(s)}</li>" for s in d["evidence"]) + "</ul>")
        if d["action"]:
            parts.append(f"<div><b>Action:</b> {e(d['action'])}</div>")
        if d["others"]:
            parts.append("<div class='muted'>also suspected: "
                         + ", ".join(f"{e(f)} ({conf:.2f})" for f, conf in d["others"]) + "</div>")
        cv = d.get("classifier")
        if cv:
            parts.append(f"<div class='muted' style='margin-top:6px'>The classifier at {e(utc(cv['at_unix_s']))}: "
                         f"{e(cv['family'])} ({cv['confidence']:.2f})</div><ul class='muted'>"
                         + "".join(f"<li>{e(s)}</li>" for s in cv["evidence"]) + "</ul>")
        parts.append("</div>")

    parts.append("<h2>Plots</h2>")
    for fig in figures:
        data = base64.b64encode((out_dir / fig["file"]).read_bytes()).decode("ascii")
        parts.append(f"<p><img alt='{e(fig['file'])}' src='data:image/png;base64,{data}'><br>"
                     f"<span class='muted'>{e(fig['file'])} · red dashed: restarts · red band: alerts firing · "
                     f"dotted: the worst moment · grey/orange band: instance down / loop frozen</span></p>")
    if not any(f["file"] == "gpus.png" for f in figures):
        parts.append("<p class='muted'>No GPU telemetry was joined to any instance in this range.</p>")

    parts.append("<h2>Oldest stuck traces</h2>")
    if inc.oldest:
        parts.append("<table><tr><th>trace id</th><th>role</th><th>stage</th><th>instance</th><th>age</th>"
                     "<th>reason</th><th>rid</th><th>cluster</th></tr>")
        for s in inc.oldest:
            parts.append(f"<tr><td>{_link(s['trace_id'], trace_url)}</td><td>{e(s['role'])}</td>"
                         f"<td>{e(s['stage'])}</td><td>{e(s['pd_instance'])}</td><td>{e(_dur(s['stage_age_s']))}</td>"
                         f"<td>{e(str(s.get('reason') or ''))}</td><td class='mono'>{e(str(s.get('rid') or ''))}</td>"
                         f"<td>{e(s['cluster'])}</td></tr>")
        parts.append("</table>")
        if not trace_url:
            parts.append("<p class='muted'>Give <code>--trace-url 'https://…/trace/{trace_id}'</code> to link them to "
                         "a trace store; <code>pdwatch trace TRACE_ID</code> draws one from a sidecar.</p>")
    else:
        parts.append("<p class='muted'>No leg was stuck in this range.</p>")

    if inc.alerts:
        parts.append("<h2>Alerts</h2><table><tr><th>alert</th><th>labels</th><th>firing</th></tr>")
        for a in inc.alerts:
            labels = ", ".join(f"{k}={v}" for k, v in sorted(a.labels.items()) if k in
                               ("severity", "cluster", "role", "stage", "pd_instance", "family"))
            spans = "; ".join(f"{utc(a0, False)} – {utc(a1, False)}" for a0, a1 in a.firing)
            parts.append(f"<tr><td>{e(a.name)}</td><td>{e(labels)}</td><td>{e(spans)}</td></tr>")
        parts.append("</table>")

    parts.append("<h2>Instances</h2><table><tr><th>cluster</th><th>instance</th><th>role</th><th>restarts</th>"
                 "<th>GPUs</th></tr>")
    for i in inc.instances:
        gpus = ", ".join(f"{g.gpu} ({g.uuid})" for g in i.gpus) or "–"
        parts.append(f"<tr><td>{e(i.cluster)}</td><td>{e(i.pd_instance)}</td><td>{e(i.role)}</td>"
                     f"<td>{e(', '.join(utc(r, False) for r in i.restarts) or '–')}</td>"
                     f"<td class='mono'>{e(gpus)}</td></tr>")
    parts.append("</table>")
    if inc.notes:
        parts.append("<h2>Notes</h2><ul class='muted'>" + "".join(f"<li>{e(n)}</li>" for n in inc.notes) + "</ul>")
    parts.append("</main></body></html>")
    return "\n".join(parts)


# ---- the whole report ------------------------------------------------------------------------------

def write_report(out_dir: str | os.PathLike[str], *, prometheus: str | None = None, sidecar: str | None = None,
                 start: float | None = None, end: float | None = None, token: str | None = None,
                 trace_url: str | None = None, cluster: str | None = None, title: str | None = None,
                 timeout_s: float = 10.0) -> Path:
    """Writes report.html (plots embedded), its PNGs and report.json into `out_dir`; returns report.html's path.

    From `prometheus` (a base URL) when given, else from `sidecar` (default http://127.0.0.1:4318).
    `start`/`end`: Unix seconds; default the last 30 minutes (a sidecar keeps 10). `token`: the sidecar's
    bearer token. `trace_url`: a link template with `{trace_id}`. Raises ReportError (or the
    diagnosis' PrometheusError, a RuntimeError) when the source cannot be read.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if prometheus:
        end = time.time() if end is None else end
        start = end - DEFAULT_RANGE_S if start is None else start
        if end <= start:
            raise ReportError("the range must end after it starts")
        inc = from_prometheus(prometheus, start, end, timeout_s=timeout_s, cluster=cluster)
    else:
        headers = {"Authorization": f"Bearer {token}"} if token else None
        inc = from_sidecar(sidecar or f"http://{c.DEFAULT_HOST}:{c.DEFAULT_PORT}", start, end, headers=headers,
                           timeout_s=timeout_s, cluster=cluster)
    figures = [plot_flow(inc, out / "flow.png")]
    gpus = plot_gpus(inc, out / "gpus.png")
    if gpus is not None:
        figures.append(gpus)
    else:
        (out / "gpus.png").unlink(missing_ok=True)  # not one from an older report in the same folder
    title = title or f"pdwatch incident report, {utc(inc.worst_at or inc.end)}"
    page = out / "report.html"
    page.write_text(render_html(inc, figures, out, title=title, trace_url=trace_url), encoding="utf-8")
    # What was plotted where: for scripts, and for the tests that read the PNGs back.
    (out / "report.json").write_text(json.dumps({
        "source": inc.source, "start_unix_s": inc.start, "end_unix_s": inc.end, "worst_at_unix_s": inc.worst_at,
        "worst_stuck": inc.worst_stuck, "restarts": {i.pd_instance: i.restarts for i in inc.instances if i.restarts},
        "alerts": None if inc.alerts is None else [{"name": a.name, "labels": a.labels, "firing": a.firing}
                                                   for a in inc.alerts],
        "diagnosis": inc.diagnosis, "oldest": inc.oldest, "figures": figures, "notes": inc.notes,
    }, indent=1, default=str), encoding="utf-8")
    return page


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdwatch report", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prometheus", metavar="URL", help="a Prometheus that scrapes the sidecars")
    src.add_argument("--sidecar", metavar="URL", help="a sidecar's base URL (default http://127.0.0.1:4318; "
                                                      "its last 10 minutes)")
    ap.add_argument("--from", dest="start", metavar="TIME", default=None,
                    help="start: 30m (ago), now-2h, Unix seconds or ISO 8601, UTC unless it says (default 30m)")
    ap.add_argument("--to", dest="end", metavar="TIME", default=None, help="end, as --from (default now)")
    ap.add_argument("--out", metavar="DIR", default=None,
                    help="folder to write into (default pdwatch-report-<UTC time> here)")
    ap.add_argument("--trace-url", metavar="TEMPLATE", default=os.environ.get("PDWATCH_TRACE_URL"),
                    help="link for each trace, {trace_id} replaced, e.g. https://jaeger.example/trace/{trace_id} "
                         "[env PDWATCH_TRACE_URL]")
    ap.add_argument("--cluster", help="only this cluster")
    ap.add_argument("--title", help="the report's title")
    ap.add_argument("--token", default=os.environ.get(c.ENV_TOKEN),
                    help=f"bearer token for the sidecar [env {c.ENV_TOKEN}]")
    ap.add_argument("--timeout-s", type=float, default=10.0)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        now = time.time()
        end = parse_time(args.end, now) if args.end else None
        start = parse_time(args.start, now) if args.start else None
        out = args.out or f"pdwatch-report-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
        page = write_report(out, prometheus=args.prometheus, sidecar=args.sidecar, start=start, end=end,
                            token=args.token, trace_url=args.trace_url, cluster=args.cluster, title=args.title,
                            timeout_s=args.timeout_s)
    except (RuntimeError, httpx.HTTPError) as exc:  # ReportError, PrometheusError
        print(f"pdwatch report: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"pdwatch report: {exc} (install pdwatch[report])", file=sys.stderr)
        return 2
    print(f"report written to {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
