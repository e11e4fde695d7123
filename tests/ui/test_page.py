"""The live page at /ui, checked as a person would: headless Chromium against a sidecar fed a real
incident (real recorders, the real OTLP encoder, emulated GPUs read through NVML). The trace ids of
the stuck legs are on screen, a click opens the two-leg waterfall, every chart has data points, the
restart is marked, nothing reaches the console. A screenshot stays in build/test-artifacts/."""

from __future__ import annotations

import re
import time
from collections import Counter

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from tests.support.sidecar import FakeClock
from tests.ui.conftest import console_errors, screenshot
from tests.ui.support import feed_stuck_legs, start_sidecar, wait_rendered

CHARTS = """return [...window.pdwatchUI.charts.entries()].map(([key, u]) => ({
  key, points: u.data[0].length, labels: u.series.slice(1).map(s => s.label),
  nonNull: u.data.slice(1).map(a => a.filter(v => v !== null && v !== undefined).length),
  restarts: u._marks.current.restarts.map(r => r.t) }))"""


def chart_data(driver, instance: str, name: str) -> list[list]:
    return driver.execute_script(
        "const [k, u] = [...window.pdwatchUI.charts.entries()].find(([k]) => k.startsWith(arguments[0]));"
        "return u.data;", f"default/{instance}|{name}|")


def open_page(driver, url: str, query: str = "") -> None:
    driver.get(f"{url}/ui{query}")
    wait_rendered(driver)


def test_the_page_shows_the_stuck_legs_their_waterfall_and_the_gpus_around_the_restart(incident, page):
    url = incident.sc.url
    stuck = httpx.get(f"{url}/api/v1/stuck").json()
    assert len(stuck) >= 60 and {s["pd_instance"] for s in stuck} == {"prefill-0", "decode-0"}
    open_page(page, url)

    # Every stuck leg is a row: its trace id, role, stage and age against its threshold are on screen.
    table = page.find_element(By.ID, "stuck-body").text
    for s in stuck:
        assert s["trace_id"] in table
    rows = page.find_elements(By.CSS_SELECTOR, "tr.leg")
    assert len(rows) == len(stuck)
    oldest = stuck[0]
    first = rows[0].text
    assert oldest["trace_id"] in first and "transfer" in first and oldest["reason"] in first
    assert re.search(r"\d+ s / 15 s", first), first
    assert page.find_element(By.ID, "stuck-count").text == str(len(stuck))

    # The diagnosis with its evidence and action; the restart on decode-0's card.
    diagnosis = page.find_element(By.ID, "diagnosis").text.lower()
    assert "transfer wedge" in diagnosis and "confidence 0.95" in diagnosis and "action:" in diagnosis
    assert "decode-0: gpu 1 at 0 % utilization" in diagnosis
    decode0 = page.find_element(By.CSS_SELECTOR, '.instance[data-key="default/decode-0"]').text
    assert "1 restart, last" in decode0 and "up" in decode0 and "loop advancing" in decode0

    # A click opens the two-leg waterfall: finished stages, and the open transfer, stuck, past its threshold.
    # (The oldest is the prefill leg of the request decode-0 held at its kill: its decode leg ended lost,
    # so take the oldest request that hangs on both legs, one routed to the new decode-0.)
    # A request that hangs on both legs after the restart: its prefill leg is overtaken by the legs the
    # prefill keeps sending to decode-1 (or past its threshold), its decode leg past its threshold.
    target = next(s for s in stuck if s["role"] == "prefill" and s["reason"] in ("threshold", "overtaken"))
    rows[stuck.index(target)].click()
    selector = f'.waterfall[data-trace-id="{target["trace_id"]}"]'
    WebDriverWait(page, 10).until(lambda d: d.find_elements(By.CSS_SELECTOR, f"{selector} .wf-bar"))
    wf = page.find_element(By.CSS_SELECTOR, selector)
    assert "prefill @ prefill-0" in wf.text and "decode @ decode-0" in wf.text
    assert [e.text.strip() for e in wf.find_elements(By.CSS_SELECTOR, ".wf-stage .wf-label")][:4] == [
        "bootstrap", "queued", "prefill", "transfer"]
    stuck_bars = wf.find_elements(By.CSS_SELECTOR, ".wf-bar.open.stuck")
    assert len(stuck_bars) == 2  # both legs, in transfer
    assert len(wf.find_elements(By.CSS_SELECTOR, ".wf-threshold")) == 2
    widths = [float(b.value_of_css_property("width").rstrip("px")) for b in stuck_bars]
    track = float(wf.find_element(By.CSS_SELECTOR, ".wf-track").value_of_css_property("width").rstrip("px"))
    assert min(widths) > 0.9 * track  # the hang is nearly the whole life of the request
    assert "past its threshold of 15 s" in wf.text

    # Charts: open legs, flow and both GPU charts per instance, each with data points, the restart marked.
    charts = page.execute_script(CHARTS)
    names = {(c["key"].split("|")[0], c["key"].split("|")[1]) for c in charts}
    for inst in ("prefill-0", "decode-0", "decode-1"):
        assert {(f"default/{inst}", n) for n in ("legs", "flow", "util", "power")} <= names
    for c in charts:
        assert c["points"] >= 80, c
        assert all(n > 0 for n in c["nonNull"]), c
        assert len(c["restarts"]) == 1 and abs(c["restarts"][0] - incident.restart_unix_s) < 1.5, c
    t, util = chart_data(page, "decode-0", "util")[:2]
    before = [u for x, u in zip(t, util) if x < incident.restart_unix_s - 1]
    after = [u for x, u in zip(t, util) if x > incident.restart_unix_s + 1]
    assert min(before) > 70 and max(after) == 0  # busy, then idle at the restart
    t, *open_and_stuck = chart_data(page, "decode-0", "legs")
    assert max(open_and_stuck[-1]) >= 30  # stuck, the last series, rose
    power = chart_data(page, "decode-0", "power")
    assert power[-1][0] == 700.0  # the limit series

    assert console_errors(page) == []
    shot = screenshot(page, "ui-incident.png")
    assert shot.stat().st_size > 50_000


