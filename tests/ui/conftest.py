"""Fixtures: the incident on a live sidecar (once per session: the page and report tests read it),
and one headless Chromium for every browser test."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.sidecar import FakeClock
from tests.ui.support import ARTIFACTS, CHROMEDRIVER, CHROMIUM, UUIDS, Incident, chrome, start_sidecar, stub_library

SIMULATED_S = 90


@pytest.fixture(scope="session")
def incident():
    """decode-0 restarted alone 50 simulated seconds ago; its transfers hang while decode-1 serves."""
    from pdwatch.testbed.gpu_emulation import STATE_ENV, GpuEmulator

    library = stub_library()
    if library is None:
        pytest.fail("the NVML stub is not built and `make nvml-stub` failed (make test builds it)")
    tmp = Path(tempfile.mkdtemp(prefix="pdwatch-ui-"))
    gpus = GpuEmulator(tmp / "nvml-state", [{"index": i, "uuid": u, "name": "NVIDIA H200"} for i, u in enumerate(UUIDS)])
    old = os.environ.get(STATE_ENV)
    os.environ[STATE_ENV] = str(gpus.path)  # the stub reads it on every call
    # The incident ends about now, so the page's clock reads like a real one.
    clock = FakeClock(time.time_ns() - SIMULATED_S * 10**9)
    sc = start_sidecar(clock, nvml_library=library, floor_transfer_s=15)
    inc = Incident(sc, clock, gpus).run(SIMULATED_S)
    try:
        yield inc
    finally:
        inc.close()
        sc.__exit__(None, None, None)
        if old is None:
            os.environ.pop(STATE_ENV, None)
        else:
            os.environ[STATE_ENV] = old
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def browser():
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).is_file()]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium (the ui-tests extra, in requirements.lock)")
    if missing:
        pytest.fail(f"browser tests need {', '.join(missing)}: `make test` installs them (mk/browser.mk)")
    driver = chrome()
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def page(browser):
    """The browser, its console log emptied; after the test, a page left on screen is blanked."""
    browser.get_log("browser")
    yield browser
    browser.get("about:blank")


def console_errors(driver) -> list[str]:
    """Errors the browser logged (SEVERE) and those the page caught itself (console.error, onerror)."""
    logged = [e["message"] for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
    caught = driver.execute_script("return (window.pdwatchUI && window.pdwatchUI.errors) || []") or []
    return logged + list(caught)


def screenshot(driver, name: str) -> Path:
    """The whole page, as tall as it is, kept under build/test-artifacts/."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    width, height = driver.get_window_size()["width"], driver.get_window_size()["height"]
    full = driver.execute_script("return Math.ceil(document.documentElement.scrollHeight)")
    driver.set_window_size(width, min(max(full + 40, height), 8000))
    time.sleep(0.3)  # the charts follow the window (a debounced resize)
    driver.save_screenshot(str(path))
    driver.set_window_size(width, height)
    return path
