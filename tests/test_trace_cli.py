"""`pdwatch trace`: the waterfall and the Jaeger UI file, read from a real
`pdwatch serve` fed by real recorders over OTLP/HTTP."""

from __future__ import annotations

import json
import logging
import re
import time

import httpx
import pytest

from pdwatch import contract as c
from pdwatch import trace
from pdwatch.cli import main
from pdwatch.engine_patches.recorder import Recorder, RecorderConfig
from pdwatch.testbed.sidecar_process import SidecarProcess
from tests.support.waiting import wait_for

WIDTH = 100


def _recorder(url: str, role: str, instance: str) -> Recorder:
    return Recorder(RecorderConfig(role=role, instance=instance, heartbeat_s=1.0, endpoint=url), environ={})


@pytest.fixture(scope="module")
def sidecar():
    """A sidecar with request 0 finished on both legs and request 1 hung in transfer on both."""
    logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)
    with SidecarProcess(env={"PDWATCH_FLOOR_TRANSFER_S": "0.3", "PDWATCH_NVML": "off",
                             "PDWATCH_LOG_LEVEL": "warning"}) as sc:
        p, d = _recorder(sc.url, "prefill", "prefill-0"), _recorder(sc.url, "decode", "decode-0")
        try:
            for i in (0, 1):
                p.arrive(f"p-{i}", bootstrap_room=i)
                d.arrive(f"d-{i}", bootstrap_room=i)
                for stage in ("bootstrap", "queued", "prefill"):
                    p.enter(f"p-{i}", stage)
                    time.sleep(0.02)
                d.enter(f"d-{i}", "bootstrap")
                p.enter(f"p-{i}", "transfer")
                d.enter(f"d-{i}", "transfer")
            time.sleep(0.05)
            p.finish("p-0")
            d.enter("d-0", "queued")
            d.enter("d-0", "decode")
            d.token("d-0", 4)
            time.sleep(0.05)
            d.finish("d-0")
            for rec in (p, d):
                rec.drain()
                rec.heartbeat()
                assert rec.flush()
            # Past the 0.3 s transfer floor (or 3x the p99 of request 0's transfer): request 1 is stuck.
            wait_for(lambda: len(httpx.get(f"{sc.url}/api/v1/stuck").json()) == 2, what="request 1 stuck")
            yield sc
        finally:
            p.shutdown(1)
            d.shutdown(1)


def tid(room: int) -> str:
    return f"{c.room_trace_id(room):032x}"


def bar_of(line: str) -> str:
    return line.split("|")[1]