def test_the_page_refreshes_by_itself_and_keeps_the_waterfall_open(incident, page):
    url = incident.sc.url
    open_page(page, url, "?refresh=0.5")
    row = page.find_element(By.CSS_SELECTOR, "tr.leg")
    trace_id = row.get_attribute("data-trace-id")
    row.send_keys(Keys.ENTER)  # the keyboard opens it too
    WebDriverWait(page, 10).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".waterfall .wf-bar"))
    before = int(page.find_element(By.ID, "stuck-count").text)
    renders = int(page.execute_script("return document.documentElement.dataset.renders"))

    incident.run(3)  # three simulated seconds: more hung legs pass the floor
    want = len(httpx.get(f"{url}/api/v1/stuck").json())
    assert want > before
    wait_rendered(page, renders + 2)
    WebDriverWait(page, 10).until(lambda d: d.find_element(By.ID, "stuck-count").text == str(want))
    waterfalls = page.find_elements(By.CSS_SELECTOR, ".waterfall")
    assert [w.get_attribute("data-trace-id") for w in waterfalls] == [trace_id]
    assert "STUCK" in waterfalls[0].text
    assert console_errors(page) == []


def test_the_filter_narrows_the_table_to_one_request(incident, page):
    url = incident.sc.url
    stuck = httpx.get(f"{url}/api/v1/stuck").json()
    target = stuck[5]["trace_id"]
    open_page(page, url)
    renders = int(page.execute_script("return document.documentElement.dataset.renders"))
    page.find_element(By.ID, "filter").send_keys(target[:12])
    wait_rendered(page, renders + 1)
    WebDriverWait(page, 10).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "tr.leg")) == 2)
    assert {r.get_attribute("data-trace-id") for r in page.find_elements(By.CSS_SELECTOR, "tr.leg")} == {target}
    assert f"2 of {len(stuck)} match the filter" in page.find_element(By.ID, "stuck-more").text
    assert console_errors(page) == []


