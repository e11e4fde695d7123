"""Where a live SGLang PD pair's GIL time goes, and how much of it is pdwatch's: py-spy on each scheduler.

sglang_live_cost.py answers "how much slower" as the difference of two noisy
latencies (two stacks that are the same differ here by a per cent or two).
This looks inside one stack instead. While requests flow through the router
one at a time, py-spy samples each scheduler process without stopping it
(--nonblocking), and only the thread that holds the GIL (--gil): an engine
thread waiting for the GIL while pdwatch holds it is the cost that matters.
A sample is
  pdwatch's   when its innermost frame is pdwatch code: a hook on the
              scheduler thread, or the recorder's worker (drain, spans, post);
  a wrapper's when its innermost frame is SGLang's HookRegistry wrapper,
              pdwatch's or the testbed's (which wraps run_batch once a
              forward): an upper bound on what the wrappers add;
and the baseline, in the same run, is every sample of that process.
Printed per scheduler: samples, the pdwatch and wrapper shares with 95 %
(Wilson) intervals, the sampled GIL time per request, what pdwatch's share
of it is as a share of the median request latency, and where pdwatch's and
the wrappers' samples fell (a wrapper by the line that called it, which
names the hooked method). Requests are
sequential, so each scheduler's time is on the request's critical path.
py-spy takes the GIL's last holder for its holder: the recorder thread
waiting on its post's reply while the scheduler also waits still counts, so
the recorder's share is an upper bound. Sampling without stopping the
process also reads a torn stack now and then: a wrapper's calling line is a
hint (one still named pop_transferred's line after it was no longer hooked).

Needs py-spy (the capture extra; make installs it) and the right to ptrace the servers
(same user; root, or kernel.yama.ptrace_scope 0).

    python bench/sglang_live_profile.py [--seconds 30] [--rate 250] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
from sglang_live_cost import one_request

from pdwatch import contract as c
from pdwatch.testbed.sglang_pd.stack import SglangStack
from pdwatch.testbed.sidecar_process import SidecarProcess

PDWATCH_CODE = "engine_patches/"  # how py-spy names pdwatch's plugin files (relative to site-packages)
WRAPPER_CODE = "hook_registry.py"


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % interval of a proportion k/n."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, mid - half), min(1.0, mid + half)


def classify(frames: list[str]) -> str:
    """'recorder', 'hooks', 'wrapper' or 'engine' for one py-spy raw stack (thread, outer, ..., inner)."""
    if frames[0].endswith("pdwatch-recorder"):
        return "recorder"
    if PDWATCH_CODE in frames[-1]:
        return "hooks"
    if WRAPPER_CODE in frames[-1]:
        return "wrapper"
    return "engine"


def read_raw(path: Path) -> tuple[Counter[str], Counter[str], Counter[str]]:
    """Samples by class from py-spy's raw (collapsed-stack) output, and pdwatch's and the wrappers'
    samples by where they were: pdwatch's innermost frame, or the frame that called a wrapper (which
    says which hooked method it wraps)."""
    counts: Counter[str] = Counter()
    where: Counter[str] = Counter()
    on_thread: Counter[str] = Counter()  # pdwatch's samples: the scheduler thread's hooks, or its recorder
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            frames = stack.split(";")
            kind = classify(frames)
            if kind == "wrapper":
                where[f"wrapper called from {frames[-2] if len(frames) > 1 else '?'}"] += int(n)
            elif kind != "engine":
                where[f"pdwatch ({kind}) in {frames[-1]}"] += int(n)
                on_thread[kind] += int(n)
                kind = "pdwatch"
            counts[kind] += int(n)
    return counts, where, on_thread


def schedulers(stack: SglangStack) -> dict[str, int]:
    """Each server's scheduler process id (SGLang titles it sglang::scheduler)."""
    found = {}
    for name, server in stack.servers.items():
        for p in psutil.Process(server.pid).children(recursive=True):
            if "scheduler" in p.name():
                found[name] = p.pid
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="how long py-spy samples (default 30)")
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second (default 250)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args()
    if not 5 <= args.seconds <= 300:
        ap.error("--seconds must be between 5 and 300")
    if not 10 <= args.rate <= 1000:
        ap.error("--rate must be between 10 and 1000")
    for name in ("prompt_tokens", "max_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    spy = shutil.which("py-spy", path=os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", ""))))
    if spy is None:
        ap.error("py-spy is not installed (pip install 'pdwatch[capture]', or make, which installs requirements.lock)")

    rng = random.Random(5)
    with SidecarProcess(env={c.ENV_NVML: "off", c.ENV_LOG_LEVEL: "warning"}) as sidecar, \
            tempfile.TemporaryDirectory(prefix="pdwatch-profile-") as tmp:
        stack = SglangStack("healthy", otlp_endpoint=sidecar.url, decodes=1, plugin=True, cluster="profile",
                            load=False).start()
        try:
            port = stack.sglang_router.port
            for _ in range(args.warmup):
                one_request(port, [rng.randrange(3, 1000) for _ in range(args.prompt_tokens)], args.max_tokens)
            pids = schedulers(stack)
            latencies: list[float] = []
            stop = threading.Event()
            # Bounded in count and time: a request each 60 ms or so, for the sampling window and a margin.
            limit = int(args.seconds * 100) + 100

            def load() -> None:
                deadline = time.monotonic() + args.seconds + 30
                while not stop.is_set() and len(latencies) < limit and time.monotonic() < deadline:
                    ids = [rng.randrange(3, 1000) for _ in range(args.prompt_tokens)]
                    latencies.append(one_request(port, ids, args.max_tokens))

            driver = threading.Thread(target=load, daemon=True)
            driver.start()
            time.sleep(1.0)
            started = len(latencies)
            spies = {name: subprocess.Popen(
                [spy, "record", "--nonblocking", "--gil", "--threads", "-r", str(args.rate),
                 "-d", str(int(args.seconds)), "-f", "raw", "-o", f"{tmp}/{name}.txt", "-p", str(pid)],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for name, pid in pids.items()}
            errors = {name: p.communicate(timeout=args.seconds + 60)[1].decode(errors="replace")
                      for name, p in spies.items()}
            window = latencies[started:]
            stop.set()
            driver.join(60)
            failed = {name: errors[name].strip()[-300:] for name, p in spies.items() if p.returncode != 0}
            if failed:
                print(f"py-spy failed: {failed}", file=sys.stderr)
                return 1
            read = {name: read_raw(Path(f"{tmp}/{name}.txt")) for name in pids}
        finally:
            stack.stop()
    if not window:
        print("no request finished while py-spy sampled", file=sys.stderr)
        return 1
    median = statistics.median(window)
    print(f"{len(window)} requests while sampling ({args.prompt_tokens}-token prompts, {args.max_tokens} new tokens, "
          f"one at a time), median {median * 1e3:.2f} ms; py-spy {args.rate} Hz for {args.seconds:.0f} s, GIL holder only")
    total_share = 0.0
    for name, (counts, where, on_thread) in read.items():
        n = sum(counts.values())
        gil_ms = n / args.rate / len(window) * 1e3  # sampled GIL time per request
        lo, hi = wilson(counts["pdwatch"], n)
        wlo, whi = wilson(counts["wrapper"], n)
        share = counts["pdwatch"] / n if n else 0.0
        of_request = share * gil_ms / (median * 1e3)
        total_share += of_request
        print(f"{name}: {n} samples ({gil_ms:.2f} ms of GIL per request); pdwatch {counts['pdwatch']} = "
              f"{share * 100:.2f} % (95 %: {lo * 100:.2f} .. {hi * 100:.2f} %); HookRegistry wrappers "
              f"{counts['wrapper']} = {counts['wrapper'] / n * 100:.2f} % ({wlo * 100:.2f} .. {whi * 100:.2f} %); "
              f"pdwatch's GIL time per request {share * gil_ms * 1e3:.0f} us = {of_request * 100:.2f} % of the median"
              f" (hooks {on_thread['hooks']} samples, recorder thread {on_thread['recorder']})")
        for kind in ("pdwatch", "wrapper"):
            for place, k in [pk for pk in where.most_common() if pk[0].startswith(kind)][:5]:
                print(f"  {k:4d} {place}")
    print(f"both schedulers: pdwatch holds the GIL for {total_share * 100:.2f} % of the median request latency "
          f"(the wrappers, pdwatch's and the testbed's, at most as much again as their shares above)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
