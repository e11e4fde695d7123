"""`pdwatch report`: the HTML with its plots embedded and the PNGs beside it, from a sidecar's history and
from a real Prometheus. The PNGs are read back: they are images of the incident, their plotted series
flat before the restart and moving where the incident was."""

from __future__ import annotations

import base64
import json
import re
import time
from pathlib import Path

import httpx
import pytest
from markupsafe import escape
from PIL import Image

from pdwatch.report.cli import main
from pdwatch.report.html import render_html
from pdwatch.report.model import Diagnosis, Instance
from pdwatch.report.model import Incident as ReportIncident
from pdwatch.report.times import parse_time
from pdwatch.report.write import write_report
from pdwatch.settings import ClientSettings
from tests.support.sidecar import FakeClock
from tests.ui.support import Incident, start_sidecar, stub_library

TRACE_URL = "https://traces.example/trace/{trace_id}"
HEADLINE = "PDRequestStuckWhileOthersFlow"


def hex_rgb(color: str) -> tuple[int, int, int]:
    return int(color[1:3], 16), int(color[3:5], 16), int(color[5:7], 16)


class Panel:
    """One plot panel of a report PNG, as report.json places it; reads its series' pixels back."""

    def __init__(self, png: Path, figure: dict, name: str, start: float, end: float):
        self.img = Image.open(png).convert("RGB")
        self.spec = figure["panels"][name]
        self.x0, self.y0, self.x1, self.y1 = self.spec["box"]
        self.legend = self.spec["legend"]
        self.start, self.end = start, end
        self.colors = [hex_rgb(s["color"]) for s in self.spec["series"]]

    def x_of(self, t: float) -> int:
        return round(self.x0 + (t - self.start) / (self.end - self.start) * (self.x1 - self.x0))

    def height_at(self, x: int) -> float | None:
        """How high (0 at the bottom of the panel, 1 at its top) the highest series pixel in column x is."""
        px = self.img.load()
        for y in range(self.y0, self.y1 + 1):
            if self.legend and self.legend[0] <= x <= self.legend[2] and self.legend[1] <= y <= self.legend[3]:
                continue
            r, g, b = px[x, y]
            if any(abs(r - cr) + abs(g - cg) + abs(b - cb) <= 60 for cr, cg, cb in self.colors):
                return (self.y1 - y) / (self.y1 - self.y0)
        return None

    def heights(self, t0: float, t1: float) -> list[float]:
        xs = range(max(self.x_of(t0), self.x0 + 3), min(self.x_of(t1), self.x1 - 3))
        return [h for x in xs if (h := self.height_at(x)) is not None]


@pytest.fixture(scope="module")
def report(incident, tmp_path_factory):
    out = tmp_path_factory.mktemp("report-sidecar")
    page = write_report(out, ClientSettings.from_sources({"sidecar": incident.sc.url, "trace_url": TRACE_URL}))
    return page, json.loads((out / "report.json").read_text())


def figure(manifest: dict, name: str) -> dict:
    return next(f for f in manifest["figures"] if f["file"] == name)


def test_the_report_from_a_sidecar_embeds_its_plots_and_names_the_incident(incident, report):
    page, manifest = report
    html = page.read_text()
    files = sorted(p.name for p in page.parent.iterdir())
    assert files == ["flow.png", "gpus.png", "report.html", "report.json"]
    # Self-contained: each PNG is in the page, byte for byte.
    embedded = re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", html)
    assert sorted(base64.b64decode(e) for e in embedded) == sorted(
        (page.parent / f).read_bytes() for f in ("flow.png", "gpus.png"))
    assert "http" not in re.sub(r'href="https://traces\.example/trace/[0-9a-f]{32}"', "", html).replace(
        incident.sc.url, "")  # nothing to fetch from elsewhere

    d = manifest["diagnosis"][0]
    assert d["family"] == "transfer_wedge" and d["confidence"] >= 0.9 and "co-restart" in d["action"]
    # The classifier's own sentences, as the sidecar said them, every finding's on the page: none rewritten.
    (said,) = httpx.get(f"{incident.sc.url}/api/v1/diagnosis").json()
    assert (d["evidence"], d["findings"], d["action"]) == (said["evidence"], said["findings"], said["action"])
    assert any("decode decode-0 was restarted alone" in s for f in d["findings"] for s in f["evidence"])
    assert any("decode-0: GPU 1 at 0 % utilization" in s for s in d["evidence"])
    assert all(str(escape(s)) in html for f in d["findings"] for s in f["evidence"])
    assert "transfer wedge" in html.lower() and "restart skew" in html.lower()
    assert manifest["restarts"] == {"decode-0": [pytest.approx(incident.restart_unix_s, abs=1.0)]}
    assert manifest["worst_stuck"] == len(httpx.get(f"{incident.sc.url}/api/v1/stuck").json())
    # The oldest stuck traces, linked to the trace store.
    oldest = manifest["oldest"]
    assert len(oldest) == 20 and {s["trace_id"] for s in oldest} <= set(incident.hung)
    for s in oldest:
        assert f'href="https://traces.example/trace/{s["trace_id"]}"' in html


