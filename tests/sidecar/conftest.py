"""Fixtures for the sidecar: engines are real Recorders whose OTLP requests,
kept in memory, are fed to the tracker under one fake clock (tests/support/sidecar.py)."""

from __future__ import annotations

import logging
import time

import pytest

from tests.support.sidecar import T0, Engine, FakeClock, LiveSidecar
from tests.support.tracking import new_tracker

__all__ = ["T0", "Engine", "FakeClock", "LiveSidecar"]


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def tracker(clock):
    return new_tracker({"bootstrap": 30, "queued": 60, "prefill": 60, "transfer": 15, "decode": 30}, clock=clock)


@pytest.fixture
def engines(clock):
    made = []

    def make(role, instance, **kw):
        e = Engine(role, instance, clock, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.rec.shutdown(timeout_s=1)


@pytest.fixture
def live_sidecar():
    from pdwatch.sidecar.settings import Settings

    started = []

    def start(clock=time.time_ns, nvml_library=None, forward_options=None, **settings):
        s = LiveSidecar(Settings(**settings), clock=clock, nvml_library=nvml_library,
                        forward_options=forward_options).__enter__()
        started.append(s)
        return s

    logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)
    yield start
    for s in started:
        s.__exit__(None, None, None)
