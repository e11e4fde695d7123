"""`pdwatch testbed`: run the PD testbed alone and print what its router sees.

Starts a prefill and two decode processes (KV caches moved as real NIXL DRAM
transfers), sends load for --duration-s seconds, runs the scenario's faults,
prints one progress line per second, then stops everything.
"""

from __future__ import annotations

import argparse
import sys
import time

from . import scenarios


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdwatch testbed", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="scenarios:\n" + "\n".join(
                                     f"  {s.name:<15} {s.description}" for s in scenarios.SCENARIOS.values()))
    ap.add_argument("--scenario", default="healthy", choices=sorted(scenarios.SCENARIOS),
                    help="what load and faults to run (default healthy)")
    ap.add_argument("--otlp-endpoint", default="http://127.0.0.1:4318",
                    help="OTLP/HTTP base URL the engines export to (default http://127.0.0.1:4318)")
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second (default 4)")
    ap.add_argument("--duration-s", type=float, default=60.0, help="seconds of load (default 60)")
    ap.add_argument("--restart-at", type=float, default=8.0,
                    help="decode-restart: seconds after start when decode-0 restarts alone (default 8)")
    ap.add_argument("--heartbeat-s", type=float, default=1.0, help="engine heartbeat interval (default 1)")
    ap.add_argument("--decode-floor-s", type=float, default=30.0,
                    help="long-decode: the decode stuck floor the long generations are sized against (default 30)")
    ap.add_argument("--cluster", default="default", help="pd.cluster of the engines (default 'default')")
    ap.add_argument("--traceparent", action="store_true", help="the router sends a W3C traceparent to both legs")
    ap.add_argument("--drain-s", type=float, default=5.0,
                    help="after the load ends, wait this long for open requests to finish (default 5)")
    ap.add_argument("--seed", type=int, default=1)
    return ap


def _line(t: float, truth) -> str:
    reqs = truth.requests
    ok = sum(1 for r in reqs if r.outcome == "ok")
    bad = sum(1 for r in reqs if r.outcome not in (None, "ok"))
    open_by = {}
    for r in truth.open:
        open_by[r.decode] = open_by.get(r.decode, 0) + 1
    per = " ".join(f"{k}={v}" for k, v in sorted(open_by.items())) or "-"
    return (f"t={t:5.1f}s sent={len(reqs):<5} ok={ok:<5} not-ok={bad:<4} open: {per:<24} "
            f"hung-after-restart={len(truth.outstanding_after_restart())}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .stack import Stack

    try:
        stack = Stack(args.scenario, otlp_endpoint=args.otlp_endpoint, heartbeat_s=args.heartbeat_s, rate=args.rate,
                      restart_at=args.restart_at, seed=args.seed, decode_floor_s=args.decode_floor_s,
                      cluster=args.cluster, duration_s=args.duration_s, traceparent=args.traceparent)
    except ValueError as e:
        print(f"pdwatch testbed: {e}", file=sys.stderr)
        return 2
    print(f"pdwatch testbed: scenario {args.scenario}, {args.rate:g} req/s for {args.duration_s:g} s, "
          f"exporting to {args.otlp_endpoint}", flush=True)
    try:
        stack.start()
        t0 = time.monotonic()
        drain_until = None
        while True:
            time.sleep(1.0)
            for ev in stack.poll_events():
                extra = {k: v for k, v in ev.items() if k not in ("event", "t")}
                print(f"--- {ev['event']}: {extra}", flush=True)
            truth = stack.truth()
            print(_line(time.monotonic() - t0, truth), flush=True)
            if stack.load_done and drain_until is None:
                drain_until = time.monotonic() + args.drain_s
            if drain_until is not None and (time.monotonic() >= drain_until or not truth.open):
                break
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    except Exception as e:
        print(f"pdwatch testbed: {e}", file=sys.stderr)
        return 1
    finally:
        stack.stop()
    truth = stack.truth()
    hung = truth.outstanding_after_restart()
    print(f"done: {len(truth.requests)} sent, {len(truth.completed)} ok, {len(truth.open)} still open, "
          f"{len(hung)} hung after a restart")
    for r in hung[:20]:
        print(f"  hung: trace_id={r.trace_id} room={r.room} decode={r.decode}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
