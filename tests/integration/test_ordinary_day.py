"""An ordinary day of PD clusters pages nothing; an incident in the same run still pages.

One real `pdwatch serve` with the incident tests' floors, Debian's
Prometheus with alerts/pdwatch-alerts.yml, Alertmanager with
alerts/alertmanager.example.yml and a webhook receiver. Each ordinary-day
scenario of the emulated testbed runs as its own cluster, all at once, beside
the `decode-restart` incident; a second sidecar that no engine reports to is
scraped by the same Prometheus (a GPU node that runs no engine). A watch
(`testbed.day_watch`) records, at every judge tick it sees (about twice a
second), the stuck legs, every critical alert Prometheus holds (pending or
firing), the pager's notifications and each instance's state; the tests assert
over every poll. About 4 minutes on 2 cores.

The idle spell maps an hour onto seconds: the sidecar's flow window is 10 s
here (60 s by default) and the idle lasts 130 s, 13 flow windows and longer than
the rules' longest range (2 m). The thresholds' 10-minute window is the
contract's and no setting shortens it; after an idle that long the thresholds
are the floors again, which is how every cluster here starts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from pdwatch.testbed import ordinary_day
from pdwatch.testbed.day_watch import DayWatch, Poll
from pdwatch.testbed.monitoring import Monitoring
from pdwatch.testbed.router import Truth
from pdwatch.testbed.sidecar_process import SidecarProcess

pytestmark = pytest.mark.integration

# The plan's settings (testbed/ordinary_day.py): the floors as tests/integration/test_alerting.py's;
# heartbeats at 1 s rather than its 0.5 s (the default is 2 s): seven clusters at once on two cores once
# starved a 0.5 s heartbeat past the 1.5 s after which an instance is down, and a draining queue's decode
# then read as silent while it held legs.
HEARTBEAT_S, FLOOR_TRANSFER_S = ordinary_day.HEARTBEAT_S, ordinary_day.FLOOR_TRANSFER_S
FLOOR_DECODE_S, FLOW_WINDOW_S = ordinary_day.FLOOR_DECODE_S, ordinary_day.FLOW_WINDOW_S
RESTART_AT, IDLE_S = ordinary_day.RESTART_AT, ordinary_day.IDLE_S
ORDINARY = ordinary_day.PLAN
HEADLINE = "PDRequestStuckWhileOthersFlow"
RUN_LIMIT_S = 330.0  # every cluster's own end comes well before

INCIDENT = "decode-restart"  # run as cluster "incident"


@dataclass
class Day:
    polls: list[Poll]
    events: dict[str, list[dict[str, Any]]]
    truths: dict[str, Truth]
    quiet_scraped: bool
    poll_errors: list[str]
    started_at: float  # wall clock before the first cluster started
    ended_at: float  # wall clock once every cluster showed what it came for (or the run's limit)
    ends: dict[str, float] = field(default_factory=dict)  # cluster -> seconds into the run it did


def _done(cluster: str, stack: Any, poll: Poll | None) -> bool:
    """Whether a cluster showed what it came for (its load over and every request ended, and more)."""
    if cluster == "incident":
        return poll is not None and any(a["labels"].get("alertname") == HEADLINE for a in poll.pages_in(cluster))
    if not (stack.load_done and not stack.truth().open):
        return False
    if cluster == "kill-idle":  # its warning needs the rule's `for: 1m` after the kill
        return poll is not None and bool(poll.alerts_named("PDEngineSilent", cluster, "warning"))
    return True


def _run() -> Day:
    from pdwatch.testbed.stack import Stack

    env = {"PDWATCH_FLOOR_TRANSFER_S": str(FLOOR_TRANSFER_S), "PDWATCH_FLOOR_DECODE_S": str(FLOOR_DECODE_S),
           "PDWATCH_FLOW_WINDOW_S": str(FLOW_WINDOW_S), "PDWATCH_LOG_LEVEL": "warning",
           "PDWATCH_EVALUATE_INTERVAL_S": "0.25", "PDWATCH_NVML": "off"}
    t0 = time.monotonic()
    stacks: dict[str, Any] = {}
    events: dict[str, list[dict[str, Any]]] = {}
    ends: dict[str, float] = {}
    with SidecarProcess(env=env) as sc, SidecarProcess(env=env) as quiet, Monitoring([sc.url, quiet.url]) as mon:
        watch = DayWatch(sc, mon, quiet=[quiet.url]).start()
        watch.wait_for(lambda p: True, 10.0)
        started_at = time.time()
        try:
            plan = [(name, name, *spec) for name, spec in ORDINARY.items()]
            plan.append(("incident", INCIDENT, 2.0, 120.0, {}))
            # Distinct seeds: the routers' rooms, hence trace ids, must not repeat across clusters.
            for seed, (cluster, scenario, rate, duration_s, tuning) in enumerate(plan, start=1):
                stack = Stack(scenario, otlp_endpoint=sc.url, heartbeat_s=HEARTBEAT_S, rate=rate,
                              restart_at=RESTART_AT, cluster=cluster, decode_floor_s=FLOOR_DECODE_S,
                              duration_s=duration_s, seed=seed, tuning=tuning)
                stack.start()
                stacks[cluster] = stack
                events[cluster] = []
                watch.watch(cluster, stack)
            deadline = time.monotonic() + RUN_LIMIT_S
            while time.monotonic() < deadline and len(ends) < len(stacks):
                poll = watch.latest()
                for cluster, stack in stacks.items():
                    events[cluster] += stack.poll_events()
                    if cluster not in ends and _done(cluster, stack, poll):
                        ends[cluster] = time.monotonic() - t0
                time.sleep(0.5)
            ended_at = time.time()
            # One more judge tick after the last cluster ended, so the record covers it.
            watch.wait_for(lambda p: True, 10.0)
            quiet_scraped = bool(mon.query(f'up{{instance="{watch.quiet[0]}"}} == 1'))
        finally:
            watch.stop()
            for stack in stacks.values():
                stack.stop()
    for cluster, stack in stacks.items():
        events[cluster] += stack.poll_events()
    return Day(polls=watch.snapshot(), events=events, truths={k: s.truth() for k, s in stacks.items()},
               quiet_scraped=quiet_scraped, poll_errors=watch.errors, started_at=started_at, ended_at=ended_at,
               ends=ends)


@pytest.fixture(scope="module")
def day() -> Day:
    day = _run()
    unfinished = sorted((set(ORDINARY) | {"incident"}) - set(day.ends))
    last = day.polls[-1] if day.polls else None
    assert not unfinished, (
        f"not done within {RUN_LIMIT_S:.0f} s: {unfinished}; ends {day.ends}; {len(day.polls)} polls, the last "
        f"{time.time() - last.t if last else float('nan'):.0f} s ago; watch errors {day.poll_errors[:3]}; "
        f"last poll: stuck {[(s['cluster'], s['role'], s['reason']) for s in last.stuck][:6] if last else None}, "
        f"alerts {[(a.get('alertname'), a.get('pd_cluster'), a.get('alertstate')) for a in last.alerts] if last else None}, "
        f"pages {[a['labels'] for a in last.pages] if last else None}; events {day.events['incident'][:6]}")
    return day


def _every_poll(day: Day, what: str, bad: Any) -> None:
    """Fail naming the first polls where bad(poll, cluster) found something, for any ordinary cluster."""
    found = [(round(p.t - day.polls[0].t, 1), cluster, got) for p in day.polls for cluster in ORDINARY
             if (got := bad(p, cluster))]
    assert not found, f"{what} at {len(found)} poll(s), first: {found[:3]}"


def _event(day: Day, cluster: str, name: str) -> list[dict[str, Any]]:
    return [e for e in day.events[cluster] if e["event"] == name]


def _state_polls(day: Day, cluster: str, instance: str) -> list[tuple[Poll, dict[str, Any]]]:
    return [(p, p.instances[(cluster, instance)]) for p in day.polls if (cluster, instance) in p.instances]


def test_the_watch_polled_a_new_judge_tick_about_every_second_from_first_start_to_last_end(day):
    assert day.polls[0].t <= day.started_at and day.polls[-1].t >= day.ended_at
    gaps = [b.t - a.t for a, b in zip(day.polls, day.polls[1:])]
    assert len(day.polls) >= (day.ended_at - day.started_at) / 2 and max(gaps) < 8, (len(day.polls), max(gaps))
    assert all(b.judged_at > a.judged_at for a, b in zip(day.polls, day.polls[1:]))  # a new tick each time


def test_no_ordinary_cluster_has_a_stuck_leg_at_any_poll(day):
    _every_poll(day, "stuck legs", lambda p, cluster: p.stuck_in(cluster))


def test_no_critical_alert_is_pending_or_firing_for_an_ordinary_cluster_at_any_poll(day):
    _every_poll(day, "critical alerts", lambda p, cluster: p.critical_in(cluster))


def test_the_pager_hears_nothing_of_an_ordinary_cluster(day):
    _every_poll(day, "pages", lambda p, cluster: p.pages_in(cluster))
    assert {a["labels"].get("pd_cluster") for a in day.polls[-1].pages} <= {"incident"}


def test_the_incident_in_the_same_run_still_pages(day):
    pages = day.polls[-1].pages_in("incident")
    assert any(a["labels"]["alertname"] == HEADLINE and a["labels"]["severity"] == "critical" for a in pages), pages
    assert _event(day, "incident", "restart")
    # The watch sees what it asserts the ordinary clusters never show: stuck legs and critical alerts.
    assert any(p.stuck_in("incident") for p in day.polls) and any(p.critical_in("incident") for p in day.polls)


def test_a_sidecar_that_hears_from_no_engine_raises_nothing(day):
    assert day.quiet_scraped
    found = [(round(p.t - day.polls[0].t, 1), p.quiet_alerts) for p in day.polls if p.quiet_alerts]
    assert not found, found[:3]


def test_scale_down_departs_and_is_never_down(day):
    (down,) = _event(day, "scale-down", "scale_down")
    assert down["drained"] and down["exited"]
    states = _state_polls(day, "scale-down", "decode-0")
    assert states and all(s["state"] != "down" for _p, s in states), {s["state"] for _p, s in states}
    assert states[-1][1]["state"] == "departed"
    assert any(p.t >= down["t"] and s["state"] == "departed" for p, s in states)
    truth = day.truths["scale-down"]
    assert all(r.outcome == "ok" for r in truth.requests), [r for r in truth.requests if r.outcome != "ok"][:3]
    (left,) = _event(day, "scale-down", "left")
    after = [r for r in truth.requests if r.sent_at > left["t"]]
    assert len(after) >= 10 and {r.decode for r in after} == {"decode-1"}


def test_scale_up_serves_on_the_new_decode(day):
    (up,) = _event(day, "scale-up", "scale_up")
    assert up["instance"] == "decode-2" and up["served"]
    truth = day.truths["scale-up"]
    assert sum(r.decode == "decode-2" and r.outcome == "ok" for r in truth.requests) >= 5
    assert all(r.outcome == "ok" for r in truth.requests)
    assert any(s["state"] == "up" for _p, s in _state_polls(day, "scale-up", "decode-2"))


def test_rolling_restart_restarts_every_decode_in_order_and_each_serves_again(day):
    restarts = _event(day, "rolling-restart", "restart")
    assert [e["instance"] for e in restarts] == ["decode-0", "decode-1"]
    for e in restarts:
        assert e["orderly"] and e["drained"] and e["exited"] and e["served"], e
        assert e["new_agent"] != e["old_agent"]
    truth = day.truths["rolling-restart"]
    assert not truth.outstanding_after_restart()
    assert all(r.outcome == "ok" for r in truth.requests)
    for e in restarts:
        after = [r for r in truth.requests if r.decode == e["instance"] and r.sent_at > e["t"]]
        assert len(after) >= 3 and all(r.outcome == "ok" for r in after)
        assert all(s["state"] != "down" for _p, s in _state_polls(day, "rolling-restart", e["instance"]))


def test_a_decode_killed_while_idle_is_down_with_nothing_open_and_warns_only(day):
    (kill,) = _event(day, "kill-idle", "kill_idle")
    assert kill["idle"], kill
    states = _state_polls(day, "kill-idle", "decode-0")
    down = [s for p, s in states if s["state"] == "down"]
    assert down and all(s["open_at_silence"] == 0 for s in down)
    assert any(p.alerts_named("PDEngineSilent", "kill-idle", "warning") for p in day.polls)
    assert not any(p.critical_in("kill-idle") for p in day.polls)
    truth = day.truths["kill-idle"]
    assert all(r.outcome == "ok" for r in truth.requests)  # the router sent it nothing it could lose


def test_overload_queues_far_above_normal_then_drains_in_full(day):
    (start,) = _event(day, "overload", "overload")
    (end,) = _event(day, "overload", "overload_end")
    before = [p.open.get("overload", 0) for p in day.polls if p.t < start["t"]]
    during = [p.open.get("overload", 0) for p in day.polls if start["t"] <= p.t <= end["t"] + 30]
    assert before and during and max(during) >= 10 * max(1, max(before)), (max(before), max(during))
    truth = day.truths["overload"]
    waits = sorted(r.done_at - r.sent_at for r in truth.requests if r.done_at and r.sent_at < start["t"])
    late = [r.done_at - r.sent_at for r in truth.requests if r.done_at and start["t"] <= r.sent_at <= end["t"]]
    assert waits and max(late) >= 10 * waits[len(waits) // 2], (waits[len(waits) // 2], max(late))
    assert all(r.outcome == "ok" for r in truth.requests), [r for r in truth.requests if r.outcome != "ok"][:3]


def test_traffic_after_an_idle_spell_longer_than_the_windows_completes(day):
    (idle,) = _event(day, "idle", "idle")
    (resumed,) = _event(day, "idle", "idle_end")
    assert resumed["t"] - idle["t"] >= IDLE_S - 1
    quiet = [p for p in day.polls if idle["t"] + FLOW_WINDOW_S + 2 < p.t < resumed["t"]]
    assert quiet and not any(p.flowing.get("idle") for p in quiet)  # the flow window passed with nothing
    truth = day.truths["idle"]
    after = [r for r in truth.requests if r.sent_at >= resumed["t"]]
    assert len(after) >= 10 and all(r.outcome == "ok" for r in after)
    assert not [r for r in truth.requests if idle["t"] + 1 < r.sent_at < resumed["t"] - 1]
