"""How far the overtaken rule (contract section 5b, v1.2) stays from calling a healthy leg stuck, per
emulated testbed scenario, and which hung legs it names.

Each scenario's stack runs against an in-process sidecar with the integration tests' short settings
(`pdwatch.testbed.diagnosis_run`: 0.5 s heartbeats, so the rule's floor of 2 intervals is 1 s, not
the 4 s of the default 2 s heartbeats). Every 0.25 s, on the tracker's thread, every open leg in a
stage the rule judges that has waited past that floor is measured: for k = 1..10, its wait over the
longest of the k quickest later legs, at least as big (and of its peer, in bootstrap), that went
through its stage. The rule with (K, M) names the leg once that ratio for K exceeds M. Each leg keeps
the largest ratios it reached; at the end the router's ground truth splits the legs into those of
requests that completed ok (any ratio above M there would have been a false stuck leg) and the rest
(hung, timed out, failed: the ones to catch). The sidecar's own judge runs with the defaults (or
--k/--m), and every leg it named overtaken is counted on the same split.

    python bench/overtaken_margin.py [--scenarios a,b,...] [--k 5 --m 10] [--seed 1]
"""

from __future__ import annotations

import argparse
import threading
import time
from bisect import bisect_right
from typing import Any

import httpx
import uvicorn

from pdwatch import contract as c
from pdwatch.sidecar import rules
from pdwatch.sidecar.app import create_app
from pdwatch.sidecar.settings import Settings
from pdwatch.sidecar.tracker import Tracker
from pdwatch.testbed import scenarios
from pdwatch.testbed.diagnosis_run import FLOORS_S, FLOW_WINDOW_S, LONG_DECODE_FLOOR_S, run_scenario
from pdwatch.testbed.processes import free_port

KS = range(1, 11)
POLL_S = 0.25
LegKey = tuple[str, str, str, str]  # cluster, trace id, role, stage


class InProcessSidecar:
    """The real app under uvicorn on a loopback port, in this process, so its tracker can be read."""

    def __init__(self, settings: Settings):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(settings)
        self.sidecar = self.app.state.sidecar
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.client = httpx.Client(base_url=self.url, timeout=10)

    def __enter__(self) -> InProcessSidecar:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        self.server.should_exit = True
        self.thread.join(10)

    def get(self, path: str) -> Any:
        r = self.client.get(path)
        r.raise_for_status()
        return r.json()


def ratios(tracker: Tracker) -> dict[LegKey, tuple[bool, list[float]]]:
    """For each open leg the rule judges: whether it waited past the floor, and its wait / the longest of
    the k quickest overtakers."""
    now = tracker.clock()
    out: dict[LegKey, tuple[bool, list[float]]] = {}
    for leg in tracker.open.values():
        inc, stage = leg.inc, leg.stage
        if inc is None or stage is None or leg.stage_done or leg.prompt_tokens is None:
            continue
        if not rules.overtaken_applies(stage, inc.schedule_policy):
            continue
        peer = None
        if stage == "bootstrap":
            if not leg.peer:
                continue
            peer = leg.peer
        waited = rules.leg_age_s(leg, now)
        kept = inc.passages.get(stage)
        if not kept:
            continue
        p = rules.passed(kept, lambda tid, role=leg.role: tracker.open.get((tid, role)) or
                         tracker.closed.get((tid, role)), k=1, m=0.0, interval_s=0.0)
        if p is None:
            continue
        ways = sorted(d for d, tokens, by in p.ways[bisect_right(p.starts, leg.stage_since_ns):]
                      if tokens >= leg.prompt_tokens and (peer is None or by == peer))
        if ways:
            out[(leg.cluster, leg.trace_id, leg.role, stage)] = (
                waited > c.OVERTAKEN_INTERVALS * inc.interval_s, [waited / max(d / 1e9, 1e-6) for d in ways[:len(KS)]])
    return out


def passages(tracker: Tracker) -> str:
    """What the rule had to read: each instance's declared policy and passages kept per stage."""
    return "; ".join(f"{inst.name} {inc.schedule_policy or '?'} "
                     + ",".join(f"{stage}={len(kept)}" for stage, kept in inc.passages.items())
                     for inst in tracker.instances.values() for inc in inst.ranks.values() if inc.rank == 0)


