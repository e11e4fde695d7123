"""Time to page: from the fault (decode-0 restarted alone) to PDRequestStuckWhileOthersFlow at the webhook.

The fault is the kill; the first request then hangs once the restarted decode
is back (about a second later), and the floor counts from that leg's entry
into `transfer`. Both spans are printed; the goal is judged from the hang.

Each run starts a real sidecar, real Prometheus and Alertmanager (the
repository's rules and routes, see pdwatch/monitoring.py) and the testbed's
decode-restart incident, then records when the sidecar first reports a stuck
leg and when the page arrives. The baseline is the budget the design allows,
measured against the same run's settings: transfer floor + the rule's `for` +
two scrape intervals. Rule evaluation and Alertmanager's group wait come on top.

    python bench/time_to_page.py [--runs 3] [--floor-transfer-s 15]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import yaml

from pdwatch.testbed.monitoring import RULES, Monitoring
from pdwatch.testbed.sidecar_process import SidecarProcess

HEADLINE = "PDRequestStuckWhileOthersFlow"


def rule_for_s() -> float:
    rule = next(r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if r.get("alert") == HEADLINE)
    text = rule["for"]
    return float(text[:-1]) * {"s": 1, "m": 60, "h": 3600}[text[-1]]


def one_run(args, seed: int) -> dict:
    from pdwatch.testbed.stack import Stack

    env = {"PDWATCH_FLOOR_TRANSFER_S": str(args.floor_transfer_s), "PDWATCH_LOG_LEVEL": "warning",
           "PDWATCH_NVML": "off"}
    with SidecarProcess(env=env) as sc, Monitoring([sc.url], scrape_interval_s=args.scrape_s) as mon:
        stack = Stack("decode-restart", otlp_endpoint=sc.url, heartbeat_s=args.heartbeat_s, rate=args.rate,
                      restart_at=5.0, seed=seed)
        try:
            stack.start()
            fault = detected = hang = None
            deadline = time.time() + args.timeout_s
            while time.time() < deadline:
                for e in stack.poll_events():
                    if e["event"] == "killed" and fault is None:
                        fault = e["t"]
                if fault is not None and detected is None:
                    stuck = sc.get("/api/v1/stuck")
                    if stuck:
                        detected = time.time()
                        # The floor counts from the stage entry of the first leg that hung.
                        hang = min(s["stage_since_unix_s"] for s in stuck)
                pages = mon.webhook.alerts(HEADLINE)
                if pages:
                    return {"fault": fault, "hang": hang, "detected": detected, "paged": pages[0][0], "mon": mon}
                time.sleep(0.5)
            return {"fault": fault, "hang": None, "detected": detected, "paged": None, "mon": mon}
        finally:
            stack.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--floor-transfer-s", type=float, default=15.0)
    ap.add_argument("--scrape-s", type=float, default=2.0)
    ap.add_argument("--heartbeat-s", type=float, default=1.0)
    ap.add_argument("--rate", type=float, default=3.0)
    ap.add_argument("--timeout-s", type=float, default=240.0, help="give up on a run after this long")
    args = ap.parse_args()
    logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)
    for_s = rule_for_s()
    results = []
    for i in range(args.runs):
        r = one_run(args, seed=i + 1)
        mon = r.pop("mon")
        budget = args.floor_transfer_s + for_s + 2 * mon.scrape_s
        if r["paged"] is None or r["fault"] is None:
            print(f"run {i + 1}: no page within {args.timeout_s:.0f} s")
            results.append(None)
            continue
        detect = r["detected"] - r["fault"] if r["detected"] else float("nan")
        from_fault = r["paged"] - r["fault"]
        page = r["paged"] - r["hang"]
        results.append((detect, page, budget))
        print(f"run {i + 1}: fault -> first leg hangs {r['hang'] - r['fault']:4.1f} s, -> stuck reported "
              f"{detect:5.1f} s, -> page {from_fault:5.1f} s; hang -> page {page:5.1f} s "
              f"(goal {budget:.0f} s = floor {args.floor_transfer_s:.0f} + for {for_s:.0f} + 2 scrapes "
              f"{2 * mon.scrape_s:.0f}; rule evaluation every {mon.eval_s:.0f} s and group wait "
              f"{mon.group_wait_s:.0f} s come on top): "
              f"{page / budget:.2f}x the goal")
    ok = [r for r in results if r is not None]
    if ok:
        pages = [p for _, p, _ in ok]
        print(f"median hang -> page {statistics.median(pages):.1f} s over {len(ok)} run(s), "
              f"worst {max(pages):.1f} s; median fault -> stuck reported "
              f"{statistics.median(d for d, _, _ in ok):.1f} s")
    met = len(ok) == len(results) and all(p <= b for _, p, b in ok)
    print(f"goal (every page within floor + for + two scrape intervals of the first leg hanging): "
          f"{'met' if met else 'NOT met'}")


if __name__ == "__main__":
    main()