def test_the_report_pngs_are_images_of_the_incident(incident, report):
    page, manifest = report
    start, end, restart = manifest["start_unix_s"], manifest["end_unix_s"], incident.restart_unix_s
    for name in ("flow.png", "gpus.png"):
        png = page.parent / name
        assert png.stat().st_size > 20_000
        with Image.open(png) as img:
            assert img.format == "PNG" and img.size[0] >= 1000 and img.size[1] >= 600
            assert img.size == (figure(manifest, name)["width"], figure(manifest, name)["height"])

    flow = figure(manifest, "flow.png")
    # Stuck legs: none before the restart, then climbing once the hung legs pass the 15 s floor.
    stuck = Panel(page.parent / "flow.png", flow, "stuck", start, end)
    calm, climb = stuck.heights(start, restart), stuck.heights(restart + 20, end)
    assert calm and max(calm) < 0.03
    assert climb and max(climb) > 0.6 and climb[-1] > climb[0] + 0.3
    # Open legs rise from the restart on; finished-ok rates change at it (decode-0 stops).
    opened = Panel(page.parent / "flow.png", flow, "open", start, end)
    assert max(opened.heights(start, restart)) < 0.03 and max(opened.heights(restart + 5, end)) > 0.6
    rates = figure(manifest, "flow.png")["panels"]["finished"]
    assert {s["label"] for s in rates["series"]} == {"prefill-0", "decode-0", "decode-1"}

    # decode-0's GPU: busy before the restart, idle after; decode-1's stays busy throughout.
    gpus = figure(manifest, "gpus.png")
    d0 = Panel(page.parent / "gpus.png", gpus, "decode-0 util", start, end)
    before, after = d0.heights(start + 3, restart - 2), d0.heights(restart + 2, end - 2)
    assert before and min(before) > 0.6
    assert after and max(after) < 0.05
    d1 = Panel(page.parent / "gpus.png", gpus, "decode-1 util", start, end)
    assert min(d1.heights(start + 3, end - 2)) > 0.6
    power = Panel(page.parent / "gpus.png", gpus, "decode-0 power", start, end)
    assert min(power.heights(start + 3, restart - 2)) > max(power.heights(restart + 2, end - 2)) + 0.3


