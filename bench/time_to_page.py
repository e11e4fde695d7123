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

    python bench/time_to_page.py [--runs 2] [--floor-transfer-s 15]
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
    args = ap.parse_args()
    logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)
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
