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

With --live, the scenarios are the live SGLang pair's (`pdwatch.testbed.sglang_pd`: real
`sglang.launch_server` processes on this CPU, one stack at a time, about a minute to start each), with
the live tests' settings (1 s heartbeats, so the rule's floor is 2 s); each also says how long after its
fault the judge first named a leg overtaken.

    python bench/overtaken_margin.py [--scenarios a,b,...] [--k 5 --m 10] [--seed 1]
    python bench/overtaken_margin.py --live [--scenarios healthy,transfer-wedge,...]
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


# The live pair: the live tests' settings (tests/live/conftest.py), and per scenario what its stack needs
# beyond them: seconds of load and how long to watch after it (long generations end well after the load).
LIVE_HEARTBEAT_S = 1.0
LIVE_FLOORS_S = {"bootstrap": 10.0, "queued": 20.0, "prefill": 20.0, "transfer": 15.0, "decode": 5.0}
LIVE_FLOW_WINDOW_S = 60.0
LIVE_FAULTS = ("wedge", "wedge_long", "frozen", "loop_frozen", "killed")
LIVE: dict[str, dict[str, Any]] = {
    "healthy": {"seconds": 60.0, "rate": 2.0},
    "long-decode": {"seconds": 30.0, "rate": 1.0, "watch_s": 60.0, "token_interval_s": 0.008,
                    "context_length": 4096},
    "long-forward": {"seconds": 45.0, "rate": 2.0},
    "transfer-wedge": {"seconds": 45.0, "rate": 2.0},
    "long-prompt-wedge": {"seconds": 40.0, "rate": 1.5},
    "freeze-decode": {"seconds": 40.0, "rate": 2.0},
    "freeze-loop": {"seconds": 40.0, "rate": 2.0},
    "decode-restart": {"seconds": 150.0, "rate": 2.0},
    # The ordinary day's steps one after another (several minutes), watched while its overload's backlog drains.
    "ordinary-day": {"seconds": 900.0, "rate": 2.0, "watch_s": 90.0, "until": "overload_end"},
}


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
          unfloored: dict[LegKey, list[float]], named: dict[LegKey, str], first: dict[str, float]) -> None:
    while not stop.wait(POLL_S):
        for key, (past_floor, rs) in sc.sidecar.worker.call(ratios, sc.sidecar.tracker).items():
            keep_max(unfloored, key, rs)
            if past_floor:
                keep_max(seen, key, rs)
        for s in sc.sidecar.latest().stuck:
            if s.reason == c.REASON_OVERTAKEN:
                named.setdefault((s.cluster, s.trace_id, s.role, s.stage), s.why)
                first.setdefault("overtaken", time.time())
            first.setdefault("stuck", time.time())


def run_live(name: str, sc: InProcessSidecar, seed: int) -> tuple[Any, float | None]:
    """One live SGLang scenario against the in-process sidecar: its truth, and when its fault struck."""
    from pdwatch.testbed.sglang_pd.stack import SglangStack

    args = dict(LIVE.get(name, LIVE["healthy"]))
    seconds, watch_s, until = args.pop("seconds"), args.pop("watch_s", 10.0), args.pop("until", None)
    stack = SglangStack(name, otlp_endpoint=sc.url, heartbeat_s=LIVE_HEARTBEAT_S, cluster=f"live-{name}",
                        duration_s=seconds, decode_floor_s=LIVE_FLOORS_S["decode"], restart_at=8.0, seed=seed,
                        **args)
    fault = None
    try:
        stack.start()
        deadline = time.monotonic() + seconds + watch_s
        while time.monotonic() < deadline:
            time.sleep(POLL_S)
            for e in stack.poll_events():
                if fault is None and e["event"] in LIVE_FAULTS:
                    fault = e["t"]
                if e["event"] == until:
                    deadline = min(deadline, time.monotonic() + watch_s)
        return stack.truth(), fault
    finally:
        stack.stop()


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default=None, help="comma-separated (default: every one of the testbed)")
    ap.add_argument("--live", action="store_true", help="the live SGLang pair's scenarios, not the emulated ones")
    ap.add_argument("--k", type=int, default=c.DEFAULT_OVERTAKEN_K)
    ap.add_argument("--m", type=float, default=c.DEFAULT_OVERTAKEN_M)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if args.live:
        floors = {f"floor_{stage}_s": s for stage, s in LIVE_FLOORS_S.items()}
        flow_window_s, names = LIVE_FLOW_WINDOW_S, args.scenarios or ",".join(LIVE)
    else:
        floors = {f"floor_{stage}_s": s for stage, s in FLOORS_S.items()} | {"floor_decode_s": LONG_DECODE_FLOOR_S}
        flow_window_s, names = FLOW_WINDOW_S, args.scenarios or ",".join(scenarios.SCENARIOS)
    settings = Settings(evaluate_interval_s=0.25, flow_window_s=flow_window_s, nvml="off", log_level="warning",
                        overtaken_k=args.k, overtaken_m=args.m, **floors)
    print(f"judge: K={args.k}, M={args.m:g}; ratios: the largest wait / (longest of the k quickest overtakers)")
    print("per scenario: legs measured past the floor; of completed requests, the largest ratio at k=1..10 past the "
          "floor,\n  and at K without the floor (what the floor alone keeps from naming); of the others (hung, "
          "timed out, failed): legs, those over M at K, those the judge named overtaken")
    print("scenario             legs   ok-legs max ratio, k=1..10 (completed ok)    no floor | hung: legs  >M at K  named")
    for name in names.split(","):
        seen: dict[LegKey, list[float]] = {}
        unfloored: dict[LegKey, list[float]] = {}
        named: dict[LegKey, str] = {}
        first: dict[str, float] = {}
        with InProcessSidecar(settings) as sc:
            stop = threading.Event()
            poller = threading.Thread(target=watch, args=(sc, stop, seen, unfloored, named, first), daemon=True)
            poller.start()
            try:
                if args.live:
                    truth, fault = run_live(name, sc, args.seed)
                else:
                    run = run_scenario(name, sc, None, seed=args.seed)
                    truth, fault = run.truth, run.fault_at
            finally:
                stop.set()
                poller.join(5)
            kept = sc.sidecar.worker.call(passages, sc.sidecar.tracker)
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
        if fault is not None:
            print("    after the fault: first stuck leg "
                  + ", ".join(f"{what} {first[what] - fault:.1f} s" for what in ("stuck", "overtaken") if what in first))
        for key, why in list(named.items())[:2]:
            print(f"    e.g. {key[2]} {key[3]}: {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
