"""Entry point of one testbed engine process: `python -m pdwatch.testbed.engine --role R`.

Builds the role's engine, prints one JSON "ready" line on stdout once its
NIXL agent and servers are up, then runs until SIGTERM, or until its parent
goes away (stdin closes), so that no engine outlives the stack that started it.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from typing import Protocol, TypedDict

# Constants only: numpy and NIXL load when the engine is built, not for --help.
BYTES_PER_TOKEN = 128
SLOT_BYTES = 32768

log = logging.getLogger("pdwatch.testbed.engine")


class Ready(TypedDict, total=False):
    """The one JSON line an engine process prints once it is ready (what its role knows)."""

    ready: bool
    role: str
    instance: str
    agent: str  # its NIXL agent name (a TP follower has none)
    api_port: int  # where the router reaches it
    bootstrap_port: int  # prefill: its bootstrap server
    endpoint: str  # decode: the address the prefill knows it by
    tp_rank: int


class Engine(Protocol):
    def start(self) -> Ready: ...

    def shutdown(self) -> None: ...


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m pdwatch.testbed.engine", description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=("prefill", "decode"), required=True)
    ap.add_argument("--instance", required=True, help="stable instance name, e.g. decode-0")
    ap.add_argument("--api-port", type=int, default=0, help="port for the router (0: any free one)")
    ap.add_argument("--bootstrap-port", type=int, default=0, help="prefill: port of its bootstrap server")
    ap.add_argument("--prefill-bootstrap-port", type=int, default=0, help="decode: the prefill's bootstrap port")
    ap.add_argument("--slots", type=int, default=256, help="KV pool slots")
    ap.add_argument("--slot-bytes", type=int, default=SLOT_BYTES, help="bytes per KV pool slot")
    ap.add_argument("--bytes-per-token", type=int, default=BYTES_PER_TOKEN, help="KV bytes per prompt token")
    ap.add_argument("--forward-s-per-token", type=float, default=2e-5, help="prefill forward cost per token")
    ap.add_argument("--token-interval-s", type=float, default=0.05, help="decode: one token per running request per step")
    ap.add_argument("--max-running", type=int, default=64, help="decode: running batch size")
    ap.add_argument("--bootstrap-timeout-s", type=float, default=300.0)
    ap.add_argument("--waiting-timeout-s", type=float, default=300.0, help="decode: KV arrival timeout")
    ap.add_argument("--hang-prompts-over", type=int, default=0,
                    help="prefill fault: KV writes of prompts longer than this many tokens are never posted (0: off)")
    ap.add_argument("--hang-fraction", type=float, default=0.0,
                    help="prefill fault: this share of KV writes, chosen at random, are never posted (0: off)")
    ap.add_argument("--service-name", default="pdwatch-testbed")
    ap.add_argument("--gpu-uuid", action="append", help="UUID of an emulated GPU this process drives (repeatable)")
    ap.add_argument("--status-file", help="where to report GPU work and spin shares (testbed.engine_status)")
    ap.add_argument("--tp-rank", type=int, default=0, help="decode: rank in its TP group (1: the follower)")
    ap.add_argument("--tp-size", type=int, default=1, help="decode: TP group size (1 or 2)")
    ap.add_argument("--tp-port", type=int, default=0, help="decode: rank 0's port for the per-step barrier")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {args.instance} %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    def watch_parent() -> None:
        # The parent holds our stdin open; EOF means it died without stopping us.
        try:
            sys.stdin.buffer.read()
        except Exception:
            pass
        stop.set()

    threading.Thread(target=watch_parent, name="parent-watch", daemon=True).start()

    if args.tp_size not in (1, 2) or not 0 <= args.tp_rank < args.tp_size:
        raise SystemExit(f"--tp-size must be 1 or 2 and --tp-rank below it, got {args.tp_size}, {args.tp_rank}")
    if args.tp_size > 1 and (args.role != "decode" or not args.tp_port):
        raise SystemExit("a TP group is a decode with --tp-port")
    engine: Engine
    if args.role == "prefill":
        from .prefill import PrefillEngine

        engine = PrefillEngine(args)
    elif args.tp_rank > 0:
        from .tp import TpFollower

        engine = TpFollower(args)
    else:
        from .decode import DecodeEngine

        engine = DecodeEngine(args)
    fault = getattr(engine, "fault", None)
    if fault is not None:
        # SIGUSR1 injects the engine's fault (a TP follower stops joining steps).
        signal.signal(signal.SIGUSR1, lambda *_: fault())
    ready = engine.start()
    print(json.dumps({"ready": True, **ready}), flush=True)
    stop.wait()
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
