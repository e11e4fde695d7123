"""kv_starvation end to end, the recipe of docs/architecture.md for a family that needs one new fact:
the engine says how full its KV pool is (a recorder gauge, as the SGLang plugin sends it), the sidecar
keeps and exposes it, and both gatherers (a live sidecar's evaluation, and Prometheus) bring it to the
classifier, which names the decode whose legs wait for KV memory while it serves others."""

from __future__ import annotations

import httpx
import pytest

from pdwatch import contract as c
from pdwatch.sidecar.diagnosis import from_evaluation, from_prometheus
from pdwatch.sidecar.diagnosis.classify import verdict
from pdwatch.sidecar.settings import Settings
from pdwatch.testbed.monitoring import Monitoring
from tests.support.sidecar import Engine, FakeClock, LiveSidecar
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

PB = {"Content-Type": "application/x-protobuf"}


def post(sc, engine):
    r = httpx.post(f"{sc.url}{c.PATH_INGEST}", content=engine.request(True).SerializeToString(), headers=PB)
    assert r.status_code == 200


def test_a_full_decode_kv_pool_is_named_from_the_sidecar_and_from_prometheus():
    clock = FakeClock()
    kv = {c.H_KV_USED: 0.97}
    prefill = Engine("prefill", "prefill-0", clock)
    decode = Engine("decode", "decode-0", clock, gauges=lambda: kv)
    with LiveSidecar(Settings(evaluate_interval_s=3600, nvml="off"), clock=clock) as sc:
        # One leg finished before Prometheus's first scrape: the counter the others increase then exists.
        decode.walk("d-first", 99, ("bootstrap", "transfer", "queued", "decode"))
        decode.rec.finish("d-first")
        post(sc, prefill)
        post(sc, decode)
        sc.judge_now()
        with Monitoring([f"127.0.0.1:{sc.port}"], scrape_interval_s=1.0) as mon:
            for i in range(3):  # three requests wait for KV memory on decode-0
                decode.walk(f"d-wait-{i}", 100 + i, ("bootstrap",))
            post(sc, prefill)
            post(sc, decode)
            clock.advance(31)  # past the bootstrap floor
            for i in range(5):  # while decode-0 keeps finishing others
                decode.walk(f"d-ok-{i}", i, ("bootstrap", "transfer", "queued", "decode"))
                decode.rec.finish(f"d-ok-{i}")
            post(sc, prefill)
            post(sc, decode)
            ev = sc.judge_now()

            (inst,) = [i for i in ev.instances if i.name == "decode-0"]
            assert inst.kv_used == 0.97
            (facts,) = from_evaluation.gather(ev)
            v = verdict(facts)
            assert v["family"] == "kv_starvation", v
            assert "its KV pool is 97 % full" in v["evidence"][0]
            text = httpx.get(f"{sc.url}{c.PATH_METRICS}").text
            assert f'{c.KV_USED.name}{{pd_cluster="default",pd_instance="decode-0",role="decode"}} 0.97' in text

            # Prometheus's series bring the same verdict (the gatherer of `pdwatch diagnose --prometheus`).
            def from_prom():
                found = from_prometheus.gather(mon.prometheus_url)  # nothing before the first scrape after these
                return found[0] if found and verdict(found[0])["family"] == "kv_starvation" else None

            pf = wait_for(from_prom, 30, "kv_starvation diagnosed from Prometheus", interval_s=1.0)
            (pinst,) = [i for i in pf.instances if i.pd_instance == "decode-0"]
            assert pinst.kv_used == pytest.approx(0.97)

        # The pool drains: the same waits read as queue_starvation again.
        kv[c.H_KV_USED] = 0.5
        clock.advance(1)
        post(sc, prefill)
        post(sc, decode)
        assert verdict(from_evaluation.gather(sc.judge_now())[0])["family"] == "queue_starvation"
    for e in (prefill, decode):
        e.rec.shutdown(timeout_s=1)
