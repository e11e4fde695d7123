"""Facts from a Prometheus server that scrapes every sidecar (a whole cluster's view).

Only instant queries over the metrics of contract section 6 (and the
sidecar's documented additions), so any Prometheus, Thanos or Mimir front end
that speaks the HTTP query API can serve them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx

from pdwatch import contract as c

from .facts import ClusterFacts, GpuFacts, InstanceFacts

FLOW_WINDOW_S = c.DEFAULT_FLOW_WINDOW_S
# An instant query's answer: each series' labels and value.
Rows = list[tuple[dict[str, str], float]]


class PrometheusError(RuntimeError):
    pass


def api_result(client: httpx.Client, path: str, params: dict[str, str]) -> list[dict[str, Any]]:
    """`data.result` of one Prometheus HTTP API query (instant or range); PrometheusError says what failed."""
    try:
        r = client.get(path, params=params)
    except httpx.HTTPError as exc:
        raise PrometheusError(f"cannot reach Prometheus at {client.base_url}: {exc}") from None
    try:
        body = r.json()
    except ValueError:
        raise PrometheusError(f"Prometheus answered {r.status_code} with a non-JSON body") from None
    if r.status_code != 200 or body.get("status") != "success":
        raise PrometheusError(f"query {params.get('query')!r} failed: {body.get('error') or r.status_code}")
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def _query(client: httpx.Client, expr: str, at: float | None = None) -> Rows:
    params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
    return [(item["metric"], float(item["value"][1])) for item in api_result(client, "/api/v1/query", params)]


def _label(m: dict[str, str], name: str) -> str:
    # Prometheus leaves out a label whose value is empty; the name itself is a contract constant.
    return m.get(name, "")


def _agg(op: str, metric: c.Metric, *labels: str, select: str = "") -> str:
    """`op by (labels) (metric)`; a label the metric does not carry raises (Metric.by), so a wrong name
    fails here instead of every row reading the label as empty."""
    return f"{op} by ({metric.by(*labels)}) ({metric.series}{select})"


PER_INSTANCE = (c.L_CLUSTER, c.L_INSTANCE)
PER_STAGE = (c.L_CLUSTER, c.L_ROLE, c.L_STAGE)


def gather(url: str, *, timeout_s: float = 10.0, headers: dict[str, str] | None = None,
           window_s: float = FLOW_WINDOW_S, at: float | None = None) -> list[ClusterFacts]:
    """Every cluster's facts now, or as Prometheus saw them at `at` (Unix seconds)."""
    with httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s, headers=headers) as client:
        q: Callable[[str], Rows] = lambda expr: _query(client, expr, at)  # noqa: E731
        window = f"{int(window_s)}s"
        inst_key: Callable[[dict[str, str]], tuple[str, str]] = lambda m: (_label(m, c.L_CLUSTER), _label(m, c.L_INSTANCE))  # noqa: E731
        instances: dict[tuple[str, str], InstanceFacts] = {}
        clusters: dict[str, ClusterFacts] = {}

        def cluster(name: str) -> ClusterFacts:
            if name not in clusters:
                clusters[name] = ClusterFacts(name, float(window_s), 0, 0)
            return clusters[name]

        for m, v in q(_agg("max", c.INSTANCE_UP, *c.INSTANCE_KEY)):
            instances[inst_key(m)] = InstanceFacts(
                pd_instance=_label(m, c.L_INSTANCE), role=_label(m, c.L_ROLE), up=v >= 1, heartbeat_age_s=None,
                loop_stalled=False, start_time_s=None, restarts=0, last_restart_age_s=None,
                finished_ok_recent=0, open_legs=0,
            )
            cluster(_label(m, c.L_CLUSTER))

        def each(expr: str) -> Iterator[tuple[dict[str, str], float, InstanceFacts]]:
            for m, v in q(expr):
                inst = instances.get(inst_key(m))
                if inst is not None:
                    yield m, v, inst

        departed = f'{{{c.L_STATE}="{c.STATE_DEPARTED}"}}'
        for _m, v, inst in each(f"max by ({c.INSTANCE_STATE.by(*PER_INSTANCE)}) ({c.INSTANCE_STATE.series}{departed})"):
            inst.departed = v >= 1

        for _m, v, inst in each(_agg("max", c.HEARTBEAT_AGE, *PER_INSTANCE)):
            inst.heartbeat_age_s = v
        for _m, v, inst in each(_agg("max", c.LOOP_STALLED, *PER_INSTANCE)):
            inst.loop_stalled = v >= 1
        for _m, v, inst in each(_agg("max", c.INSTANCE_START, *PER_INSTANCE)):
            inst.start_time_s = v
        for _m, v, inst in each(_agg("max", c.INSTANCE_RESTARTS, *PER_INSTANCE)):
            inst.restarts = int(v)
        # The current process started at the latest restart.
        start = c.INSTANCE_START
        for _m, v, inst in each(f"max by ({start.by(*PER_INSTANCE)}) (time() - {start.series})"):
            inst.last_restart_age_s = v if inst.restarts else None
        ok = f'{{{c.L_OUTCOME}="ok"}}[{window}]'
        for _m, v, inst in each(f"sum by ({c.FINISHED.by(*PER_INSTANCE)}) (increase({c.FINISHED.series}{ok}))"):
            inst.finished_ok_recent = int(round(v))
        for _m, v, inst in each(_agg("sum", c.INFLIGHT, *PER_INSTANCE)):
            inst.open_legs = int(v)
        for m, v, inst in each(_agg("sum", c.STUCK, *c.LEG_GROUP) + " > 0"):
            inst.stuck[_label(m, c.L_STAGE)] = int(v)
        # Contract section 5b: the frozen loops and the legs stuck on evidence.
        for _m, v, inst in each(_agg("max", c.LOOP_FROZEN, *PER_INSTANCE)):
            inst.loop_frozen = v >= 1
        for _m, v, inst in each(_agg("max", c.KV_USED, *PER_INSTANCE)):
            inst.kv_used = v
        for m, v, inst in each(_agg("sum", c.STUCK_EVIDENCE, *c.LEG_GROUP, c.L_REASON) + " > 0"):
            reason = _label(m, c.L_REASON)
            inst.evidence[reason] = inst.evidence.get(reason, 0) + int(v)
            cf = cluster(_label(m, c.L_CLUSTER))
            key = (_label(m, c.L_ROLE), _label(m, c.L_STAGE), reason)
            cf.evidence[key] = cf.evidence.get(key, 0) + int(v)
        for m, v in q(f"{_agg('max', c.OLDEST_AGE, *PER_STAGE)} and on ({c.STUCK.by(*PER_STAGE)}) "
                      f"{_agg('sum', c.STUCK, *PER_STAGE)} > 0"):
            cluster(_label(m, c.L_CLUSTER)).oldest_stuck_age_s[(_label(m, c.L_ROLE), _label(m, c.L_STAGE))] = v
        for m, v in q(_agg("max", c.THRESHOLD, *PER_STAGE)):
            cluster(_label(m, c.L_CLUSTER)).thresholds_s[(_label(m, c.L_ROLE), _label(m, c.L_STAGE))] = v
        gpus: dict[tuple[str, str, str], GpuFacts] = {}
        for metric, field in ((c.GPU_UTILIZATION, "utilization"), (c.GPU_POWER, "power_w"),
                              (c.GPU_POWER_LIMIT, "power_limit_w")):
            for m, v in q(f'{metric.series}{{{c.L_INSTANCE}!=""}}'):
                gpu, uuid = _label(m, c.L_GPU), _label(m, c.L_UUID)
                key = (_label(m, c.L_CLUSTER), _label(m, c.L_INSTANCE), uuid or gpu)
                g = gpus.setdefault(key, GpuFacts(gpu, uuid, None, None, None))
                setattr(g, field, v)
        for (cl, name, _u), g in sorted(gpus.items()):
            holder = instances.get((cl, name))
            if holder is not None:
                holder.gpus.append(g)
        # The telemetry gauge has no labels of its own: `cluster` is a target label where the scrape sets one.
        up = q(f"max by ({c.L_CLUSTER}) ({c.GPU_TELEMETRY_UP.series})")
        telemetry = {_label(m, c.L_CLUSTER): v for m, v in up}
        any_up = any(v >= 1 for v in telemetry.values())
        for (cl, _name), inst in sorted(instances.items()):
            cf = cluster(cl)
            cf.instances.append(inst)
            cf.finished_ok_recent += inst.finished_ok_recent
            cf.open_legs += inst.open_legs
            for stage, n in inst.stuck.items():
                cf.stuck[(inst.role, stage)] = cf.stuck.get((inst.role, stage), 0) + n
            cf.gpu_telemetry_up = any_up
        return list(clusters.values())


def contrasts(url: str, *, timeout_s: float = 10.0,
              headers: dict[str, str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Per cluster, what the sidecars say sets its stuck legs apart (the contrast gauge), best first."""
    with httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s, headers=headers) as client:
        rows = _query(client, _agg("max", c.STUCK_CONTRAST, *c.STUCK_CONTRAST.labels))
    items: dict[tuple[str, str, str], dict[str, Any]] = {}
    for m, v in rows:
        key = (_label(m, c.L_CLUSTER), _label(m, c.L_ATTRIBUTE), _label(m, c.L_VALUE))
        item = items.setdefault(key, {"attribute": key[1], "value": key[2], "stuck": 0.0, "flowing": 0.0})
        legs = _label(m, c.L_LEGS)
        if legs in ("stuck", "flowing"):
            item[legs] = v
    out: dict[str, list[dict[str, Any]]] = {}
    for (cluster, _a, _v), item in items.items():
        item["separation"] = round(item["stuck"] - item["flowing"], 3)
        out.setdefault(cluster, []).append(item)
    for listed in out.values():
        listed.sort(key=lambda x: -x["separation"])
    return out

