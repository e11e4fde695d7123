"""`pdwatch demo`: the brief's incident in the testbed, watched by pdwatch end to end.

Starts `pdwatch serve` on a free loopback port, Prometheus and Alertmanager
with the repository's rules and routes, and a testbed exporting to the
sidecar: --engine emulated (the default) runs pdwatch's own prefill and two
decodes over NIXL, where decode-0 is restarted alone; --engine sglang runs
real SGLang servers and SGLang's router on this CPU, where the prefill's NIXL
writes to decode-0 stop completing (the request pinned in SGLang's inflight
queue); --engine vllm runs real vLLM servers behind the testbed's PD proxy,
where decode-0's NIXL READs stop completing. It prints live progress; once the
sidecar reports stuck legs while other requests keep completing, it prints
them next to the testbed's own ground truth, then the diagnosis, then waits
for the page to reach the webhook. Exit status 0 means pdwatch caught exactly
what the testbed knows is hung, diagnosed it and paged; anything else says why.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any, cast

from pdwatch import contract as c
from pdwatch.testbed.engines import ENGINES
from pdwatch.testbed.sidecar_process import SidecarProcess

if TYPE_CHECKING:  # imported where they run: numpy, NIXL and the engines load only when needed
    from pdwatch.testbed.gpu_emulation import GpuEmulator
    from pdwatch.testbed.monitoring import Monitoring
    from pdwatch.testbed.stack_base import StackBase

HEADLINE = c.ALERT_STUCK_WHILE_OTHERS_FLOW
# The events that mark a scenario's fault.
FAULT_EVENTS = ("killed", "wedge")


def _progress_line(t: float, summary: dict[str, Any], stuck: list[dict[str, Any]]) -> str:
    clusters = summary.get("clusters", {})
    cl = clusters.get("default") or (next(iter(clusters.values())) if clusters else {})
    finished = cl.get("finished", {})
    ok = sum(v.get("ok", 0) for v in finished.values())
    bad = sum(n for v in finished.values() for k, n in v.items() if k != "ok")
    open_parts = []
    for role, stages in sorted(cl.get("open", {}).items()):
        inner = " ".join(f"{s}={n}" for s, n in stages.items() if n)
        open_parts.append(f"{role}[{inner or '-'}]")
    return f"t={t:5.1f}s  legs finished ok={ok:<4} not ok={bad:<3} open: {' '.join(open_parts) or '-':<48} stuck={len(stuck)}"


def _stuck_table(stuck: list[dict[str, Any]], limit: int = 12) -> str:
    rows = [("TRACE ID", "ROLE", "STAGE", "AGE", "THRESHOLD", "REASON", "INSTANCE", "PEER", "ROOM", "RID")]
    ordered = sorted(stuck, key=lambda s: (-s["stage_age_s"], s["trace_id"], s["role"]))
    for s in ordered[:limit]:
        rows.append((
            s["trace_id"], s["role"], s["stage"], f"{s['stage_age_s']:.1f}s", f"{s['threshold_s']:.0f}s",
            s.get("reason") or "", s.get("pd_instance") or "", s.get("peer") or "", str(s.get("bootstrap_room") or ""), s.get("rid") or "",
        ))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    text = "\n".join("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)
    if len(ordered) > limit:
        text += f"\n... and {len(ordered) - limit} more (GET /api/v1/stuck)"
    return text


def _ok_count(summary: dict[str, Any]) -> int:
    return sum(
        v.get("ok", 0) for cl in summary.get("clusters", {}).values() for v in cl.get("finished", {}).values()
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdwatch demo", description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="emulated", choices=list(ENGINES),
                    help="; ".join(f"{e.name}: {e.summary}" for e in ENGINES.values()) + " (default emulated)")
    ap.add_argument("--scenario", default=None,
                    help="testbed scenario (default: the engine's incident, " + ", ".join(
                        f"{e.incident} {e.name}" for e in ENGINES.values()) + ")")
    ap.add_argument("--rate", type=float, default=None, help="requests per second (default 4 emulated, 2 live)")
    ap.add_argument("--restart-at", type=float, default=8.0,
                    help="seconds after the load starts when the fault happens (default 8)")
    ap.add_argument("--heartbeat-s", type=float, default=1.0, help="engine heartbeat interval (default 1)")
    ap.add_argument("--floor-transfer-s", type=float, default=15.0,
                    help="stuck floor of the transfer stage (default 15, the contract's)")
    ap.add_argument("--timeout-s", type=float, default=90.0, help="give up on detection after this long (default 90)")
    ap.add_argument("--confirm-s", type=float, default=4.0,
                    help="after the first detection, watch this long for completions to go on (default 4)")
    ap.add_argument("--no-alerts", action="store_true",
                    help="skip Prometheus and Alertmanager (detection and diagnosis only)")
    ap.add_argument("--page-timeout-s", type=float, default=150.0,
                    help="after the fault, wait this long for the page to reach the webhook (default 150)")
    ap.add_argument("--report-dir", default="build/demo-report",
                    help="where the incident report of the run goes (default build/demo-report)")
    ap.add_argument("--no-report", action="store_true", help="write no incident report at the end")
    ap.add_argument("--seed", type=int, default=1)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    engine = ENGINES[args.engine]
    live = args.engine != "emulated"
    args.scenario = args.scenario or engine.incident
    scenario = engine.scenario(args.scenario)
    if scenario is None:
        ap.error(f"scenario {args.scenario!r} does not exist for --engine {args.engine} "
                 f"(choose from {', '.join(sorted(engine.catalogue.by_name))})")
    args.rate = args.rate if args.rate is not None else (2.0 if live else 4.0)
    # What the scenario says it should give on this engine: stuck legs (a family), or nothing stuck.
    expect_stuck = scenario.expects_stuck
    env = {c.floor_env("transfer"): str(args.floor_transfer_s), c.ENV_LOG_LEVEL: "warning"}
    # The live servers drive no emulated GPU; the emulated engines do, behind the NVML stub.
    gpus = None if live else _gpu_emulation()
    if gpus is not None:
        env.update(gpus.env())
    print(f"pdwatch demo: {args.engine} engine, scenario {args.scenario}, "
          f"transfer floor {args.floor_transfer_s:.0f} s")
    with SidecarProcess(env=env) as sidecar:
        print(f"sidecar listening on {sidecar.url}")
        monitoring: Monitoring | None = None
        if not args.no_alerts and expect_stuck:
            from pdwatch.testbed.monitoring import Monitoring, MonitoringError

            try:
                monitoring = Monitoring([sidecar.url]).start()
                print(f"Prometheus on {monitoring.prometheus_url}, Alertmanager on {monitoring.alertmanager_url}, "
                      f"pages to a webhook on {monitoring.webhook.url}")
            except MonitoringError as exc:
                print(f"FAIL: cannot start Prometheus and Alertmanager: {exc}")
                return 1
        common = dict(otlp_endpoint=sidecar.url, heartbeat_s=args.heartbeat_s, rate=args.rate,
                      restart_at=args.restart_at, seed=args.seed)
        stack: StackBase
        try:
            kind = engine.launcher()  # imports the engine's stack (numpy, NIXL): keep --help fast
            # The emulated stack alone takes the emulated GPUs.
            stack = kind(args.scenario, **common) if live else cast(Any, kind)(args.scenario, gpus=gpus, **common)
            if engine.starting:
                print(engine.starting, flush=True)
        except ValueError as exc:
            print(f"pdwatch demo: {exc}", file=sys.stderr)
            return 2
        started = time.time()
        try:
            stack.start()
            rc = _watch(args, stack, sidecar, monitoring, expect_stuck)
            if not args.no_report:
                _report(args, sidecar, monitoring, started)
            return rc
        finally:
            stack.stop()
            if monitoring is not None:
                monitoring.stop()


def _report(args: argparse.Namespace, sidecar: SidecarProcess, monitoring: Monitoring | None, started: float) -> None:
    """The run's incident report, from Prometheus when it ran (alert state included), else the sidecar."""
    try:
        from pdwatch.report.write import write_report
        from pdwatch.settings import ClientSettings

        source = {"prometheus": monitoring.prometheus_url} if monitoring is not None else {"sidecar": sidecar.url}
        page = write_report(args.report_dir, ClientSettings.from_sources(source), start=started - 5,
                            end=time.time(), title=f"pdwatch demo: {args.engine} {args.scenario}")
    except (RuntimeError, ValueError, OSError, ImportError) as exc:  # the report is extra: the verdict above stands
        print(f"incident report not written: {exc}")
        return
    print(f"incident report: {page} (PNG plots beside it)")