def test_with_ten_thousand_stuck_legs_the_table_shows_the_oldest_200_and_counts_the_rest(page):
    clock = FakeClock(time.time_ns())
    sc = start_sidecar(clock, nvml="off")
    try:
        feed_stuck_legs(sc, clock, 10_000)
        t0 = time.monotonic()
        open_page(page, sc.url)
        took = time.monotonic() - t0
        assert len(page.find_elements(By.CSS_SELECTOR, "tr.leg")) == 200
        assert page.find_element(By.ID, "stuck-count").text == "10000"
        assert "Showing the oldest 200; 9800 more" in page.find_element(By.ID, "stuck-more").text
        assert "prefill transfer 10000" in page.find_element(By.ID, "stuck-chips").text
        assert took < 10, took  # bench/ui_render.py measures it against 100 legs
        assert console_errors(page) == []
    finally:
        sc.__exit__(None, None, None)


TOKEN = "ui-t0ken-for-tests"


def test_with_a_token_the_page_its_assets_and_its_data_need_it(page):
    clock = FakeClock(time.time_ns())
    sc = start_sidecar(clock, nvml="off", token=TOKEN)
    try:
        feed_stuck_legs(sc, clock, 5, token=TOKEN)
        good = {"authorization": f"Bearer {TOKEN}"}
        for path in ("/ui", "/ui/static/ui.js", "/ui/static/ui.css", "/ui/vendor/uPlot.iife.min.js",
                     "/ui/vendor/uPlot.min.css", "/ui/api/stuck"):
            assert httpx.get(f"{sc.url}{path}").status_code == 401, path
            assert httpx.get(f"{sc.url}{path}", headers={"authorization": "Bearer wrong"}).status_code == 401, path
            assert httpx.get(f"{sc.url}{path}", headers=good).status_code == 200, path
        # A browser behind something that adds the header (here: DevTools) gets the whole page.
        page.execute_cdp_cmd("Network.enable", {})
        page.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Bearer {TOKEN}"}})
        try:
            open_page(page, sc.url)
            assert len(page.find_elements(By.CSS_SELECTOR, "tr.leg")) == 5
            assert console_errors(page) == []
        finally:
            page.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": {}})
    finally:
        sc.__exit__(None, None, None)


@pytest.mark.parametrize("path, status", [
    ("/ui/static/nope.js", 404), ("/ui/static/..%2F__init__.py", 404), ("/ui/vendor/README.md", 404),
    ("/ui/other/ui.js", 404), ("/ui/api/stuck?limit=0", 422), ("/ui/api/stuck?limit=5000", 422),
])
def test_only_the_shipped_assets_are_served(incident, path, status):
    assert httpx.get(f"{incident.sc.url}{path}").status_code == status


def test_the_page_loads_nothing_from_elsewhere_and_its_data_route_pages_and_filters(incident):
    url = incident.sc.url
    r = httpx.get(f"{url}/ui")
    assert r.headers["content-type"].startswith("text/html") and r.headers["cache-control"] == "no-store"
    refs = re.findall(r'(?:src|href)="([^"]+)"', r.text)
    assert refs and all(not re.match(r"^[a-z]+://|^//", ref) for ref in refs), refs  # offline: no CDN
    assert httpx.get(f"{url}/ui/static/ui.js").headers["content-type"].startswith("text/javascript")
    slash = httpx.get(f"{url}/ui/")
    assert slash.status_code == 308 and slash.headers["location"] == "../ui"

    stuck = httpx.get(f"{url}/api/v1/stuck").json()
    first = httpx.get(f"{url}/ui/api/stuck", params={"limit": 3}).json()
    assert first["total"] == first["matched"] == len(stuck)
    assert first["legs"] == stuck[:3]  # the same legs, in the same shape, oldest first
    assert sum(g["stuck"] for g in first["by_stage"]) == len(stuck)
    assert first["by_reason"] == dict(Counter(s["reason"] for s in stuck)) and "peer_gone" in first["by_reason"]
    # A request that hangs on both legs (the oldest, peer_gone, has only its prefill leg stuck).
    both = next(s for s in stuck if s["reason"] == "threshold")
    only = httpx.get(f"{url}/ui/api/stuck", params={"q": f"DECODE-0 {both['trace_id'][:10]}"}).json()
    assert only["matched"] == 2  # both legs name decode-0 (one as its instance, one as its peer)
    assert {s["trace_id"] for s in only["legs"]} == {both["trace_id"]}
