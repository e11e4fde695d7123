"""pdwatch on a live PD pair of whichever SGLang release is installed: the
supported-version matrix's live leg (`make test-matrix`, in that release's
venv under build/sglang-matrix; `make test` leaves this folder out, since
tests/live covers the pinned release in depth).

What `pdwatch check` says about the release is what the live pair must show:
the plugin state and refused targets every instance heartbeats, every
contract stage recorded on both legs where the lifecycle is hooked, the
transfer-wedge named and paged there, and `PDWatchPluginInactive` firing
wherever the plugin is not `active`.
"""

from __future__ import annotations

import time

import pytest

from pdwatch import contract as c
from pdwatch.engine_patches.sglang import check
from pdwatch.testbed.sglang_pd.servers import BASE_ENV

from ..conftest import FLOORS_S, hook_errors, instances, pages, run_live

pytestmark = [pytest.mark.integration, pytest.mark.live]

# PDWatchPluginInactive's `for` (2 m) after the first heartbeat, and a few evaluations more.
BLIND_WAIT_S = 150.0


@pytest.fixture(scope="module")
def report():
    return check.run_check()


def blind_alerts(world, cluster: str) -> list[dict]:
    return [a for a in world.monitoring.firing()
            if a["labels"]["alertname"] == c.ALERT_PLUGIN_INACTIVE and a["labels"].get("pd_cluster") == cluster]


@pytest.fixture(scope="module")
def healthy(live_world, report):
    """Load for 30 s; where the plugin is not active, the stack stays up until PDWatchPluginInactive fires."""
    started = time.monotonic()
    blind = report["state"] != c.PLUGIN_ACTIVE
    seen: dict[str, list] = {"blind": []}

    def until(run) -> bool:
        if time.monotonic() - started < 40:
            return False
        if not blind:
            return True
        seen["blind"] = blind_alerts(live_world, run.cluster)
        return bool(seen["blind"])

    run = run_live(live_world, "healthy", seconds=30.0, rate=2.0, until=until,
                   grace_s=BLIND_WAIT_S + 60 if blind else 30.0)
    return run, live_world, seen


def test_the_release_is_the_one_checked(report):
    import sglang

    assert report["sglang"] == sglang.__version__, report["sglang"]
    print(check.render(report))


def test_every_instance_heartbeats_the_state_check_predicts(healthy, report):
    run, _world, _seen = healthy
    insts = instances(run)
    assert set(insts) == {"prefill-0", "decode-0", "decode-1"}, set(insts)
    for name, inst in insts.items():
        assert inst["up"], (name, inst["state"])
        assert inst["engine_version"] == report["sglang"], (name, inst["engine_version"])
        assert inst["plugin_state"] == report["state"], (name, inst["plugin_state"], report["state"])
        # The plugin refuses, at start-up, what the check refuses (each role: the targets it imports).
        assert set(inst["plugin_refused"]) <= set(report["refused"]), (name, inst["plugin_refused"])
        assert bool(inst["plugin_refused"]) == (report["state"] != c.PLUGIN_ACTIVE), (name, inst["plugin_refused"])


def test_requests_are_served_and_nothing_is_named(healthy):
    run, _world, _seen = healthy
    assert run.truth.requests and all(r.outcome == "ok" for r in run.truth.requests if r.done_at), \
        [(r.outcome, r.reason) for r in run.truth.requests if r.outcome != "ok"][:5]
    assert not run.stuck_ever(), run.stuck_told()
    assert not run.families(), run.families()


def test_no_hook_error_on_any_rank(healthy):
    run, _world, _seen = healthy
    errors = hook_errors(run)
    assert errors and all(n == 0 for n in errors.values()), errors


def test_where_the_lifecycle_is_hooked_both_legs_walk_every_stage(healthy, report):
    run, world, _seen = healthy
    done = [r for r in run.truth.requests if r.outcome == "ok" and r.traceparent]
    assert len(done) >= 10
    for rec in done[:10]:
        detail = world.sidecar.get(f"/api/v1/requests/{rec.trace_id}")
        legs = {leg["role"]: leg for leg in detail.get("legs", [])}
        if not report["lifecycle"]:
            assert legs == {}, legs  # heartbeats only: no leg is ever opened
            continue
        assert set(legs) == {"prefill", "decode"}, detail
        for role, leg in legs.items():
            assert leg["outcome"] == "ok"
            assert [s["stage"] for s in leg["stages"]] == list(c.STAGES[role]), (role, leg["stages"])