def _gpu_emulation() -> GpuEmulator | None:
    """Emulated GPUs behind the NVML stub, when the stub is built (make demo builds it)."""
    from pdwatch.testbed.gpu_emulation import GpuEmulator

    try:
        return GpuEmulator.for_demo()
    except OSError:  # the stub is not built: the demo runs without GPU evidence
        return None


def _watch(args: argparse.Namespace, stack: StackBase, sidecar: SidecarProcess,
           monitoring: Monitoring | None, expect_stuck: bool) -> int:
    t0 = time.monotonic()
    detected_at: float | None = None
    ok_at_detection = 0
    stuck: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    fault_at: float | None = None
    while time.monotonic() - t0 < args.timeout_s:
        time.sleep(1.0)
        for event in stack.poll_events():
            if event.get("event") in FAULT_EVENTS and fault_at is None:
                fault_at = event["t"]
            if event.get("event") == "restart":
                print(f"--- testbed: {event.get('instance', 'decode-0')} restarted alone "
                      f"(new NIXL agent; prefill keeps its bootstrap state) ---")
            if event.get("event") == "wedge":
                what = "NIXL READs" if args.engine == "vllm" else "the prefill's NIXL writes to"
                print(f"--- testbed: from now on {what} {event['instance']} "
                      f"(agent {event.get('agent')}) never complete ---")
        summary = sidecar.get("/api/v1/summary")
        stuck = sidecar.get("/api/v1/stuck")
        now = time.monotonic() - t0
        print(_progress_line(now, summary, stuck), flush=True)
        if stuck and detected_at is None:
            detected_at, ok_at_detection = now, _ok_count(summary)
            print(f"--- pdwatch: {len(stuck)} stuck leg(s) detected; watching the others keep flowing ---")
        if detected_at is not None and now - detected_at >= args.confirm_s:
            break
        if not expect_stuck and now >= args.timeout_s / 3:
            break
    if not expect_stuck:
        if stuck:
            print(f"FAIL: scenario {args.scenario} should hang nothing, yet pdwatch reports {len(stuck)} stuck")
            print(_stuck_table(stuck))
            return 1
        print(f"OK: scenario {args.scenario}: {_ok_count(summary)} legs finished, nothing stuck")
        return 0
    if detected_at is None:
        why = "the testbed's fault never happened" if fault_at is None else "no leg was reported stuck"
        print(f"FAIL: nothing detected within {args.timeout_s:.0f} s ({why})")
        return 1
    flowed = _ok_count(summary) - ok_at_detection
    print()
    print(f"Stuck legs ({len(stuck)}), as /api/v1/stuck reports them:")
    print(_stuck_table(stuck))
    truth = stack.truth()
    # The emulated router knows each request's decode; SGLang's router does not say, so there
    # every request sent after the fault and still open counts (those on decode-1 end fast).
    hung = {r.trace_id: r for r in (truth.outstanding_after_restart() if truth.restarts else
                                    [r for r in truth.open if fault_at is not None and r.sent_at >= fault_at])}
    reported = {s["trace_id"] for s in stuck}
    wall = time.time()
    young = {t for t, r in hung.items() if wall - r.sent_at < args.floor_transfer_s + 2 * args.heartbeat_s}
    print()
    print(f"testbed ground truth: {len(hung)} request(s) hung after the fault; pdwatch names {len(reported & hung.keys())} "
          f"of them on both legs, {len(reported - hung.keys())} other(s); {len(young - reported)} more are still younger "
          f"than the {args.floor_transfer_s:.0f} s floor")
    print(f"legs that finished ok after the first detection: {flowed}")
    if flowed <= 0:
        print("FAIL: no request completed after the detection: this is not 'stuck while others flow'")
        return 1
    if reported - hung.keys():
        print("FAIL: pdwatch reported legs the testbed does not consider hung")
        return 1
    missed = set(hung) - reported - young
    if missed:
        print(f"FAIL: {len(missed)} hung request(s) past the floor were not reported")
        return 1
    print("OK: pdwatch named the hung requests while the others kept flowing")
    print()
    from pdwatch.diagnose import render

    print("Diagnosis (pdwatch diagnose):")
    print(render(sidecar.get("/api/v1/diagnosis")))
    if monitoring is None:
        return 0
    return _await_page(args, stack, sidecar, monitoring, fault_at)


