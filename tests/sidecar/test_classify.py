"""The classifier on hand-built facts: each family's evidence, and silence when healthy."""

from __future__ import annotations

from pdwatch.sidecar.diagnosis.classify import classify, verdict
from pdwatch.sidecar.diagnosis.facts import ClusterFacts, GpuFacts, InstanceFacts

IDLE = [GpuFacts("0", "GPU-a", 0.0, 163.0, 700.0), GpuFacts("1", "GPU-b", 0.01, 165.0, 700.0)]
BUSY = [GpuFacts("2", "GPU-c", 0.99, 310.0, 700.0), GpuFacts("3", "GPU-d", 1.0, 305.0, 700.0)]
WORKING = [GpuFacts("4", "GPU-e", 0.7, 520.0, 700.0)]


def inst(name, role, *, up=True, stalled=False, start=1000.0, restarts=0, restart_age=None, ok=10, open_legs=2,
         stuck=None, gpus=(), kv_used=None):
    return InstanceFacts(name, role, up, 0.5 if up else 12.0, stalled, start, restarts, restart_age, ok, open_legs,
                         dict(stuck or {}), list(gpus), kv_used=kv_used)


def cluster(instances, *, ok=None, stuck=None, open_legs=None):
    stuck = stuck or {}
    for i in instances:
        for stage, n in i.stuck.items():
            stuck[(i.role, stage)] = stuck.get((i.role, stage), 0) + n
    return ClusterFacts(
        "default", 60.0,
        sum(i.finished_ok_recent for i in instances) if ok is None else ok,
        sum(i.open_legs for i in instances) if open_legs is None else open_legs,
        stuck, {k: 42.0 for k in stuck}, {k: 15.0 for k in stuck}, instances, gpu_telemetry_up=True,
    )


def families(facts):
    return [f.family for f in classify(facts)]


def test_healthy_cluster_gets_no_family():
    facts = cluster([inst("prefill-0", "prefill", gpus=WORKING), inst("decode-0", "decode", gpus=WORKING)])
    assert families(facts) == []
    assert verdict(facts)["family"] is None


def test_the_incident_is_a_transfer_wedge_after_a_restart_skew_with_the_collective_ruled_out():
    facts = cluster([
        inst("prefill-0", "prefill", start=1000, stuck={"transfer": 2}, gpus=WORKING),
        inst("decode-0", "decode", start=1600, restarts=1, restart_age=30, ok=0, stuck={"transfer": 2}, gpus=IDLE),
        inst("decode-1", "decode", start=1000, gpus=WORKING),
    ])
    v = verdict(facts)
    assert v["family"] == "transfer_wedge" and v["confidence"] >= 0.9
    text = " ".join(v["evidence"])
    assert "4 leg(s) stuck in transfer" in text and "threshold 15 s" in text
    assert "GPU 0,1 at 0 % utilization and 164 W of 700 W" in text and "not a stuck collective" in text
    assert [f["family"] for f in v["findings"]] == ["transfer_wedge", "restart_skew"]
    skew = " ".join(v["findings"][1]["evidence"])
    assert "decode decode-0 was restarted alone" in skew and "600 s after prefill prefill-0" in skew
    assert "co-restart the PD pair" in v["action"]


def test_busy_gpus_under_a_frozen_loop_are_a_collective_desync():
    facts = cluster([
        inst("prefill-0", "prefill", gpus=WORKING),
        inst("decode-0", "decode", stalled=True, ok=0, stuck={"decode": 3}, gpus=BUSY),
        inst("decode-1", "decode", gpus=WORKING),
    ])
    v = verdict(facts)
    assert v["family"] == "collective_desync"
    assert "GPU 2,3 at 100 % utilization" in v["evidence"][0]
    assert "transfer_wedge" not in families(facts)


def test_a_silent_engine():
    facts = cluster([inst("prefill-0", "prefill"), inst("decode-0", "decode", up=False, ok=0, open_legs=4)])
    v = verdict(facts)
    assert v["family"] == "engine_silent"
    assert "decode decode-0: no heartbeat for 12 s" in v["evidence"][0]


def test_legs_stuck_against_a_frozen_decode_lead_with_the_silent_engine_not_a_wedge():
    # freeze-decode caught mid-transfer: the prefill's leg waits on a decode that
    # sends nothing, whose GPU reads idle. That looks like the incident's wedge,
    # but co-restarting the pair would be the wrong action: the frozen engine leads.
    facts = cluster([
        inst("prefill-0", "prefill", stuck={"transfer": 1, "bootstrap": 2}, gpus=WORKING),
        inst("decode-0", "decode", up=False, ok=0, open_legs=3, gpus=IDLE),
        inst("decode-1", "decode", open_legs=0, gpus=WORKING),
    ])
    v = verdict(facts)
    assert v["family"] == "engine_silent", v
    ranked = {f["family"]: f for f in v["findings"]}
    assert ranked["transfer_wedge"]["confidence"] < ranked["engine_silent"]["confidence"]
    assert "decode decode-0 sent no heartbeat" in " ".join(ranked["transfer_wedge"]["evidence"])
    assert "bootstrap_wedge" not in ranked  # demoted below the report line
    # The same stuck legs with every engine up are the wedge again.
    facts.instances[1].up = True
    assert verdict(facts)["family"] == "transfer_wedge"


def test_kv_starvation_is_queue_starvation_not_a_bootstrap_wedge():
    facts = cluster([inst("prefill-0", "prefill"), inst("decode-0", "decode", ok=25, stuck={"bootstrap": 3})])
    assert families(facts) == ["queue_starvation"]
    assert "waiting for KV memory while it finished 25 other leg(s) ok" in verdict(facts)["evidence"][0]