def run(capsys, *args) -> tuple[int, str, str]:
    code = main(["trace", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_finished_request_draws_both_legs_in_stage_order(sidecar, capsys):
    code, out, _ = run(capsys, tid(0), "--sidecar", sidecar.url, "--width", str(WIDTH), "--ascii")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith(f"trace {tid(0)}  2 leg(s)") and "drawn to now" not in lines[0]
    heads = [i for i, line in enumerate(lines) if line.startswith(("prefill ", "decode "))]
    assert [lines[i].split()[0] for i in heads] == ["prefill", "decode"]
    assert all(lines[i].endswith("[ok]") for i in heads)
    bar_w = len(bar_of(lines[heads[0] + 1]))
    assert bar_w == WIDTH - trace.LABEL_W - trace.NOTE_W - 2
    for head, role in zip(heads, ("prefill", "decode")):
        body = lines[head + 1: head + 2 + len(c.STAGES[role])]
        assert body[0].strip().startswith(c.SPAN_LEG)
        assert [b.split("|")[0].strip() for b in body[1:]] == list(c.STAGES[role])
        starts = [len(bar_of(b)) - len(bar_of(b).lstrip()) for b in body[1:]]
        assert starts == sorted(starts)  # a waterfall: each stage starts where or after the previous one did
        assert all(len(bar_of(b)) == bar_w and "STUCK" not in b and "open" not in b for b in body)
    # The decode leg ends last, so its leg bar reaches the right edge.
    assert bar_of(lines[heads[1] + 1]).rstrip().endswith("#") and bar_of(lines[heads[1] + 1])[-1] == "#"


def test_a_hung_request_is_drawn_to_now_and_marked_stuck(sidecar, capsys):
    code, out, _ = run(capsys, tid(1), "--sidecar", sidecar.url, "--width", str(WIDTH))
    assert code == 0
    assert "(open stages drawn to now)" in out.splitlines()[0]
    transfer = [line for line in out.splitlines() if line.strip().startswith("transfer")]
    assert len(transfer) == 2
    for line in transfer:
        mark = re.search(r"STUCK \(>([0-9.]+) s\)$", line)
        threshold = float(mark.group(1))  # the floor, or 3 x p99 of request 0's transfer if longer
        assert threshold >= 0.3
        assert bar_of(line).endswith(">")  # open, up to now: the right edge
        assert float(line.split("|")[2].split()[0]) > threshold
    assert sum("[open, STUCK]" in line for line in out.splitlines()) == 2


def test_jaeger_json_links_every_span_to_its_leg(sidecar, capsys, tmp_path):
    import httpx

    path = tmp_path / "trace.json"
    code, out, _ = run(capsys, tid(1).upper(), "--sidecar", sidecar.url, "--jaeger-json", str(path))
    assert code == 0 and f"wrote {path}" in out
    doc = json.loads(path.read_text())
    (t,) = doc["data"]
    detail = httpx.get(f"{sidecar.url}/api/v1/requests/{tid(1)}").json()
    assert t["traceID"] == tid(1)
    ids = {s["spanID"] for s in t["spans"]}
    assert len(ids) == len(t["spans"])
    for s in t["spans"]:
        assert s["traceID"] == tid(1) and s["processID"] in t["processes"]
        assert re.fullmatch(r"[0-9a-f]{16}", s["spanID"])
        assert isinstance(s["startTime"], int) and isinstance(s["duration"], int) and s["duration"] >= 0
        assert all(r["refType"] == "CHILD_OF" and r["spanID"] in ids for r in s["references"])
        assert all(set(tag) == {"key", "type", "value"} for tag in s["tags"])
    legs = {s["spanID"]: s for s in t["spans"] if s["operationName"] == c.SPAN_LEG}
    assert set(legs) == {leg["span_id"] for leg in detail["legs"]}  # the engines' own leg span ids
    assert all(not s["references"] for s in legs.values())
    for leg in detail["legs"]:
        mine = [s for s in t["spans"] if s["references"] and s["references"][0]["spanID"] == leg["span_id"]]
        done = {s["operationName"]: s for s in mine if not any(g["key"] == "pdwatch.open" for g in s["tags"])}
        for stage in leg["stages"]:
            s = done[c.stage_span_name(stage["stage"])]
            assert s["startTime"] == round(stage["start_unix_s"] * 1e6)
            assert abs(s["duration"] - stage["duration_s"] * 1e6) <= 2
        (stuck,) = [s for s in mine if s["operationName"] == c.SPAN_STUCK]
        tags = {g["key"]: g["value"] for g in stuck["tags"]}
        assert tags["error"] is True and tags[c.A_STAGE] == "transfer" and tags[c.A_ROLE] == leg["role"]
        assert tags["otel.status_description"].startswith("stuck in transfer for ")
        assert stuck["startTime"] == round(leg["stage_since_unix_s"] * 1e6)
        assert t["processes"][stuck["processID"]]["serviceName"] == leg["pd_instance"]


def test_scaling_follows_the_times():
    """A stage that takes half the request takes half the bar."""
    detail = {"trace_id": "ab" * 16, "legs": [{
        "role": "prefill", "pd_instance": "p0", "rid": "r", "state": "done", "outcome": "ok",
        "arrived_unix_s": 100.0, "ended_unix_s": 104.0,
        "stages": [{"stage": "queued", "start_unix_s": 100.0, "end_unix_s": 102.0, "error": None},
                   {"stage": "prefill", "start_unix_s": 102.0, "end_unix_s": 104.0, "error": "oom"}],
    }]}
    width = trace.LABEL_W + trace.NOTE_W + 2 + 40
    lines = trace.render(detail, width=width, ascii_only=True).splitlines()
    leg, queued, prefill = (bar_of(line) for line in lines[3:6])
    assert leg == "#" * 40
    assert queued == "#" * 21 + " " * 19  # columns 0..20: the boundary column belongs to both
    assert prefill.lstrip().endswith("x") and prefill.index("#") == 20
    assert "error: oom" in lines[5]


def test_bad_and_unknown_trace_ids(sidecar, capsys):
    code, _, err = run(capsys, "not-a-trace", "--sidecar", sidecar.url)
    assert code == 2 and "32 hex digits" in err
    code, _, err = run(capsys, "0" * 31 + "1", "--sidecar", sidecar.url)
    assert code == 1 and "knows no leg" in err
