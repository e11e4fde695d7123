"""An ordinary day of PD clusters, for at least --minutes: critical pages and stuck legs (goal 0 of each),
beside the same run's incidents, each of which must page.

One real sidecar, real Prometheus and Alertmanager (the repository's rules and
routes, see pdwatch/testbed/monitoring.py) and a second sidecar that no engine
reports to. Rounds run back to back until --minutes have passed: in each, every
ordinary-day scenario of the emulated testbed (scale-down, scale-up,
rolling-restart, kill-idle, overload, idle) runs as its own cluster, all at once,
beside the incidents decode-restart, freeze-decode and tp-desync (each stopped
once it paged, or at the round's end). A watch (pdwatch/testbed/day_watch.py)
reads every judge tick, about twice a second, and counts:

  stuck legs       distinct legs of an ordinary cluster /api/v1/stuck named, at any poll
  critical pages   alerts of an ordinary cluster the pager route received
  critical held    polls at which Prometheus held a critical alert of an ordinary cluster (pending or firing)
  quiet sidecar    polls at which Prometheus held any alert of the sidecar no engine reports to
  incidents        paged or not, and seconds from the fault to the page

The sidecar runs the integration tests' settings (floors, heartbeat, flow window;
see pdwatch/testbed/ordinary_day.py), flags below.

    python bench/ordinary_day.py [--minutes 30]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Any

from pdwatch import contract as c
from pdwatch.testbed import ordinary_day, scenarios
from pdwatch.testbed.day_watch import DayWatch, Poll
from pdwatch.testbed.monitoring import Monitoring
from pdwatch.testbed.sidecar_process import SidecarProcess

RESTART_AT, ORDINARY = ordinary_day.RESTART_AT, ordinary_day.PLAN
ROUND_LIMIT_S = 330.0
# incident -> the event that is its fault
INCIDENTS = {"decode-restart": "killed", "freeze-decode": "frozen", "tp-desync": "desync"}
PAGES = (c.ALERT_STUCK_WHILE_OTHERS_FLOW, c.ALERT_COLLECTIVE_DESYNC, c.ALERT_ENGINE_SILENT)


def queue_margin(mon: Monitoring, cluster: str, seconds: float) -> dict[str, float]:
    """Per role/stage: the highest ratio, over the last `seconds`, of the oldest leg's age in the stage to the
    stage's stuck threshold (1.0 would be stuck on the threshold path)."""
    by, where = f"{c.L_ROLE}, {c.L_STAGE}", f'{{{c.L_CLUSTER}="{cluster}"}}'
    expr = (f"max by ({by}) (max_over_time((max by ({by}) ({c.OLDEST_AGE.name}{where}) / on ({by}) "
            f"max by ({by}) ({c.THRESHOLD.name}{where}))[{int(seconds)}s:2s]))")
    return {f"{r['metric'][c.L_ROLE]}/{r['metric'][c.L_STAGE]}": round(float(r["value"][1]), 2)
            for r in mon.query(expr)}


def one_round(args: argparse.Namespace, n: int, sc: SidecarProcess, watch: DayWatch) -> dict[str, Any]:
    from pdwatch.testbed.stack import Stack

    stacks: dict[str, Any] = {}
    faults: dict[str, float] = {}
    paged: dict[str, float] = {}
    done: set[str] = set()
    ordinary = {f"{name}-r{n}": name for name in ORDINARY}
    incidents = {f"{name}-r{n}": name for name in INCIDENTS}
    t0 = time.time()
    try:
        for i, (cluster, name) in enumerate([*ordinary.items(), *incidents.items()]):
            rate, duration_s, tuning = ORDINARY.get(name, (2.0, 120.0, {}))
            stack = Stack(name, otlp_endpoint=sc.url, heartbeat_s=args.heartbeat_s, rate=rate, restart_at=RESTART_AT,
                          cluster=cluster, decode_floor_s=args.floor_decode_s, duration_s=duration_s,
                          seed=100 * n + i + 1, tuning=tuning)
            stack.start()
            stacks[cluster] = stack
            watch.watch(cluster, stack)
        deadline = time.monotonic() + ROUND_LIMIT_S
        while time.monotonic() < deadline and len(done) < len(stacks):
            poll = watch.latest()
            for cluster, stack in stacks.items():
                for e in stack.poll_events():
                    if cluster in incidents and e["event"] == INCIDENTS[incidents[cluster]]:
                        faults.setdefault(cluster, e["t"])
                if cluster in done:
                    continue
                if cluster in incidents:
                    pages = [a for a in poll.pages_in(cluster) if a["labels"]["alertname"] in PAGES] if poll else []
                    if pages:
                        paged[cluster] = time.time()
                        done.add(cluster)
                        stack.stop()  # paged: its hung requests need no more CPU
                elif stack.load_done and not stack.truth().open and (
                        ordinary[cluster] != "kill-idle" or (poll and poll.alerts_named(
                            c.ALERT_ENGINE_SILENT, cluster, "warning"))):
                    done.add(cluster)
            time.sleep(0.5)
        # One more judge tick after the round, so the record covers its end.
        watch.wait_for(lambda p: True, 10.0)
        margin = queue_margin(watch.monitoring, f"overload-r{n}", time.time() - t0 + 10)
    finally:
        for stack in stacks.values():
            stack.stop()
    truths = {cluster: stacks[cluster].truth() for cluster in ordinary}
    return {"round": n, "seconds": time.time() - t0, "ordinary": ordinary, "incidents": incidents, "faults": faults,
            "paged": paged, "unfinished": sorted(set(ordinary) - done), "margin": margin,
            "not_ok": {k: sum(r.outcome != "ok" for r in t.requests) for k, t in truths.items()},
            "requests": sum(len(t.requests) for t in truths.values())}


