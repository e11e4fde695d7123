"""Stack capture with the real py-spy against real processes: bounded, rate-limited, local PIDs only."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from pdwatch.sidecar.capture import StackCapture, find_py_spy
from tests.support.waiting import wait_for


@pytest.fixture(autouse=True)
def _py_spy_installed():
    if find_py_spy() is None:
        pytest.fail("py-spy is not installed (make test installs it: the capture extra, in requirements.lock)")

BLOCKED = "import time\ndef waiting_in_the_collective():\n    time.sleep(60)\nwaiting_in_the_collective()\n"


@pytest.fixture
def blocked():
    proc = subprocess.Popen([sys.executable, "-c", BLOCKED])
    time.sleep(0.5)
    yield proc
    proc.kill()
    proc.wait(5)


def test_the_stacks_show_where_a_process_waits(blocked):
    cap = StackCapture("py-spy")
    here = socket.gethostname()
    assert cap.want("c1", "decode-0", "its scheduler loop froze", [(0, blocked.pid, here)])
    (taken,) = wait_for(lambda: cap.captures("c1"), what="a capture")
    assert taken["error"] is None and taken["pid"] == blocked.pid and taken["tp_rank"] == 0
    assert "waiting_in_the_collective" in taken["stacks"]
    assert taken["reason"] == "its scheduler loop froze" and taken["took_s"] < 10
    assert cap.counts["taken"] == 1
    # Once per instance per interval: a second ask is refused at once, and counted.
    assert not cap.want("c1", "decode-0", "it has stuck legs", [(0, blocked.pid, here)])
    assert cap.counts["rate_limited"] == 1 and len(cap.captures()) == 1


def test_only_pids_of_this_host_that_exist_here(blocked):
    cap = StackCapture("py-spy")
    assert not cap.want("c1", "decode-0", "x", [(0, blocked.pid, "another-node")])
    assert not cap.want("c1", "decode-1", "x", [(0, 2 ** 22 + 17, socket.gethostname())])  # no such process
    assert cap.counts["not_local"] == 2 and cap.captures() == []


def test_off_takes_nothing(blocked):
    cap = StackCapture("off")
    assert not cap.enabled and not cap.want("c1", "decode-0", "x", [(0, blocked.pid, socket.gethostname())])


def test_a_dump_past_its_time_is_cut_off_and_said(blocked, tmp_path):
    slow = tmp_path / "py-spy"
    slow.write_text("#!/bin/sh\nsleep 5\n")
    slow.chmod(0o755)
    cap = StackCapture("py-spy", tool=str(slow), timeout_s=0.3)
    assert cap.want("c1", "decode-0", "x", [(0, blocked.pid, socket.gethostname())])
    (taken,) = wait_for(lambda: cap.captures(), what="a capture")
    assert taken["stacks"] == "" and "longer than" in taken["error"] and cap.counts["failed"] == 1
