"""Time to page, both paths of PDRequestStuckWhileOthersFlow, in one run.

Each run starts a real sidecar, real Prometheus and Alertmanager (the
repository's rules and routes, see pdwatch/testbed/monitoring.py; 2 s scrapes)
and an emulated testbed incident, and records when the sidecar first names a
stuck leg and when the page reaches the webhook:

  threshold   long-prompt-wedge: KV writes of long prompts are never posted,
              with no error and every peer alive, so nothing proves they are
              doomed: found past the transfer floor, paged after the rule's
              minute. Judged from the first hung leg's entry into transfer;
              goal (the design's budget in the same run's settings): floor +
              one minute + two scrape intervals.
  evidence    decode-restart (the seed incident: the prefill keeps writing to
              the restarted decode's old agent, peer_gone / engine_error) and
              tp-desync (a rank's loop frozen while it heartbeats,
              loop_frozen). Judged from the fault; goal: named within one
              heartbeat interval + 1 s of the evidence being complete, paged
              within 20 s.
  idle loop   tp-desync-idle: the rank hangs while its instance holds no
              request, so no leg of it is ever open and none is stuck on
              evidence; the frozen loop itself pages, as
              PDCollectiveDesyncSuspected. Judged from the fault; goal: paged
              within 20 s ("named" is the prefill's first threshold-stuck leg).

A page is the first of PDRequestStuckWhileOthersFlow and
PDCollectiveDesyncSuspected (both critical) to reach the webhook.

The threshold path is the baseline the evidence path is compared with.

With --live, the incident is the live SGLang pair's `transfer-wedge` (real
`sglang.launch_server` prefill and decodes on this CPU, NIXL writes to
decode-0 that never complete; about a minute to start each stack), run
twice: with the overtaken rule switched off (M of a billion: the threshold
path, the baseline) and with its defaults (K, M as the settings
say). Judged from the wedge; goal: paged within 20 s, and the first stuck leg
named on `overtaken` within one heartbeat interval + 2 s of the moment its
evidence was complete (K later legs at least as big through transfer, and
the wait past the rule), computed from the legs' own stages as the sidecar
holds them.

    python bench/time_to_page.py [--runs 2] [--floor-transfer-s 15]
    python bench/time_to_page.py --live [--runs 1]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

from pdwatch import contract as c
from pdwatch.alerts.generate import HEADLINE_FOR, HOLD
from pdwatch.testbed.monitoring import Monitoring
from pdwatch.testbed.sidecar_process import SidecarProcess

HEADLINE = c.ALERT_STUCK_WHILE_OTHERS_FLOW
PAGES = (HEADLINE, c.ALERT_COLLECTIVE_DESYNC)
FAULTS = {"decode-restart": "killed", "tp-desync": "desync", "tp-desync-idle": "desync"}
EVIDENCE_GOAL_S = 20.0


def seconds(text: str) -> float:
    return float(text[:-1]) * {"s": 1, "m": 60, "h": 3600}[text[-1]]


def one_run(args, scenario: str, seed: int) -> dict:
    from pdwatch.testbed import scenarios
    from pdwatch.testbed.stack import Stack

    env = {c.floor_env("transfer"): str(args.floor_transfer_s), c.ENV_LOG_LEVEL: "warning", c.ENV_NVML: "off"}
    with SidecarProcess(env=env) as sc, Monitoring([sc.url], scrape_interval_s=args.scrape_s) as mon:
        rate = args.rate if args.rate is not None else scenarios.get(scenario).rate or 3.0
        stack = Stack(scenario, otlp_endpoint=sc.url, heartbeat_s=args.heartbeat_s, rate=rate,
                      restart_at=5.0, seed=seed)
        out: dict = {"fault": None, "hang": None, "named": None, "reason": None, "paged": None,
                     "alert": None, "scrape_s": mon.scrape_s}
        try:
            stack.start()
            out["started"] = time.time()
            deadline = time.time() + args.timeout_s
            while time.time() < deadline:
                for e in stack.poll_events():
                    if e["event"] == FAULTS.get(scenario) and out["fault"] is None:
                        out["fault"] = e["t"]
                if out["named"] is None:
                    stuck = sc.get("/api/v1/stuck")
                    if stuck:
                        out["named"] = time.time()
                        out["hang"] = min(s["stage_since_unix_s"] for s in stuck)
                        out["reason"] = sorted({s["reason"] for s in stuck})
                pages = sorted((p[0], name) for name in PAGES for p in mon.webhook.alerts(name))
                if pages:
                    out["paged"], out["alert"] = pages[0]
                    return out
                time.sleep(0.25)
            return out
        finally:
            stack.stop()


# ---- the live SGLang pair ----------------------------------------------------------------------------

# The rule switched off: a leg would have to wait a billion times its overtakers' passages.
OVERTAKEN_OFF_M = 1e9


def live_run(args, overtaken: bool, seed: int) -> dict:
    from pdwatch.testbed.overtaken_evidence import evidence_at
    from pdwatch.testbed.sglang_pd.stack import SglangStack

    env = {c.floor_env("transfer"): str(args.floor_transfer_s), c.ENV_LOG_LEVEL: "warning", c.ENV_NVML: "off"}
    if not overtaken:
        env[c.ENV_OVERTAKEN_M] = str(OVERTAKEN_OFF_M)
    cluster = f"live-transfer-wedge-{'overtaken' if overtaken else 'threshold'}-{seed}"
    out: dict = {"fault": None, "named": None, "reason": None, "paged": None, "evidence": None, "leg": None}
    with SidecarProcess(env=env) as sc, Monitoring([sc.url], scrape_interval_s=args.scrape_s) as mon:
        stack = SglangStack("transfer-wedge", otlp_endpoint=sc.url, heartbeat_s=args.heartbeat_s, cluster=cluster,
                            rate=args.rate if args.rate is not None else 2.0, restart_at=8.0, seed=seed,
                            duration_s=args.timeout_s)
        try:
            stack.start()
            deadline = time.time() + args.timeout_s
            while time.time() < deadline and out["paged"] is None:
                for e in stack.poll_events():
                    if e["event"] == "wedge" and out["fault"] is None:
                        out["fault"] = e["t"]
                stuck = [s for s in sc.get("/api/v1/stuck") if s["cluster"] == cluster]
                if stuck and out["named"] is None:
                    out["named"] = time.time()
                    first = min(stuck, key=lambda s: s["stuck_since_unix_s"])
                    out["reason"], out["leg"] = first["reason"], first
                pages = [t for t, _path, a in mon.webhook.alerts(HEADLINE) if a["labels"].get("pd_cluster") == cluster]
                if pages:
                    out["paged"] = pages[0]
                time.sleep(0.25)
            if out["leg"] is not None and out["reason"] == c.REASON_OVERTAKEN:
                # Every request's legs as the sidecar holds them, read before the stack stops.
                legs = []
                for r in stack.truth().requests:
                    got = sc.client.get(f"/api/v1/requests/{r.trace_id}")
                    if got.status_code == 200:
                        legs.extend(got.json()["legs"])
                leg = next((x for x in legs if x["role"] == out["leg"]["role"]
                            and x.get("stage_since_unix_s") and x["rid"] == out["leg"]["rid"]), None)
                if leg is not None:
                    out["evidence"] = evidence_at(leg, legs, interval_s=args.heartbeat_s)
        finally:
            stack.stop()
    return out


def live_main(args) -> bool:
    met = True
    paged: dict[str, list[float]] = {}
    for i in range(args.runs):
        for overtaken in (False, True):
            path = "overtaken" if overtaken else "threshold"
            r = live_run(args, overtaken, seed=i + 1)
            if r["fault"] is None or r["paged"] is None or r["named"] is None:
                print(f"live transfer-wedge ({path}) run {i + 1}: no page within {args.timeout_s:.0f} s "
                      f"(wedge {r['fault']}, named {r['named']})")
                met = False
                continue
            named, page = r["named"] - r["fault"], r["paged"] - r["fault"]
            paged.setdefault(path, []).append(page)
            line = (f"live transfer-wedge ({path:9s}) run {i + 1}: wedge -> named {named:5.1f} s, -> page {page:5.1f} s"
                    f"; first stuck leg: {r['leg']['role']} {r['leg']['stage']} on {r['reason']}")
            if overtaken:
                ok = page <= EVIDENCE_GOAL_S and r["reason"] == c.REASON_OVERTAKEN
                if r["evidence"] is not None:
                    late = r["named"] - r["evidence"]
                    ok = ok and late <= args.heartbeat_s + 2
                    line += (f"; named {late:.1f} s after its evidence was complete (goal {args.heartbeat_s + 2:g} s), "
                             f"{r['evidence'] - r['fault']:.1f} s after the wedge")
                else:
                    ok = False
                    line += "; its evidence not found in the legs' stages"
                line += f" (goal: page within {EVIDENCE_GOAL_S:.0f} s)"
                met = met and ok
            print(line)
    if paged.get("threshold") and paged.get("overtaken"):
        mine, theirs = statistics.median(paged["overtaken"]), statistics.median(paged["threshold"])
        print(f"median page on overtaken {mine:.1f} s against the threshold path's {theirs:.1f} s: {mine / theirs:.2f}x "
              "(the same run's baseline)")
    print(f"goals (live transfer-wedge paged within {EVIDENCE_GOAL_S:.0f} s of the wedge on overtaken, named within "
          f"a heartbeat + 2 s of its evidence): {'met' if met else 'NOT met'}")
    return met


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2, help="runs of each scenario")
    ap.add_argument("--floor-transfer-s", type=float, default=15.0)
    ap.add_argument("--scrape-s", type=float, default=2.0)
    ap.add_argument("--heartbeat-s", type=float, default=1.0)
    ap.add_argument("--rate", type=float, default=None,
                    help="requests/s (default: the scenario's own rate, else 3)")
    ap.add_argument("--timeout-s", type=float, default=200.0, help="give up on a run after this long")
    ap.add_argument("--scenarios", default="long-prompt-wedge,decode-restart,tp-desync,tp-desync-idle",
                    help="comma-separated, from the default list (the first is the threshold baseline)")
    ap.add_argument("--live", action="store_true",
                    help="the live SGLang pair's transfer-wedge, on the threshold path and on overtaken")
    args = ap.parse_args()
    logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)
    if args.live:
        live_main(args)
        return
    hold_s = seconds(HOLD) + seconds(HEADLINE_FOR)
    rows: dict[str, list[tuple[float, float]]] = {}
    met = True
    chosen = [name for name in args.scenarios.split(",") if name]
    unknown = set(chosen) - {"long-prompt-wedge", *FAULTS}
    if unknown:
        ap.error(f"unknown scenario(s) {sorted(unknown)}")
    for scenario in chosen:
        for i in range(args.runs):
            r = one_run(args, scenario, seed=i + 1)
            # A frozen loop may page before any leg is named (tp-desync caught idle): "named" is then nan.
            if r["paged"] is None or (r["named"] is None and scenario == "long-prompt-wedge"):
                print(f"{scenario} run {i + 1}: no page within {args.timeout_s:.0f} s")
                met = False
                continue
            if scenario == "long-prompt-wedge":
                start, budget = r["hang"], args.floor_transfer_s + hold_s + 2 * r["scrape_s"]
                named, paged = r["named"] - start, r["paged"] - start
                verdict = paged <= budget
                print(f"threshold {scenario} run {i + 1}: first hang -> named {named:5.1f} s, -> page {paged:5.1f} s "
                      f"(goal {budget:.0f} s = floor {args.floor_transfer_s:.0f} + {hold_s:.0f} + 2 scrapes; "
                      f"{paged / budget:.2f}x); reasons {r['reason']}")
            else:
                start = r["fault"]
                named = r["named"] - start if r["named"] is not None else float("nan")
                paged = r["paged"] - start
                verdict = paged <= EVIDENCE_GOAL_S
                kind = "idle loop" if scenario == "tp-desync-idle" else "evidence "
                print(f"{kind} {scenario} run {i + 1}: fault -> named {named:5.1f} s, -> page {paged:5.1f} s "
                      f"(goal {EVIDENCE_GOAL_S:.0f} s; {paged / EVIDENCE_GOAL_S:.2f}x) by {r['alert']}; "
                      f"reasons {r['reason']}")
            met = met and verdict
            rows.setdefault(scenario, []).append((named, paged))
    base = rows.get("long-prompt-wedge")
    for scenario in FAULTS:
        got = rows.get(scenario)
        if got and base:
            mine, theirs = statistics.median(p for _, p in got), statistics.median(p for _, p in base)
            print(f"median page {scenario} {mine:.1f} s against the threshold path's {theirs:.1f} s: "
                  f"{mine / theirs:.2f}x (the same run's baseline)")
    print(f"goals (evidence paged within {EVIDENCE_GOAL_S:.0f} s of the fault; threshold within floor + "
          f"{hold_s:.0f} s + two scrapes of the hang): {'met' if met else 'NOT met'}")


if __name__ == "__main__":
    main()
