"""The soak in CI: a real `pdwatch serve` churns at least a million legs for
at least 60 s (bench/soak.py; run it longer there) and its resident memory,
read from /proc/<pid>/status, stays flat after warm-up."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "soak.py"


def load_soak():
    spec = importlib.util.spec_from_file_location("pdwatch_bench_soak", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.integration
def test_a_million_legs_churned_for_60_s_with_flat_memory():
    f = load_soak().soak(legs=1_000_000, min_seconds=60, max_seconds=240, flat_tolerance=0.15, log=print)
    assert f["legs_churned"] >= 1_000_000 and f["seconds"] >= 60
    assert set(f["statuses"]) <= {200, 429, 503} and f["statuses"].get(200, 0) > 0
    assert f["flat"], f"RSS grew {f['growth_after_warmup']:.1%} after warm-up"
    # Every bound was reached and held: legs that vanished, history forgotten, instances expired.
    assert f["evicted"]["vanished"] > 0 and f["evicted"]["closed_limit"] > 0
    assert f["evicted"]["instance_gone"] > 0 and f["instances_expired"] > 0
    assert f["tracked_legs_end"] <= 64 * 2048  # at most every instance's one inventory
