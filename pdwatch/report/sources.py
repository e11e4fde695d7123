"""An `Incident` read from Prometheus over a range (range queries), or from one sidecar's recent history.

Either way the diagnosis is the classifier's own verdict, as it said it: a
sidecar's `/api/v1/diagnosis`, or the classifier reasoning over the same
Prometheus at the worst moment (instant queries at that time).
"""

from __future__ import annotations

import math
import time
from typing import Any

import httpx

from pdwatch import contract as c
from pdwatch.client import SidecarClient
from pdwatch.settings import ClientSettings
from pdwatch.sidecar.diagnosis.classify import verdict
from pdwatch.sidecar.diagnosis.facts import REPORT_AT
from pdwatch.sidecar.diagnosis.from_prometheus import api_result, gather

from .model import EMPTY, Alert, Diagnosis, Gpu, Incident, Instance, ReportError, Series
from .times import utc

DEFAULT_RANGE_S = 30 * 60
HISTORY_MAX_S = 600  # what a sidecar keeps (sidecar/history.py)
MAX_POINTS = 720  # per series: a step for a 30-minute range of 2.5 s
OLDEST_TOP = 20  # the oldest stuck legs a sidecar exposes, and the report lists
SAID_BY_SIDECAR = "the sidecar"
SAID_BY_PROMETHEUS = "the classifier, over Prometheus"

# ---- from Prometheus ---------------------------------------------------------------------------

Rows = list[tuple[dict[str, str], Series]]


def _range_query(client: httpx.Client, expr: str, start: float, end: float, step: float) -> Rows:
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


def from_prometheus(settings: ClientSettings, start: float, end: float, *, cluster: str | None = None) -> Incident:
    url = settings.prometheus
    if url is None:
        raise ReportError("no Prometheus to read from")
    step = _step(start, end)
    # A rate needs two scrapes inside its window; 30 s covers a 15 s scrape interval.
    window = f"{int(max(4 * step, 30))}s"
    inc = Incident(f"Prometheus {url}", start, end)
    sel = f'{c.L_CLUSTER}="{cluster}"' if cluster else ""
    by_inst = c.INSTANCE_UP.by(*c.INSTANCE_KEY)
    with httpx.Client(base_url=url, timeout=settings.timeout_s, headers=settings.prometheus_headers) as client:
        def q(expr: str) -> Rows:
            return _range_query(client, expr, start, end, step)

        instances: dict[tuple[str, str], Instance] = {}

        def inst(m: dict[str, str]) -> Instance:
            key = (m.get(c.L_CLUSTER, ""), m.get(c.L_INSTANCE, ""))
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
        for m, s in q(f"max by ({by_inst}) ({c.LOOP_FROZEN.name}{{{sel}}})"):
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
                key = (m.get(c.L_CLUSTER, ""), m.get(c.L_INSTANCE, ""), m.get(c.L_GPU, ""), m.get(c.L_UUID, ""))
                g = gpus.setdefault(key, {"m": m})
                g[field_name] = s
        for (_cl, _name, gpu, uuid), g in sorted(gpus.items()):
            limits = [v for v in (g.get("power_limit_w") or EMPTY).v if v]
            inst(g["m"]).gpus.append(Gpu(gpu, uuid, g.get("utilization", EMPTY), g.get("power_w", EMPTY),
                                         max(limits) if limits else None))
        inc.instances = sorted(instances.values(), key=Instance.sort_key)
        _trim(inc)

        alerts = []
        for m, s in q('ALERTS{alertstate="firing"}'):
            labels = {k: v for k, v in m.items() if k not in ("__name__", "alertstate")}
            if cluster and labels.get(c.L_CLUSTER) not in (None, cluster):
                continue
            alerts.append(Alert(labels.pop("alertname", "?"), labels, _intervals(s, step)))
        inc.alerts = sorted(alerts, key=lambda a: (a.firing[0][0] if a.firing else 0, a.name))

        # The oldest stuck legs: the sidecars expose their 20 oldest; over the range, the oldest of all seen.
        oldest: dict[tuple[str, str], dict[str, Any]] = {}
        for m, s in q(f"max by ({c.STUCK_INFO.by(*c.STUCK_INFO.labels)}) ({c.STUCK_INFO.name}{{{sel}}})"):
            vals = [(t, v) for t, v in zip(s.t, s.v) if v is not None]
            if not vals:
                continue
            leg = (m.get("trace_id", ""), m.get("role", ""))
            age = max(v for _, v in vals if v is not None)
            if leg not in oldest or age > oldest[leg]["stage_age_s"]:
                oldest[leg] = {"trace_id": leg[0], "role": leg[1], "rid": m.get("rid", ""),
                               "stage": m.get("stage", ""), "pd_instance": m.get("pd_instance", ""),
                               "cluster": m.get(c.L_CLUSTER, ""), "reason": m.get(c.L_REASON, ""),
                               "stage_age_s": age, "last_seen_unix_s": vals[-1][0]}
        inc.oldest = sorted(oldest.values(), key=lambda x: -x["stage_age_s"])[:OLDEST_TOP]

        inc.mark_worst()
        at = inc.worst_at if inc.worst_at is not None else end
        # What the sidecars published then: a check on the classifier's verdict over Prometheus below.
        published: dict[str, list[tuple[str, float]]] = {}
        for m, s in q(f"max by ({c.DIAGNOSIS_CONFIDENCE.by(c.L_CLUSTER, c.L_FAMILY)}) ({c.DIAGNOSIS_CONFIDENCE.name}{{{sel}}})"):
            value = s.at(at)
            if value is not None and value >= REPORT_AT:
                published.setdefault(m.get(c.L_CLUSTER, ""), []).append((m.get(c.L_FAMILY, ""), value))
    inc.diagnosis = _diagnosis_at(settings, at, cluster, {k: sorted(v, key=lambda x: -x[1])
                                                          for k, v in published.items()}, inc.notes)
    if not inc.instances:
        inc.notes.append("Prometheus has no pdwatch series in this range (is it scraping the sidecars?)")
    return inc