def tally(polls: list[Poll], ordinary: set[str]) -> dict[str, Any]:
    first: dict[tuple[str, str, str], tuple[Any, ...]] = {}  # each stuck leg as first seen
    for p in polls:
        for s in p.stuck:
            key = (s["cluster"], s["trace_id"], s["role"])
            if s["cluster"] in ordinary and key not in first:
                first[key] = (round(p.t - polls[0].t, 1), s["cluster"], s["role"], s["stage"], s["reason"],
                              s["stage_age_s"], s["threshold_s"], f"load {p.load:.1f}")
    stuck = sorted(first.values(), key=str)
    pages = {(a["labels"].get("alertname"), a["labels"].get("pd_cluster"), a.get("startsAt")) for p in polls[-1:]
             for a in p.pages if a["labels"].get("pd_cluster") in ordinary}
    held = [(round(p.t - polls[0].t, 1), a.get("alertname"), a.get("pd_cluster"), a.get("pd_instance"), a.get("stage"),
             a.get("alertstate"), f"load {p.load:.1f}") for p in polls for a in p.critical
            if a.get("pd_cluster") in ordinary]
    warnings = sorted({(a.get("alertname"), a.get("pd_cluster")) for p in polls for a in p.alerts
                       if a.get("pd_cluster") in ordinary and a.get("severity") == "warning"
                       and a.get("alertstate") == "firing"})
    quiet = sum(1 for p in polls if p.quiet_alerts)
    return {"stuck": stuck, "pages": sorted(pages, key=str), "held": held, "warnings": warnings,
            "quiet": quiet}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="start rounds until this many minutes have passed")
    ap.add_argument("--heartbeat-s", type=float, default=ordinary_day.HEARTBEAT_S)
    ap.add_argument("--floor-transfer-s", type=float, default=ordinary_day.FLOOR_TRANSFER_S)
    ap.add_argument("--floor-decode-s", type=float, default=ordinary_day.FLOOR_DECODE_S)
    ap.add_argument("--flow-window-s", type=float, default=ordinary_day.FLOW_WINDOW_S)
    args = ap.parse_args()
    logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)
    for name in [*ORDINARY, *INCIDENTS]:
        scenarios.get(name)  # an unknown name fails before anything starts
    env = {c.floor_env("transfer"): str(args.floor_transfer_s), c.floor_env("decode"): str(args.floor_decode_s),
           c.ENV_FLOW_WINDOW: str(args.flow_window_s), c.ENV_LOG_LEVEL: "warning", c.ENV_NVML: "off",
           c.ENV_EVALUATE_INTERVAL: "0.25"}
    t0 = time.monotonic()
    rounds: list[dict[str, Any]] = []
    max_rounds = int(args.minutes * 60 // 60) + 1  # a round takes about four minutes: a bound, never reached
    with SidecarProcess(env=env) as sc, SidecarProcess(env=env) as quiet, Monitoring([sc.url, quiet.url]) as mon:
        watch = DayWatch(sc, mon, quiet=[quiet.url]).start()
        try:
            while time.monotonic() - t0 < args.minutes * 60 and len(rounds) < max_rounds:
                r = one_round(args, len(rounds) + 1, sc, watch)
                rounds.append(r)
                print(f"round {r['round']}: {r['seconds']:.0f} s, {r['requests']} ordinary requests "
                      f"(not ok: {sum(r['not_ok'].values())}), incidents paged "
                      f"{len(r['paged'])}/{len(r['incidents'])}, unfinished {r['unfinished'] or 'none'}; overload's "
                      f"peak oldest age / threshold by stage {r['margin']}", flush=True)
        finally:
            watch.stop()
    polls = watch.snapshot()
    ordinary = {cl for r in rounds for cl in r["ordinary"]}
    t = tally(polls, ordinary)
    minutes = (time.monotonic() - t0) / 60
    delays = {name: [r["paged"][cl] - r["faults"][cl] for r in rounds for cl, n in r["incidents"].items()
                     if n == name and cl in r["paged"] and cl in r["faults"]] for name in INCIDENTS}
    print(f"ordinary day: {minutes:.1f} min, {len(rounds)} round(s) of {len(ORDINARY)} scenarios, {len(polls)} polls "
          f"({len(watch.errors)} failed), {sum(r['requests'] for r in rounds)} requests, "
          f"{sum(sum(r['not_ok'].values()) for r in rounds)} not ok")
    print(f"  critical pages: {len(t['pages'])} (goal 0) {t['pages'][:5] or ''}")
    print(f"  stuck legs:     {len(t['stuck'])} (goal 0) {t['stuck'][:5] or ''}")
    print(f"  critical alerts of an ordinary cluster held (pending or firing), by poll: {len(t['held'])} "
          f"{t['held'][:5] or ''}")
    print(f"  polls holding an alert of the sidecar no engine reports to: {t['quiet']}")
    print(f"  warnings that fired (ordinary clusters): {sorted({name for name, _ in t['warnings']}) or 'none'}")
    for name in INCIDENTS:
        runs = [cl for r in rounds for cl, n in r["incidents"].items() if n == name]
        got = delays[name]
        median = f", fault -> page median {statistics.median(got):.1f} s" if got else ""
        print(f"  incident {name}: paged {sum(cl in r['paged'] for r in rounds for cl in runs)}/{len(runs)}{median}")
    met = not t["pages"] and not t["stuck"] and all(len(r["paged"]) == len(r["incidents"]) for r in rounds)
    print(f"goal (0 critical pages, 0 stuck legs, every incident paged): {'met' if met else 'NOT met'}")


if __name__ == "__main__":
    main()