def _await_page(args: argparse.Namespace, stack: StackBase, sidecar: SidecarProcess,
                monitoring: Monitoring, fault_at: float | None) -> int:
    print()
    print(f"Waiting for Alertmanager to page {HEADLINE} (5 s for legs stuck on evidence, a minute for legs "
          "past their threshold) ...", flush=True)
    # Counted from the fault; from now when the testbed reported none (the sidecar saw stuck legs first).
    since = time.time() if fault_at is None else fault_at
    deadline = since + args.page_timeout_s
    last = 0.0
    while time.time() < deadline:
        pages = monitoring.webhook.alerts(HEADLINE)
        if pages:
            t, path, alert = pages[0]
            print(f"PAGE received at the webhook {path}, {t - since:.0f} s after the fault:")
            for key, value in sorted(alert["labels"].items()):
                print(f"  {key}={value}")
            notes = alert["annotations"]
            print(f"  summary: {notes.get('summary')}")
            print(f"  description: {notes.get('description')}")
            print(f"  runbook: {notes.get('runbook_url')}")
            others = [name for name in monitoring.alert_names()["firing"] if name != HEADLINE]
            if others:
                print(f"also firing in Prometheus: {', '.join(others)}")
            print("OK: paged")
            return 0
        if time.time() - last >= 10:
            last = time.time()
            names = monitoring.alert_names()  # one request for both states
            print(f"  {time.time() - since:5.0f} s since the fault: stuck={len(sidecar.get('/api/v1/stuck'))}, "
                  f"pending alerts {names['pending'] or '-'}, firing {names['firing'] or '-'}", flush=True)
        time.sleep(1)
    print(f"FAIL: no page within {args.page_timeout_s:.0f} s of the fault")
    return 1

