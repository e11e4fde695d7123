"""`pdwatch dashboards push` through grafana-client against a loopback server
that answers as Grafana's HTTP API does."""

from __future__ import annotations

import socket

import pytest

from pdwatch import cli
from pdwatch.dashboards import render
from pdwatch.dashboards.push import PushError, push

# The `grafana` fixture (conftest.py) requires this token.
TOKEN = "glsa_test_token"


def test_first_push_creates_the_folder_and_saves_every_dashboard_in_it(grafana):
    generated = render.load()
    result = push(generated, url=grafana.url, token=TOKEN, folder="PD watch", folder_uid="pdwatch")

    assert result.folder_created
    st = grafana.state
    assert st.folders["pdwatch"]["title"] == "PD watch"
    assert [(r.method, r.path) for r in st.requests] == [
        ("GET", "/api/folders/pdwatch"), ("POST", "/api/folders"),
        ("POST", "/api/dashboards/db"), ("POST", "/api/dashboards/db"), ("POST", "/api/dashboards/db"),
    ]
    assert all(r.headers["Authorization"] == f"Bearer {TOKEN}" for r in st.requests)
    posts = [r.body for r in st.requests if r.path == "/api/dashboards/db"]
    for body, (name, doc) in zip(posts, generated.items()):
        assert body["folderUid"] == "pdwatch" and body["overwrite"] is True, name
        assert body["dashboard"]["id"] is None
        assert {k: v for k, v in body["dashboard"].items() if k != "id"} == doc, name
    assert sorted(st.dashboards) == ["pdwatch-request-flow", "pdwatch-self", "pdwatch-stuck-requests"]
    assert [s["version"] for s in result.saved] == [1, 1, 1]


def test_second_push_finds_the_folder_and_overwrites_by_uid(grafana):
    generated = render.load()
    push(generated, url=grafana.url, token=TOKEN)
    grafana.state.requests.clear()
    result = push(generated, url=grafana.url, token=TOKEN)

    assert not result.folder_created
    assert ("POST", "/api/folders") not in [(r.method, r.path) for r in grafana.state.requests]
    assert [s["version"] for s in result.saved] == [2, 2, 2]
    assert len(grafana.state.dashboards) == 3


def test_without_overwrite_an_existing_dashboard_is_a_clear_error(grafana):
    generated = render.load()
    push(generated, url=grafana.url, token=TOKEN)
    with pytest.raises(PushError, match="overwrite is off"):
        push(generated, url=grafana.url, token=TOKEN, overwrite=False)
    assert all(d["version"] == 1 for d in grafana.state.dashboards.values())


def test_a_wrong_token_is_reported_as_refused_credentials(grafana):
    with pytest.raises(PushError, match="refused the credentials"):
        push(render.load(), url=grafana.url, token="wrong")
    assert grafana.state.dashboards == {} and grafana.state.folders == {}


def test_an_unreachable_grafana_is_reported():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(PushError, match="cannot reach Grafana"):
        push(render.load(), url=f"http://127.0.0.1:{port}", token=TOKEN, timeout=2)


def test_pdwatch_dashboards_push_command(grafana, capsys, monkeypatch):
    monkeypatch.setenv("GRAFANA_TOKEN", TOKEN)
    assert cli.main(["dashboards", "push", "--url", grafana.url, "--folder", "pdwatch"]) == 0
    out = capsys.readouterr().out
    assert "folder 'pdwatch' (pdwatch) created" in out
    assert "saved pdwatch-stuck-requests version 1 at /d/pdwatch-stuck-requests/stuck-requests" in out

    assert cli.main(["dashboards", "push", "--url", grafana.url, "--no-overwrite"]) == 1
    assert "overwrite is off" in capsys.readouterr().err
