"""The plugin state a hook table gives (guard.plan) and `pdwatch check` on the installed SGLang."""

from __future__ import annotations

import json

import pytest

from pdwatch import contract as c
from pdwatch.cli import main as pdwatch
from pdwatch.engine_patches.sglang import check, guard, targets

TABLE = targets.for_version(targets.installed_version())


def _one(hook: str) -> targets.Target:
    return next(t for t in TABLE if t.hook == hook)


def _refused(*hooks: str) -> dict[str, list[str]]:
    return {_one(h).path: [f"{_one(h).path}: gone"] for h in hooks}


def test_every_target_there_is_active():
    plan = guard.plan(TABLE, {})
    assert plan.state == c.PLUGIN_ACTIVE and plan.refused == () and plan.lifecycle and plan.heartbeats
    assert plan.install == TABLE


def test_an_optional_group_refused_alone_is_partial():
    plan = guard.plan(TABLE, _refused("on_request_state"))
    assert plan.state == c.PLUGIN_PARTIAL and plan.lifecycle
    # The traceparent chain is one group: its other hooks go with it, nothing else does.
    refused = {r.split(": ")[0] for r in plan.refused}
    assert refused == {guard.short(t) for t in TABLE if t.group == "traceparent"}
    assert _one("on_decode_transferred") in plan.install


def test_a_lifecycle_target_refused_refuses_the_lifecycle_but_heartbeats():
    plan = guard.plan(TABLE, _refused("on_decode_metadata_sent"))
    assert plan.state == c.PLUGIN_INACTIVE and not plan.lifecycle and plan.heartbeats
    assert {t.group for t in plan.install} == {"process", "shutdown"}
    assert "DecodePreallocQueue._send_kv_metadata: gone" in plan.refused
    assert any(r.startswith("DecodeTransferQueue._commit_transfer_to_req: lifecycle refused with "
                            "DecodePreallocQueue._send_kv_metadata") for r in plan.refused)
    assert len(plan.refused) + len(plan.install) == len(TABLE)


def test_an_essential_target_refused_leaves_nothing_to_install():
    plan = guard.plan(TABLE, _refused("on_scheduler_ready"))
    assert plan.state == c.PLUGIN_INACTIVE and not plan.heartbeats and plan.install == ()
    assert len(plan.refused) == len(TABLE)


def test_a_gap_row_is_refused_with_its_reason():
    rows = targets.for_version("0.5.11")
    plan = guard.plan(rows, {})
    assert plan.state == c.PLUGIN_INACTIVE and plan.heartbeats
    assert any("no SchedulerOutputStreamer" in r for r in plan.refused)
    assert [t.path for t in rows if t.hook == "on_loop_iteration"] == [
        "sglang.srt.managers.scheduler.Scheduler.process_input_requests"]


@pytest.mark.parametrize(("version", "gaps"), [("0.5.16", ["kv_concluded"]), ("0.5.13", ["shutdown", "kv_concluded"])])
def test_older_releases_lack_only_optional_rows(version, gaps):
    # Every lifecycle transition has a hook there; a Failed conclusion has no target before 0.5.17,
    # nor an orderly shutdown before 0.5.16.
    plan = guard.plan(targets.for_version(version), {})
    assert plan.state == c.PLUGIN_PARTIAL and plan.lifecycle and plan.heartbeats
    assert [t.group for t in targets.for_version(version) if t.gap] == gaps
    hooks = {t.hook for t in plan.install}
    assert "on_decode_transfer_queued" in hooks and "on_decode_metadata_sent" not in hooks


def test_rows_per_release_range():
    hooks_new = {t.hook for t in targets.for_version("0.5.23") if not t.gap}
    hooks_old = {t.hook for t in targets.for_version("0.5.11") if not t.gap}
    assert len(hooks_old) < len(hooks_new)
    # The hooks written for older releases only.
    assert hooks_old - hooks_new == {"on_decode_transfer_queued", "on_prefill_batch_returned"}
    # No version, or a source checkout's: the rows the table is written for, the newest release tested.
    assert targets.for_version("not a version") == targets.for_version(None) == targets.for_version(targets.TESTED[-1])


def test_check_on_the_installed_sglang_is_active(capsys):
    assert pdwatch(["check"]) == 0
    out = capsys.readouterr().out
    assert f"sglang {targets.installed_version()}" in out
    assert "plugin state: active" in out
    assert "refused" not in out


def test_check_names_a_missing_target_and_exits_non_zero(monkeypatch, capsys):
    ghost = targets.Target("sglang.srt.disaggregation.decode.DecodeTransferQueue.pop_transferred_v2", "after",
                           "on_decode_transferred", "renamed in a future SGLang", ("self",))
    monkeypatch.setattr(targets, "TARGETS", targets.TARGETS + (ghost,))
    assert pdwatch(["check", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["state"] == c.PLUGIN_INACTIVE and report["heartbeats"] and not report["lifecycle"]
    row = next(t for t in report["targets"] if t["target"] == ghost.path)
    assert row["result"] == check.REFUSED and "pop_transferred_v2 not defined" in row["why"]
    assert {t["result"] for t in report["targets"] if t["group"] == "process"} == {check.OK}
    assert pdwatch(["check", "--expect", "inactive"]) == 0
