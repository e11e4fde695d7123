"""The live SGLang PD pair, the testbed of record: shared pieces for its tests.

One `pdwatch serve` (forwarding lifecycle spans to an OTLP receiver the tests
read), Debian's Prometheus and Alertmanager on the repository's rules, and one
live stack at a time (it takes most of both cores). Each scenario runs as its
own cluster, watched by a poller that keeps every answer of the sidecar's API.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from dataclasses import dataclass, field

import pytest

from pdwatch import contract as c
from pdwatch.testbed.sidecar_process import SidecarProcess
from tests.support.otlp_receiver import OtlpReceiver

# The plugin's default (contract DEFAULT_HEARTBEAT_S). The evidence rules scale with it: a loop is frozen
# past 2 intervals, an instance down past 3. At 1 s a loaded 2-core machine once held a prefill pass 3.5 s,
# past the 2 s loop rule, and once starved a heartbeat past 3 s: pages no production interval would give.
HEARTBEAT_S = c.DEFAULT_HEARTBEAT_S
# transfer: the production default (contract DEFAULT_FLOORS_S), so that in the transfer-wedge the
# overtaken evidence (about 6 s after the wedge here) names the first stuck leg, as it would in production,
# before the threshold does.
# decode: above the loop rule (2 heartbeats) plus a heartbeat, so a frozen decode loop is named on its
# evidence before its legs' threshold; low enough that a long generation outlives it in seconds.
FLOORS_S = {"bootstrap": 10.0, "queued": 20.0, "prefill": 20.0, "transfer": 15.0, "decode": 8.0}
FLOW_WINDOW_S = 60.0
POLL_S = 0.5
READ_TIMEOUT_S = 60.0


def _missing() -> str | None:
    for module in ("sglang", "sglang_router", "nixl"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (make test installs it: the sglang and testbed extras, in requirements.lock)"
    return None


@pytest.fixture(scope="session")
def live_world():
    """A sidecar, its trace store stand-in, and Prometheus + Alertmanager, for every live module."""
    reason = _missing()
    if reason:
        pytest.fail(reason)
    yield from _world()


def _world():
    from pdwatch.testbed.monitoring import Monitoring

    env = {f"PDWATCH_FLOOR_{stage.upper()}_S": str(s) for stage, s in FLOORS_S.items()}
    with OtlpReceiver() as receiver:
        env.update({"PDWATCH_FORWARD_OTLP_ENDPOINT": receiver.url, "PDWATCH_LOG_LEVEL": "warning",
                    "PDWATCH_EVALUATE_INTERVAL_S": "0.25", "PDWATCH_NVML": "off",
                    # Stacks of an engine whose legs stick or whose loop freezes (its PIDs are on this host).
                    "PDWATCH_CAPTURE": "py-spy"})
        with SidecarProcess(env=env) as sidecar, Monitoring([sidecar.url]) as monitoring:
            yield World(sidecar, receiver, monitoring)


@dataclass
class World:
    sidecar: SidecarProcess
    receiver: OtlpReceiver
    monitoring: object


@dataclass
class Run:
    """What one live scenario showed: the sidecar's answers over time, events, and the client's truth."""

    cluster: str
    stack: object
    polls: list[dict] = field(default_factory=list)  # {"t", "stuck", "diagnosis"} for this cluster
    events: list[dict] = field(default_factory=list)
    truth: object = None
    summary: dict = field(default_factory=dict)  # /api/v1/summary just before the stack stopped
    metrics: str = ""  # /metrics then
    logs: dict = field(default_factory=dict)  # each server's last log lines then
    agents: dict = field(default_factory=dict)  # each server's NIXL agent name then
    legs: list = field(default_factory=list)  # every request's legs from /api/v1/requests, where a test reads them

    def event(self, name: str) -> dict | None:
        return next((e for e in self.events if e["event"] == name), None)

    def first(self, predicate) -> dict | None:
        return next((p for p in self.polls if predicate(p)), None)

    def stuck_ever(self) -> list[dict]:
        return [leg for p in self.polls for leg in p["stuck"]]

    def families(self) -> set[str]:
        return {d["family"] for p in self.polls for d in p["diagnosis"]}

    def stuck_told(self, limit: int = 5) -> list[str]:
        """The first judgement of each leg ever stuck, in words a failing assert can show in full."""
        seen: dict[str, str] = {}
        for p in self.polls:
            for s in p["stuck"]:
                key = f"{s['trace_id']}/{s['role']}"
                if key not in seen:
                    seen[key] = (f"{s['pd_instance']} {s['role']} {s['stage']} {s['reason']} "
                                 f"age {s['stage_age_s']} s > {s['threshold_s']} s: {s.get('why')}")
        return list(seen.values())[:limit]


class Poller:
    """Reads /api/v1/stuck and /api/v1/diagnosis every POLL_S for one cluster, on a thread."""

    def __init__(self, sidecar: SidecarProcess, run: Run):
        self.sidecar, self.run = sidecar, run
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="live-poller", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                stuck = [s for s in self.sidecar.get("/api/v1/stuck") if s["cluster"] == self.run.cluster]
                diagnosis = [d for d in self.sidecar.get("/api/v1/diagnosis")
                             if d["cluster"] == self.run.cluster and d.get("family")]
            except Exception:
                continue
            self.run.polls.append({"t": time.time(), "stuck": stuck, "diagnosis": diagnosis})
            self.run.events.extend(self.run.stack.poll_events())

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


def run_live(world: World, scenario: str, *, seconds: float, until=None, grace_s: float = 5.0,
             engine: str = "sglang", heartbeat_s: float = HEARTBEAT_S, **stack_args) -> Run:
    """Start the scenario's live stack (testbed/engines.py's `engine`) as cluster live-<scenario>
    (live-vllm-<scenario> for vLLM), send `seconds` of load and watch it for `grace_s` more (or until
    `until(run)` holds), then stop it. The stack's events and truth stay in the Run."""
    from pdwatch.testbed.engines import get

    cluster = f"live-{scenario}" if engine == "sglang" else f"live-{engine}-{scenario}"
    stack = get(engine).launcher()(scenario, otlp_endpoint=world.sidecar.url, heartbeat_s=heartbeat_s,
                                   cluster=cluster, duration_s=seconds, decode_floor_s=FLOORS_S["decode"],
                                   **stack_args)
    run = Run(cluster, stack)
    try:
        stack.start()
        with Poller(world.sidecar, run):
            deadline = time.monotonic() + seconds + grace_s
            while time.monotonic() < deadline:
                if until is not None and until(run):
                    break
                time.sleep(POLL_S)
        run.events.extend(stack.poll_events())
        run.truth = stack.truth()
        # Once, at the end, with time to answer: a sidecar holding a wedge's legs on a starved CPU
        # took over the client's 5 s once (the poller's reads may fail; these may not).
        run.summary = world.sidecar.get("/api/v1/summary", timeout=READ_TIMEOUT_S)
        run.metrics = world.sidecar.client.get("/metrics", timeout=READ_TIMEOUT_S).text
        run.logs = {name: stack.logs(name, 400) for name in stack.engines}
        run.agents = stack.agents()
    finally:
        stack.stop()
    return run


# ---- readers of a finished run, shared by the live modules ------------------------------------

HEADLINE = "PDRequestStuckWhileOthersFlow"


def instances(run: Run) -> dict[str, dict]:
    """The run's cluster's instances, by name, from /api/v1/summary as read just before the stack stopped."""
    return {i["pd_instance"]: i for i in run.summary["instances"] if i["cluster"] == run.cluster}


def hook_errors(run: Run) -> dict[str, int]:
    return {name: rank["engine"].get(c.H_HOOK_ERRORS, 0)
            for name, inst in instances(run).items() for rank in inst["ranks"]}


def pages(world: World, run: Run) -> list[tuple[float, dict]]:
    """When Alertmanager's webhook received the headline page for this run's cluster, and the alert."""
    return [(t, a) for t, _p, a in world.monitoring.webhook.alerts(HEADLINE) if a["labels"].get("pd_cluster") == run.cluster]