def test_a_plugin_not_active_fires_plugin_inactive(healthy, report):
    run, world, seen = healthy
    if report["state"] == c.PLUGIN_ACTIVE:
        assert not blind_alerts(world, run.cluster)
        return
    fired = seen["blind"]
    assert fired, [a["labels"] for a in world.monitoring.alerts()]
    assert {a["labels"][c.L_PLUGIN_STATE] for a in fired} == {report["state"]}
    assert {a["labels"][c.L_ENGINE_VERSION] for a in fired} == {report["sglang"]}
    assert {a["labels"]["severity"] for a in fired} == {"warning"}


@pytest.fixture(scope="module")
def transfer_wedge(live_world, report):
    if not report["lifecycle"]:
        pytest.fail(f"the plugin records no lifecycle on SGLang {report['sglang']}: `make test-matrix` runs "
                    "this module only on releases whose check state is active or partial")

    def until(run) -> bool:
        wedge = run.event("wedge")
        return (wedge is not None and time.time() > wedge["t"] + FLOORS_S["transfer"] + 5
                and bool(pages(live_world, run)))

    run = run_live(live_world, "transfer-wedge", seconds=150.0, rate=2.0, restart_at=8.0, until=until)
    return run, live_world


def test_transfer_wedge_names_legs_stuck_in_transfer_and_pages(transfer_wedge):
    run, world = transfer_wedge
    wedge = run.event("wedge")
    assert wedge is not None and wedge["agent"], run.events
    stuck = run.stuck_ever()
    seen = sorted({(s["role"], s["stage"], s["pd_instance"], s["reason"]) for s in stuck})
    print("stuck:", seen)
    prefill = {s["rid"]: s for s in stuck if s["role"] == "prefill" and s["stage"] == "transfer"}
    assert prefill, seen
    first = min(prefill.values(), key=lambda s: s["stage_since_unix_s"])
    assert first["peer"] == wedge["agent"], first
    # A prefill's KV writes go through one of SGLANG_DISAGGREGATION_QUEUE_SIZE transfer workers. 0.5.23
    # picks it by destination, so a wedged decode blocks its own worker; earlier releases pick it by
    # room, so a write to the healthy decode whose room shares a worker with a wedged write waits
    # behind it, and is stuck too. Any stuck write to another agent must be one of those.
    shards = int(BASE_ENV["SGLANG_DISAGGREGATION_QUEUE_SIZE"])
    wedged = {s["bootstrap_room"] % shards for s in prefill.values() if s["peer"] == wedge["agent"]}
    behind = [s for s in prefill.values() if s["peer"] != wedge["agent"]]
    print(f"stuck prefill writes: {len(prefill)}, to the wedged agent {len(prefill) - len(behind)}, "
          f"to another behind a wedged write's worker {len(behind)}")
    assert all(s["bootstrap_room"] % shards in wedged for s in behind), [
        (s["peer"], s["bootstrap_room"] % shards) for s in behind]
    assert any(r.outcome == "ok" and r.sent_at >= wedge["t"] + 1 for r in run.truth.requests), \
        "requests to decode-1 stopped completing"
    leading = [d["family"] for p in run.polls for d in p["diagnosis"]]
    assert leading and leading[0] == "transfer_wedge", leading
    paged = pages(world, run)
    assert paged, [a["labels"] for a in world.monitoring.firing()]
    t, alert = paged[0]
    assert alert["labels"]["stage"] == "transfer" and alert["labels"]["severity"] == "critical"
    named = run.first(lambda p: p["stuck"])
    print(f"first named {named['t'] - wedge['t']:.1f} s after the wedge "
          f"({sorted({s['reason'] for s in named['stuck']})}); paged {t - wedge['t']:.1f} s after it")