def test_a_decode_whose_engine_says_its_kv_pool_is_full_leads_with_kv_starvation():
    full = cluster([inst("prefill-0", "prefill"),
                    inst("decode-0", "decode", ok=25, stuck={"bootstrap": 3}, kv_used=0.97)])
    v = verdict(full)
    assert v["family"] == "kv_starvation" and v["confidence"] == 0.85
    assert [f["family"] for f in v["findings"]] == ["kv_starvation", "queue_starvation"]
    assert v["evidence"] == ["decode decode-0: 3 leg(s) stuck in bootstrap, waiting for KV memory, while its KV pool "
                             "is 97 % full and it finished 25 other leg(s) ok in the last 60 s"]
    assert "KV pool is full" in v["action"]
    # Both sides of the line: just under it, or a pool the engine does not report, is queue_starvation alone.
    for kv_used in (0.89, None):
        facts = cluster([inst("prefill-0", "prefill"),
                         inst("decode-0", "decode", ok=25, stuck={"bootstrap": 3}, kv_used=kv_used)])
        assert families(facts) == ["queue_starvation"], kv_used
    # A full pool on a decode that finishes nothing is no starvation: nothing flows there to wait behind.
    idle = cluster([inst("prefill-0", "prefill"),
                    inst("decode-0", "decode", ok=0, stuck={"bootstrap": 3}, kv_used=0.97)])
    assert "kv_starvation" not in families(idle)
    # Behind a transfer wedge on the same decode, the wedge leads.
    behind = cluster([inst("prefill-0", "prefill", stuck={"transfer": 3}),
                      inst("decode-0", "decode", ok=4, stuck={"transfer": 3, "bootstrap": 6}, kv_used=0.99),
                      inst("decode-1", "decode")])
    found = {f.family: f for f in classify(behind)}
    assert found["kv_starvation"].confidence < found["transfer_wedge"].confidence
    assert "downstream of a transfer wedge" in " ".join(found["kv_starvation"].evidence)


def test_bootstrap_stuck_on_an_instance_that_serves_nobody_is_a_bootstrap_wedge():
    facts = cluster([inst("prefill-0", "prefill", stuck={"bootstrap": 2}, ok=0),
                     inst("decode-0", "decode", ok=8)])
    assert families(facts) == ["bootstrap_wedge"]


def test_nothing_flowing_is_a_total_wedge_and_the_gpus_say_what_it_resembles():
    facts = cluster([inst("prefill-0", "prefill", ok=0, stuck={"transfer": 3}, gpus=WORKING),
                     inst("decode-0", "decode", ok=0, stuck={"transfer": 3}, gpus=IDLE)])
    v = verdict(facts)
    assert v["family"] == "total_wedge"
    assert "resembles a transfer or bootstrap wedge" in " ".join(v["evidence"])
    assert "transfer_wedge" not in families(facts)  # that one needs others flowing


def test_a_restart_without_trouble_is_not_a_finding():
    facts = cluster([inst("prefill-0", "prefill", start=1000),
                     inst("decode-0", "decode", start=1600, restarts=1, restart_age=30)])
    assert families(facts) == []


def test_a_co_restart_is_not_skew():
    facts = cluster([
        inst("prefill-0", "prefill", start=1590, restarts=1, restart_age=40, stuck={"transfer": 1}),
        inst("decode-0", "decode", start=1600, restarts=1, restart_age=30, stuck={"transfer": 1}),
    ])
    assert "restart_skew" not in families(facts)


def test_one_spinning_rank_of_a_frozen_tp_group_is_enough():
    facts = cluster([
        inst("prefill-0", "prefill", gpus=WORKING),
        inst("decode-0", "decode", stalled=True, ok=0, stuck={"decode": 2}, gpus=[BUSY[0], IDLE[0]]),
    ])
    v = verdict(facts)
    assert v["family"] == "collective_desync"
    assert "GPU 2 at 99 % utilization" in v["evidence"][0]


def test_bootstrap_waits_and_kv_starvation_behind_a_transfer_wedge_rank_below_it():
    """As on live SGLang without GPU telemetry: decode-0's wedged transfers hold its KV memory, so
    later requests routed to it wait in bootstrap on both sides; the wedge must still lead."""
    facts = cluster([
        inst("prefill-0", "prefill", stuck={"transfer": 3, "bootstrap": 6}),
        inst("decode-0", "decode", ok=4, stuck={"transfer": 3, "bootstrap": 6}),
        inst("decode-1", "decode"),
    ])
    facts.gpu_telemetry_up = False
    v = verdict(facts)
    assert v["family"] == "transfer_wedge", [(f["family"], f["confidence"]) for f in v["findings"]]
    below = {f["family"]: f for f in v["findings"][1:]}
    assert set(below) >= {"bootstrap_wedge", "queue_starvation"}
    assert "queued behind a transfer wedge" in " ".join(below["bootstrap_wedge"]["evidence"])
    assert "downstream of a transfer wedge" in " ".join(below["queue_starvation"]["evidence"])
    # Without legs stuck in transfer, the same waits keep their own rank.
    alone = cluster([inst("prefill-0", "prefill", stuck={"bootstrap": 6}),
                     inst("decode-0", "decode", ok=4, stuck={"bootstrap": 6}), inst("decode-1", "decode")])
    assert {f.family: f.confidence for f in classify(alone)} == {"bootstrap_wedge": 0.7,
                                                          "queue_starvation": 0.75}