def test_the_cli_writes_the_report_where_it_says(incident, tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["--sidecar", incident.sc.url, "--from", "now-2m", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"report written to {out / 'report.html'}"
    assert (out / "flow.png").is_file() and (out / "gpus.png").is_file()
    assert main(["--sidecar", "http://127.0.0.1:9", "--out", str(tmp_path / "x")]) == 2
    assert "cannot reach the sidecar" in capsys.readouterr().err


def test_the_page_escapes_whatever_the_engines_named(tmp_path):
    """Instance names, labels and the sentences built from them come from the engines: autoescaped, never markup."""
    hostile = "<script>alert(1)</script>"
    inc = ReportIncident("sidecar", 0.0, 60.0, instances=[Instance("c1", hostile, "decode", restarts=[30.0])],
                         oldest=[{"trace_id": f'{"0" * 31}1"><i id=x>', "role": "decode", "stage": "transfer",
                                  "pd_instance": hostile, "stage_age_s": 42.0, "reason": "", "rid": "", "cluster": "c1"}])
    inc.diagnosis = [Diagnosis("c1", 60.0, "the sidecar", "transfer_wedge", 0.9, [f"{hostile} stalls"], "restart",
                               [{"family": "restart_skew", "confidence": 0.7, "evidence": [f"{hostile} alone"]}])]
    page = render_html(inc, [], tmp_path, title=hostile, trace_url=TRACE_URL)
    assert "<script>" not in page and "<i id=x>" not in page
    assert page.count(str(escape(hostile))) >= 6  # the title twice, the sentences, the tables
    assert f'href="https://traces.example/trace/{"0" * 31}1%22%3E%3Ci%20id%3Dx%3E"' in page


def test_times_read_as_people_write_them():
    now = 1_800_000_000.0
    assert parse_time("now", now) == now
    assert parse_time("30m", now) == parse_time("now-30m", now) == parse_time("-30m", now) == now - 1800
    assert parse_time("1700000000", now) == 1_700_000_000
    assert parse_time("2026-01-02T03:04:05Z", now) == parse_time("2026-01-02 03:04:05", now) == 1767323045
    assert parse_time("2026-01-02T05:04:05+02:00", now) == 1767323045
    with pytest.raises(RuntimeError, match="cannot read the time"):
        parse_time("yesterday", now)


@pytest.mark.integration
def test_the_report_from_prometheus_marks_the_restart_the_alert_and_the_diagnosis(incident, tmp_path):
    """A real Prometheus (Debian's) scrapes a sidecar while the incident unfolds at the pace of the wall
    clock; the report reads it back with range queries."""
    from pdwatch.testbed.monitoring import Monitoring

    clock = FakeClock(time.time_ns())
    sc = start_sidecar(clock, nvml_library=stub_library(), floor_transfer_s=3)
    try:
        with Monitoring([sc.url], scrape_interval_s=1.0, evaluation_interval_s=1.0) as mon:
            t0 = time.time()
            inc = Incident(sc, clock, incident.gpus, restart_at=6)
            inc.run(16, pace_s=1.0)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and HEADLINE not in mon.alert_names()["firing"]:
                inc.run(1, pace_s=1.0)
            inc.run(3, pace_s=1.0)  # a few scrapes with the alert firing
            page = write_report(tmp_path, ClientSettings.from_sources({"prometheus": mon.prometheus_url,
                                                                       "trace_url": TRACE_URL}),
                                start=t0 - 2, end=time.time())
        inc.close()
    finally:
        sc.__exit__(None, None, None)
    manifest = json.loads((tmp_path / "report.json").read_text())
    html = page.read_text()
    assert HEADLINE in {a["name"] for a in manifest["alerts"]}, manifest["alerts"]
    assert HEADLINE in html
    assert manifest["restarts"] == {"decode-0": [pytest.approx(inc.restart_unix_s, abs=1.5)]}
    d = manifest["diagnosis"][0]
    assert d["family"] == "transfer_wedge" and d["action"], d
    # The classifier's sentences over Prometheus at the worst moment, and what the sidecars published then.
    assert d["evidence"] and d["findings"][0]["evidence"] == d["evidence"]
    assert d["at_unix_s"] == manifest["worst_at_unix_s"]
    assert "transfer_wedge" in {family for family, _ in d["published"]}
    assert all(str(escape(s)) in html for f in d["findings"] for s in f["evidence"])
    assert manifest["oldest"] and {s["trace_id"] for s in manifest["oldest"]} <= set(inc.hung)
    assert {s["role"] for s in manifest["oldest"]} == {"prefill", "decode"}

    flow = figure(manifest, "flow.png")
    # From Prometheus, stuck legs are per stage: both legs of the hung requests, in transfer.
    assert {s["label"] for s in flow["panels"]["stuck"]["series"]} == {"prefill transfer", "decode transfer"}
    start, end = manifest["start_unix_s"], manifest["end_unix_s"]
    stuck = Panel(tmp_path / "flow.png", flow, "stuck", start, end)
    assert max(stuck.heights(start, inc.restart_unix_s)) < 0.03
    climb = stuck.heights(inc.restart_unix_s + 6, end)
    assert climb and max(climb) > 0.6
    d0 = Panel(tmp_path / "gpus.png", figure(manifest, "gpus.png"), "decode-0 util", start, end)
    assert min(d0.heights(start + 2, inc.restart_unix_s - 2)) > 0.6
    assert max(d0.heights(inc.restart_unix_s + 3, end - 2)) < 0.05
