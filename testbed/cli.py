"""`pdwatch testbed`: run a PD testbed alone and print what its router sees.

--engine emulated (the default) starts a prefill and two decode processes of
pdwatch's own that move KV caches as real NIXL DRAM transfers; --engine sglang
starts real SGLang 0.5.23 prefill and decode servers on this CPU, with
pdwatch's plugin inside, and SGLang's router; --engine vllm starts real vLLM
prefill and decode servers with pdwatch's adapter inside, behind the testbed's
PD proxy. Each sends load for --duration-s seconds, runs the scenario's faults,
prints one progress line per second, then stops everything. The engines and
their scenarios are one registry (testbed/engines.py).
"""

from __future__ import annotations

import argparse
import sys
import time

from pdwatch import contract as c

from .engines import ENGINES, all_scenarios, matrix
from .router import Truth
from .stack_base import StackArgs


def _epilog() -> str:
    lines = []
    for engine in ENGINES.values():
        lines.append(f"scenarios of --engine {engine.name}:")
        lines += [f"  {s.name:<15} {s.description}" for s in engine.catalogue.by_name.values()]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdwatch testbed", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_epilog())
    ap.add_argument("--engine", default="emulated", choices=list(ENGINES),
                    help="; ".join(f"{e.name}: {e.summary}" for e in ENGINES.values()) + " (default emulated)")
    ap.add_argument("--scenario", default="healthy", choices=sorted(all_scenarios()),
                    help="what load and faults to run (default healthy)")
    ap.add_argument("--decodes", type=int, default=2, help="decode instances, 1 or 2 (default 2)")
    ap.add_argument("--otlp-endpoint", default=c.DEFAULT_SIDECAR_URL,
                    help=f"OTLP/HTTP base URL the engines export to (default {c.DEFAULT_SIDECAR_URL})")
    ap.add_argument("--rate", type=float, default=None,
                    help="requests per second (default: the scenario's, else 4 emulated, 2 live)")
    ap.add_argument("--duration-s", type=float, default=60.0, help="seconds of load (default 60)")
    ap.add_argument("--restart-at", type=float, default=None,
                    help="seconds after the load starts when the scenario's fault happens "
                         "(default 8 emulated, 10 live)")
    ap.add_argument("--heartbeat-s", type=float, default=1.0, help="engine heartbeat interval (default 1)")
    ap.add_argument("--decode-floor-s", type=float, default=30.0,
                    help="long-decode: the decode stuck floor the long generations are sized against (default 30)")
    ap.add_argument("--cluster", default="default", help="pd.cluster of the engines (default 'default')")
    ap.add_argument("--traceparent", action="store_true",
                    help="emulated: the router sends a W3C traceparent to both legs (the live engines' clients "
                         "always send one to both legs)")
    ap.add_argument("--drain-s", type=float, default=5.0,
                    help="after the load ends, wait this long for open requests to finish (default 5)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--list", action="store_true",
                    help="print every scenario, one a line, with what it should give on each engine "
                         "(the failure family, ordinary, none-stuck, or - where it does not apply), and exit")
    return ap


def _listing() -> str:
    names = list(ENGINES)
    lines = [f"{'SCENARIO':<18} " + " ".join(f"{n.upper():<18}" for n in names)]
    for scenario, per in matrix().items():
        lines.append(f"{scenario:<18} " + " ".join(f"{per[n] or '-':<18}" for n in names))
    return "\n".join(line.rstrip() for line in lines)


def _line(t: float, truth: Truth) -> str:
    reqs = truth.requests
    ok = sum(1 for r in reqs if r.outcome == "ok")
    bad = sum(1 for r in reqs if r.outcome not in (None, "ok"))
    open_by: dict[str, int] = {}
    for r in truth.open:
        key = r.decode or "all"  # SGLang's router picks the decode; its client cannot see which
        open_by[key] = open_by.get(key, 0) + 1
    per = " ".join(f"{k}={v}" for k, v in sorted(open_by.items())) or "-"
    return (f"t={t:5.1f}s sent={len(reqs):<5} ok={ok:<5} not-ok={bad:<4} open: {per:<24} "
            f"hung-after-restart={len(truth.outstanding_after_restart())}")


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.list:
        print(_listing())
        return 0
    engine = ENGINES[args.engine]
    if engine.scenario(args.scenario) is None:
        ap.error(f"scenario {args.scenario!r} does not exist for --engine {args.engine} "
                 f"(choose from {', '.join(sorted(engine.catalogue.by_name))})")
    kind = engine.launcher()
    # Unless told: the scenario's own rate, else the stack's; the stack's fault time.
    rate = args.rate if args.rate is not None else kind.catalogue.get(args.scenario).rate or kind.defaults["rate"]
    restart_at = args.restart_at if args.restart_at is not None else kind.defaults["restart_at"]
    stack_args = StackArgs(otlp_endpoint=args.otlp_endpoint, heartbeat_s=args.heartbeat_s, rate=rate,
                           restart_at=restart_at, seed=args.seed, decode_floor_s=args.decode_floor_s,
                           cluster=args.cluster, duration_s=args.duration_s, decodes=args.decodes)
    if args.engine == "emulated":
        stack_args["traceparent"] = args.traceparent  # the live clients always send one
    try:
        stack = kind(args.scenario, **stack_args)
    except ValueError as e:
        print(f"pdwatch testbed: {e}", file=sys.stderr)
        return 2
    print(f"pdwatch testbed: {args.engine} engine, scenario {args.scenario}, {rate:g} req/s for "
          f"{args.duration_s:g} s, exporting to {args.otlp_endpoint}", flush=True)
    if engine.starting:
        print(engine.starting, flush=True)
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
    if not hung:
        for r in truth.open[:20]:
            print(f"  open: trace_id={r.trace_id} sent {time.time() - r.sent_at:.0f} s ago")
    return 0