def _diagnosis_at(settings: ClientSettings, at: float, cluster: str | None,
                  published: dict[str, list[tuple[str, float]]], notes: list[str]) -> list[Diagnosis]:
    """The classifier's verdict per cluster over the facts Prometheus held at `at`, with its own sentences."""
    assert settings.prometheus is not None
    try:
        facts = gather(settings.prometheus, timeout_s=settings.timeout_s, headers=settings.prometheus_headers, at=at)
    except RuntimeError as exc:  # PrometheusError: the series above still make a report
        notes.append(f"the classifier could not read Prometheus at {utc(at)}: {exc}")
        return [Diagnosis(cl, at, "the sidecars' published confidence (no sentences: the classifier could not run)",
                          found[0][0], found[0][1], [], None, [], found) for cl, found in sorted(published.items())
                if not cluster or cl == cluster]
    return [Diagnosis.from_verdict(verdict(f), at, SAID_BY_PROMETHEUS, published.get(f.cluster, []))
            for f in sorted(facts, key=lambda f: f.cluster) if not cluster or f.cluster == cluster]


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


# ---- from a sidecar ----------------------------------------------------------------------------

def from_sidecar(settings: ClientSettings, start: float | None, end: float | None, *,
                 cluster: str | None = None) -> Incident:
    with SidecarClient(settings) as sidecar:
        summary = sidecar.get("/api/v1/summary")
        # The sidecar's clock, not this machine's, says what "now" is in its history.
        now = float(summary.get("at_unix_s") or time.time())
        end = now if end is None else min(end, now)
        start = max(end - DEFAULT_RANGE_S, now - HISTORY_MAX_S) if start is None else start
        if start < now - HISTORY_MAX_S:
            start = now - HISTORY_MAX_S
        if end <= start:
            raise ReportError(f"the sidecar keeps only its last {HISTORY_MAX_S} s; the range asked ends before that")
        history = sidecar.get("/api/v1/history", seconds=max(1.0, now - start))
        stuck = sidecar.get(c.PATH_STUCK)
        verdicts = sidecar.get(c.PATH_DIAGNOSIS)
    inc = Incident(f"sidecar {settings.sidecar}", start, end, alerts=None, stuck_by_stage_known=False)
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
        # Per second between samples; a counter that went back (a restart) gives no rate.
        rate: list[float | None] = [None]
        rate += [(b - a) / (t2 - t1) if b >= a and t2 > t1 else None for a, b, t1, t2 in zip(ok, ok[1:], t, t[1:])]
        inc.instances.append(Instance(
            h["cluster"], h["pd_instance"], h["role"],
            open={stage: col(v) for stage, v in h["open"].items()},
            stuck={"": col(h["stuck"])}, ok_rate=Series(t, rate), up=col(h["up"]), frozen=col(h["loop_frozen"]),
            gpus=[Gpu(g["gpu"], g["uuid"], col(g["utilization"]), col(g["power_w"]), g.get("power_limit_w"))
                  for g in h["gpus"]],
            restarts=[r for r in restarts.get((h["cluster"], h["pd_instance"]), []) if start <= r <= end]))
    inc.instances.sort(key=Instance.sort_key)
    _trim(inc)
    inc.oldest = [s for s in stuck if not cluster or s["cluster"] == cluster][:OLDEST_TOP]
    inc.mark_worst()
    # The sidecar keeps no past verdicts: its diagnosis now is the one there is.
    inc.diagnosis = [Diagnosis.from_verdict(v, now, SAID_BY_SIDECAR) for v in verdicts
                     if not cluster or v["cluster"] == cluster]
    inc.notes.append("from a sidecar: stuck legs are counted per instance, not per stage; no alert state "
                     "(Prometheus keeps it: use --prometheus); the oldest stuck legs and the diagnosis "
                     f"are as of {utc(now)}")
    if not inc.instances:
        inc.notes.append("the sidecar has no history in this range")
    return inc
