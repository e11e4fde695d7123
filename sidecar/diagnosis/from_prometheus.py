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


def gather(url: str, *, timeout_s: float = 10.0, headers: dict[str, str] | None = None,
           window_s: float = FLOW_WINDOW_S, at: float | None = None) -> list[ClusterFacts]:
    """Every cluster's facts now, or as Prometheus saw them at `at` (Unix seconds)."""
    with httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s, headers=headers) as client:
        q: Callable[[str], Rows] = lambda expr: _query(client, expr, at)  # noqa: E731
        window = f"{int(window_s)}s"
        inst_key: Callable[[dict[str, str]], tuple[str, str]] = lambda m: (m.get("cluster", ""), m.get("pd_instance", ""))  # noqa: E731
        instances: dict[tuple[str, str], InstanceFacts] = {}
        clusters: dict[str, ClusterFacts] = {}

        def cluster(name: str) -> ClusterFacts:
            if name not in clusters:
                clusters[name] = ClusterFacts(name, float(window_s), 0, 0)
            return clusters[name]

        for m, v in q("max by (cluster, role, pd_instance) (pdwatch_instance_up)"):
            instances[inst_key(m)] = InstanceFacts(
                pd_instance=m.get("pd_instance", ""), role=m.get("role", ""), up=v >= 1, heartbeat_age_s=None,
                loop_stalled=False, start_time_s=None, restarts=0, last_restart_age_s=None,
                finished_ok_recent=0, open_legs=0,
            )
            cluster(m.get("cluster", ""))

        def each(expr: str) -> Iterator[tuple[dict[str, str], float, InstanceFacts]]:
            for m, v in q(expr):
                inst = instances.get(inst_key(m))
                if inst is not None:
                    yield m, v, inst

        for _m, v, inst in each("max by (cluster, pd_instance) (pdwatch_instance_heartbeat_age_seconds)"):
            inst.heartbeat_age_s = v
        for _m, v, inst in each("max by (cluster, pd_instance) (pdwatch_engine_loop_stalled)"):
            inst.loop_stalled = v >= 1
        for _m, v, inst in each("max by (cluster, pd_instance) (pdwatch_instance_start_time_seconds)"):
            inst.start_time_s = v
        for _m, v, inst in each("max by (cluster, pd_instance) (pdwatch_instance_restarts_total)"):
            inst.restarts = int(v)
        # The current process started at the latest restart.
        for _m, v, inst in each("max by (cluster, pd_instance) (time() - pdwatch_instance_start_time_seconds)"):
            inst.last_restart_age_s = v if inst.restarts else None
        for _m, v, inst in each("sum by (cluster, pd_instance) (increase(pdwatch_requests_finished_total"
                                f"{{outcome=\"ok\"}}[{window}]))"):
            inst.finished_ok_recent = int(round(v))
        for _m, v, inst in each("sum by (cluster, pd_instance) (pdwatch_inflight_requests)"):
            inst.open_legs = int(v)
        for m, v, inst in each("sum by (cluster, role, stage, pd_instance) (pdwatch_stuck_requests) > 0"):
            inst.stuck[m.get("stage", "")] = int(v)
        # Contract section 5b: the frozen loops and the legs stuck on evidence.
        for _m, v, inst in each("max by (cluster, pd_instance) (pdwatch_engine_loop_frozen)"):
            inst.loop_frozen = v >= 1
        evidence = "sum by (cluster, role, stage, pd_instance, reason) (pdwatch_stuck_evidence_requests) > 0"
        for m, v, inst in each(evidence):
            reason = m.get("reason", "")
            inst.evidence[reason] = inst.evidence.get(reason, 0) + int(v)
            cf = cluster(m.get("cluster", ""))
            key = (m.get("role", ""), m.get("stage", ""), reason)
            cf.evidence[key] = cf.evidence.get(key, 0) + int(v)
        for m, v in q("max by (cluster, role, stage) (pdwatch_oldest_stage_age_seconds) and on (cluster, role, stage) "
                      "sum by (cluster, role, stage) (pdwatch_stuck_requests) > 0"):
            cluster(m.get("cluster", "")).oldest_stuck_age_s[(m.get("role", ""), m.get("stage", ""))] = v
        for m, v in q("max by (cluster, role, stage) (pdwatch_stuck_threshold_seconds)"):
            cluster(m.get("cluster", "")).thresholds_s[(m.get("role", ""), m.get("stage", ""))] = v
        gpus: dict[tuple[str, str, str], GpuFacts] = {}
        for name, field in (("pdwatch_gpu_utilization_ratio", "utilization"), ("pdwatch_gpu_power_watts", "power_w"),
                            ("pdwatch_gpu_power_limit_watts", "power_limit_w")):
            for m, v in q(f'{name}{{pd_instance!=""}}'):
                key = (m.get("cluster", ""), m.get("pd_instance", ""), m.get("uuid", "") or m.get("gpu", ""))
                g = gpus.setdefault(key, GpuFacts(m.get("gpu", ""), m.get("uuid", ""), None, None, None))
                setattr(g, field, v)
        for (cl, name, _u), g in sorted(gpus.items()):
            holder = instances.get((cl, name))
            if holder is not None:
                holder.gpus.append(g)
        telemetry = {m.get("cluster", ""): v for m, v in q("max by (cluster) (pdwatch_gpu_telemetry_up)")}
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
    """Per cluster, what the sidecars say sets its stuck legs apart (pdwatch_stuck_contrast_ratio), best first."""
    with httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s, headers=headers) as client:
        rows = _query(client, "max by (cluster, attribute, value, legs) (pdwatch_stuck_contrast_ratio)")
    items: dict[tuple[str, str, str], dict[str, Any]] = {}
    for m, v in rows:
        key = (m.get("cluster", ""), m.get("attribute", ""), m.get("value", ""))
        item = items.setdefault(key, {"attribute": key[1], "value": key[2], "stuck": 0.0, "flowing": 0.0})
        if m.get("legs") in ("stuck", "flowing"):
            item[m["legs"]] = v
    out: dict[str, list[dict[str, Any]]] = {}
    for (cluster, _a, _v), item in items.items():
        item["separation"] = round(item["stuck"] - item["flowing"], 3)
        out.setdefault(cluster, []).append(item)
    for listed in out.values():
        listed.sort(key=lambda x: -x["separation"])
    return out

