"""Contract v1.2, the engine side's health as the sidecar shows it: the recorders' losses and the plugins'
state per instance (metrics, summary), and a judge that stops ticking (its age, /healthz)."""

from __future__ import annotations

import threading
import time

import httpx
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdwatch import contract as c
from pdwatch.sidecar.metrics import EvaluationCollector
from pdwatch.sidecar.views import summary
from tests.support.tracking import evaluate, ingest


def samples(ev) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample the evaluation's metrics show, by (name, sorted labels)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EvaluationCollector(lambda: ev))
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def drop_attribute(request, name: str):
    """The request with a heartbeat attribute taken out of every span: an engine that does not send it."""
    for rs in request.resource_spans:
        for ss in rs.scope_spans:
            for span in ss.spans:
                kept = [kv for kv in span.attributes if kv.key != name]
                del span.attributes[:]
                span.attributes.extend(kept)
    return request


def rename_attribute(request, old: str, new: str):
    for rs in request.resource_spans:
        for ss in rs.scope_spans:
            for span in ss.spans:
                for kv in span.attributes:
                    if kv.key == old:
                        kv.key = new
    return request


def test_recorder_losses_are_summed_over_an_instances_ranks(tracker, engines):
    r0 = engines("decode", "decode-0", tp_rank=0, tp_size=2)
    r1 = engines("decode", "decode-0", tp_rank=1, tp_size=2)
    r0.rec.dropped, r0.rec.hook_errors = 3, 1  # the hot-path buffer's drops count as spans dropped
    r1.rec.export.dropped, r1.rec.export.failed_spans, r1.rec.hook_errors = 4, 7, 2
    for e in (r0, r1):
        e.send(tracker)
    ev = evaluate(tracker)
    labels = (("pd_cluster", "default"), ("pd_instance", "decode-0"), ("role", "decode"))
    got = samples(ev)
    assert got[("pdwatch_engine_spans_dropped_total", labels)] == 3 + 4
    assert got[("pdwatch_engine_exports_failed_total", labels)] == 7
    assert got[("pdwatch_engine_hook_errors_total", labels)] == 1 + 2
    (inst,) = summary(ev)["instances"]
    assert inst["recorder"] == {"pd.recorder.spans_dropped": 7, "pd.recorder.exports_failed": 7,
                                "pd.recorder.hook_errors": 3}
    # The per-rank detail keeps the counters too.
    assert inst["ranks"][1]["engine"]["pd.recorder.hook_errors"] == 2


def test_engine_info_names_the_engine_the_plugin_and_its_least_observed_rank(tracker, engines):
    refused = "ScheduleBatch.prepare_for_decode: parameter 'x' missing"
    full = engines("prefill", "prefill-0", engine_version="0.5.1")
    r0 = engines("decode", "decode-0", tp_rank=0, tp_size=2, engine_version="0.5.1")
    r1 = engines("decode", "decode-0", tp_rank=1, tp_size=2, engine_version="0.5.1", plugin_state="partial",
                 plugin_refused=(refused,))
    for e in (full, r0, r1):
        e.send(tracker)
    ev = evaluate(tracker)
    info = {dict(labels)["pd_instance"]: dict(labels) for (name, labels), value in samples(ev).items()
            if name == "pdwatch_engine_info" and value == 1}
    assert info["prefill-0"] == {"pd_cluster": "default", "role": "prefill", "pd_instance": "prefill-0",
                                 "engine": "sglang", "engine_version": "0.5.1",
                                 "plugin_version": c.package_version(), "plugin_state": "active"}
    assert info["decode-0"]["plugin_state"] == "partial"
    by_name = {i["pd_instance"]: i for i in summary(ev)["instances"]}
    assert by_name["decode-0"]["plugin_state"] == "partial" and by_name["decode-0"]["plugin_refused"] == [refused]
    assert by_name["prefill-0"]["plugin_refused"] == []
    assert by_name["prefill-0"]["plugin_version"] == c.package_version()


