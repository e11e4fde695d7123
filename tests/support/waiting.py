"""Bounded polling for tests that wait on other processes and threads."""

from __future__ import annotations

import time

import pytest


def wait_for(fn, timeout_s: float = 10.0, what: str | None = None, *, interval_s: float = 0.05, ignore=()):
    """Call fn until it returns something truthy, for at most timeout_s; returns that value.

    On time-out: fails the test naming `what` when given, else returns fn's last
    value (for tests that assert on it themselves). Exceptions listed in
    `ignore` (a server not up yet) count as a falsy answer.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = fn()
        except ignore:
            value = None
        if value or time.monotonic() > deadline:
            break
        time.sleep(interval_s)
    if not value and what is not None:
        pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
    return value