def keep_max(seen: dict[LegKey, list[float]], key: LegKey, rs: list[float]) -> None:
    best = seen.get(key, [])
    seen[key] = [max(a, b) for a, b in zip(rs, best)] + rs[len(best):] + best[len(rs):]


def watch(sc: InProcessSidecar, stop: threading.Event, seen: dict[LegKey, list[float]],
          unfloored: dict[LegKey, list[float]], named: dict[LegKey, str]) -> None:
    while not stop.wait(POLL_S):
        for key, (past_floor, rs) in sc.sidecar.worker.call(ratios, sc.sidecar.tracker).items():
            keep_max(unfloored, key, rs)
            if past_floor:
                keep_max(seen, key, rs)
        for s in sc.sidecar.latest().stuck:
            if s.reason == c.REASON_OVERTAKEN:
                named.setdefault((s.cluster, s.trace_id, s.role, s.stage), s.why)


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default=",".join(scenarios.SCENARIOS))
    ap.add_argument("--k", type=int, default=c.DEFAULT_OVERTAKEN_K)
    ap.add_argument("--m", type=float, default=c.DEFAULT_OVERTAKEN_M)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    floors = {f"floor_{stage}_s": s for stage, s in FLOORS_S.items()} | {"floor_decode_s": LONG_DECODE_FLOOR_S}
    settings = Settings(evaluate_interval_s=0.25, flow_window_s=FLOW_WINDOW_S, nvml="off", log_level="warning",
                        overtaken_k=args.k, overtaken_m=args.m, **floors)
    print(f"judge: K={args.k}, M={args.m:g}; ratios: the largest wait / (longest of the k quickest overtakers)")
    print("per scenario: legs measured past the floor; of completed requests, the largest ratio at k=1..10 past the "
          "floor,\n  and at K without the floor (what the floor alone keeps from naming); of the others (hung, "
          "timed out, failed): legs, those over M at K, those the judge named overtaken")
    print("scenario             legs   ok-legs max ratio, k=1..10 (completed ok)    no floor | hung: legs  >M at K  named")
    for name in args.scenarios.split(","):
        seen: dict[LegKey, list[float]] = {}
        unfloored: dict[LegKey, list[float]] = {}
        named: dict[LegKey, str] = {}
        with InProcessSidecar(settings) as sc:
            stop = threading.Event()
            poller = threading.Thread(target=watch, args=(sc, stop, seen, unfloored, named), daemon=True)
            poller.start()
            try:
                run = run_scenario(name, sc, None, seed=args.seed)
            finally:
                stop.set()
                poller.join(5)
            kept = sc.sidecar.worker.call(passages, sc.sidecar.tracker)
        truth = run.truth
        ok = {r.trace_id for r in truth.requests if r.outcome == "ok"} if truth is not None else set()
        healthy = {k: v for k, v in seen.items() if k[1] in ok}
        hung = {k: v for k, v in seen.items() if k[1] not in ok}
        worst = [max((v[k - 1] for v in healthy.values() if len(v) >= k), default=None) for k in KS]
        worst_unfloored = max((v[args.k - 1] for key, v in unfloored.items() if key[1] in ok and len(v) >= args.k),
                              default=None)
        caught = sum(1 for v in hung.values() if len(v) >= args.k and v[args.k - 1] > args.m)
        false_named = sum(1 for k in named if k[1] in ok)
        print(f"{name:20s} {len(seen):5d} {len(healthy):8d}  {' '.join(fmt(x) for x in worst):38s} "
              f"{fmt(worst_unfloored):>8s} | "
              f"{len(hung):10d} {caught:6d} {len(named):6d} (of completed requests: {false_named})")
        roles = sorted({(k[2], k[3]) for k in named})
        print(f"    named: {', '.join(f'{r} {st}' for r, st in roles) or 'none'}; passages kept: {kept}")
        if hung:
            grid = [f"K={k_},M={m_:g}: {sum(1 for v in hung.values() if len(v) >= k_ and v[k_ - 1] > m_)}"
                    for k_ in (3, 5, 8) for m_ in (5.0, 10.0, 20.0)]
            print(f"    hung legs over the rule at other settings (of {len(hung)}): {'; '.join(grid)}")
        for key, why in list(named.items())[:2]:
            print(f"    e.g. {key[2]} {key[3]}: {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