def test_an_instance_that_never_says_its_plugin_state_reads_unknown(tracker, engines):
    old = engines("decode", "decode-0")
    ingest(tracker, drop_attribute(old.request(heartbeat=True), "pd.plugin.state"))
    ev = evaluate(tracker)
    (inst,) = summary(ev)["instances"]
    assert inst["plugin_state"] == "unknown"
    assert [dict(labels)["plugin_state"] for (name, labels) in samples(ev) if name == "pdwatch_engine_info"] == \
        ["unknown"]


def test_a_state_the_contract_does_not_name_is_not_taken(tracker, engines):
    e = engines("decode", "decode-0")
    ingest(tracker, e.request(heartbeat=True))
    request = e.request(heartbeat=True)
    for rs in request.resource_spans:
        for span in rs.scope_spans[0].spans:
            for kv in span.attributes:
                if kv.key == "pd.plugin.state":
                    kv.value.string_value = "sideways"
    ingest(tracker, request)
    (inst,) = summary(evaluate(tracker))["instances"]
    assert inst["plugin_state"] == "active"  # the last state it said in the contract's words


def test_the_idle_turn_is_read_under_its_contract_name_and_its_old_one(tracker, engines):
    new = engines("decode", "decode-0", loop_idle_turn_s=0.5)
    old = engines("decode", "decode-1", loop_idle_turn_s=1.5)
    ingest(tracker, new.request(heartbeat=True))
    ingest(tracker, rename_attribute(old.request(heartbeat=True), "pd.loop.idle_turn_s", "pdwatch.loop.idle_turn_s"))
    turns = {i["pd_instance"]: i["ranks"][0]["idle_turn_s"] for i in summary(evaluate(tracker))["instances"]}
    assert turns == {"decode-0": 0.5, "decode-1": 1.5}


def metric(url: str, name: str) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text):
        for s in family.samples:
            if s.name == name:
                return s.value
    raise AssertionError(f"{name} not exposed")


def wait_for(predicate, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    return predicate()


def test_healthz_answers_503_while_the_judge_is_blocked_and_200_once_it_runs_again(live_sidecar):
    """The judge's thread really blocked: a task handed to it (as ingest hands its work) waits on an event,
    so no pass can finish. /healthz, served on the event loop, says so within 3 of its intervals."""
    interval = 0.5  # the default
    sc = live_sidecar(evaluate_interval_s=interval, nvml="off")
    assert wait_for(lambda: httpx.get(f"{sc.url}/healthz", timeout=2).status_code == 200, 5)
    assert metric(sc.url, "pdwatch_evaluation_age_seconds") < c.JUDGE_STALLED_INTERVALS * interval
    release, blocked = threading.Event(), threading.Event()

    def hold():
        blocked.set()
        release.wait(30)

    held = sc.sidecar.worker.submit(hold)
    try:
        assert blocked.wait(5)
        started = time.monotonic()
        # Blocked a moment ago, a tick at most after the last pass: not stalled yet.
        assert httpx.get(f"{sc.url}/healthz", timeout=2).status_code == 200
        stalled = wait_for(lambda: (r := httpx.get(f"{sc.url}/healthz", timeout=2)).status_code == 503 and r, 5)
        assert stalled, "no 503 while the judge was blocked"
        # Within 3 ticks of being blocked (with a little room for a request's own latency on a busy machine).
        assert time.monotonic() - started <= c.JUDGE_STALLED_INTERVALS * interval + 0.3
        assert stalled.json()["status"] == "stalled"
        assert stalled.json()["evaluation_age_s"] > c.JUDGE_STALLED_INTERVALS * interval
        assert metric(sc.url, "pdwatch_evaluation_age_seconds") > c.JUDGE_STALLED_INTERVALS * interval
    finally:
        release.set()
    held.result(5)
    recovered = wait_for(lambda: (r := httpx.get(f"{sc.url}/healthz", timeout=2)).status_code == 200 and r, 5)
    assert recovered and recovered.json()["status"] == "ok"
    assert metric(sc.url, "pdwatch_evaluation_age_seconds") < c.JUDGE_STALLED_INTERVALS * interval
