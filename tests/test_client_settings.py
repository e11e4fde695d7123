"""One `ClientSettings` for `pdwatch diagnose`, `trace` and `report`: flag over environment over default,
the contract's variable names, errors that name their source, and every command reading a sidecar with it."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import tomllib

from pdwatch import contract as c
from pdwatch import diagnose, trace
from pdwatch.cli import main as pdwatch
from pdwatch.report import cli as report
from pdwatch.settings import ClientSettings, env_name

ROOT = Path(__file__).resolve().parent.parent
UNREACHABLE = "http://127.0.0.1:9"  # the discard port: nothing listens there


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in c.CLIENT_ENV:
        monkeypatch.delenv(name, raising=False)


def test_every_field_reads_the_variable_the_contract_names():
    assert {env_name(f) for f in ClientSettings.model_fields} == set(c.CLIENT_ENV)


def test_a_flag_wins_over_the_environment_which_wins_over_the_default(monkeypatch):
    s = ClientSettings.from_sources({})
    assert (s.sidecar, s.token, s.prometheus, s.prometheus_headers, s.timeout_s, s.trace_url) == (
        c.DEFAULT_SIDECAR_URL, None, None, {}, 10.0, None)
    monkeypatch.setenv(c.ENV_SIDECAR, "http://sidecar.example:4319/")
    monkeypatch.setenv(c.ENV_TOKEN, "from-env")
    monkeypatch.setenv(c.ENV_TIMEOUT, "3")
    s = ClientSettings.from_sources({})
    assert (s.sidecar, s.token, s.timeout_s) == ("http://sidecar.example:4319", "from-env", 3.0)
    s = ClientSettings.from_sources({"sidecar": "https://other.example", "token": "from-flag", "timeout_s": "7.5"})
    assert (s.sidecar, s.token, s.timeout_s) == ("https://other.example", "from-flag", 7.5)
    assert s.sidecar_headers == {"Authorization": "Bearer from-flag"}


def test_a_sidecar_flag_wins_over_a_prometheus_from_the_environment(monkeypatch):
    monkeypatch.setenv(c.ENV_PROMETHEUS, "http://prometheus.example:9090")
    assert ClientSettings.from_sources({}).prometheus == "http://prometheus.example:9090"
    assert ClientSettings.from_sources({"sidecar": "http://127.0.0.1:4320"}).prometheus is None


def test_prometheus_headers_are_read_as_the_otlp_exporters_write_them(monkeypatch):
    monkeypatch.setenv(c.ENV_PROMETHEUS_HEADERS, "X-Scope-OrgID=team-a,Authorization=Bearer%20abc")
    assert ClientSettings.from_sources({}).prometheus_headers == {"x-scope-orgid": "team-a",
                                                                  "authorization": "Bearer abc"}
    flagged = ClientSettings.from_sources({"prometheus_headers": "X-Scope-OrgID=team-b"})
    assert flagged.prometheus_headers == {"x-scope-orgid": "team-b"}


@pytest.mark.parametrize(("flags", "env", "says"), [
    ({"sidecar": "sidecar:4318"}, {}, "--sidecar='sidecar:4318': must be an http:// or https:// URL"),
    ({}, {c.ENV_PROMETHEUS: "ftp://p"}, f"{c.ENV_PROMETHEUS}='ftp://p': must be an http:// or https:// URL"),
    ({"timeout_s": "0"}, {}, "--timeout-s='0': Input should be greater than 0"),
    ({}, {c.ENV_TIMEOUT: "soon"}, f"{c.ENV_TIMEOUT}='soon': Input should be a valid number"),
    ({"trace_url": "https://jaeger.example/trace/"}, {}, "must contain {trace_id}"),
    ({}, {c.ENV_PROMETHEUS_HEADERS: "Authorization: Bearer s3cret"},
     f"{c.ENV_PROMETHEUS_HEADERS}: must be NAME=VALUE pairs separated by commas"),
])
def test_bad_input_is_refused_naming_the_flag_or_variable(monkeypatch, flags, env, says):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as caught:
        ClientSettings.from_sources(flags)
    assert says in str(caught.value)
    assert "s3cret" not in str(caught.value)  # a header is often a credential: never echoed


def test_neither_the_token_nor_a_header_reaches_a_log_line():
    s = ClientSettings.from_sources({"token": "t0ken", "prometheus_headers": "Authorization=Bearer%20h3ader"})
    assert "t0ken" not in repr(s) and "h3ader" not in repr(s)


@pytest.mark.parametrize(("command", "names"), [
    (diagnose, (c.ENV_SIDECAR, c.ENV_PROMETHEUS, c.ENV_TOKEN, c.ENV_PROMETHEUS_HEADERS, c.ENV_TIMEOUT)),
    (trace, (c.ENV_SIDECAR, c.ENV_TOKEN, c.ENV_TIMEOUT)),
    (report, c.CLIENT_ENV),
])
def test_each_command_documents_its_variables_and_the_one_default(command, names):
    text = " ".join(command.build_parser().format_help().split())
    for name in names:
        assert f"[env {name}," in text, name
    assert f"default {c.DEFAULT_SIDECAR_URL}]" in text


class Sidecar:
    """A stand-in sidecar on loopback that knows nothing (no cluster, no trace); remembers each request's token."""

    def __init__(self) -> None:
        seen = self.seen = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                seen.append((self.path, self.headers.get("Authorization")))
                body = json.dumps({"at_unix_s": 1.0, "instances": []} if "summary" in self.path else
                                  {"instances": []} if "history" in self.path else []).encode()
                self.send_response(404 if self.path.startswith("/api/v1/requests/") else 200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def sidecar():
    sc = Sidecar()
    yield sc
    sc.close()


def test_every_client_command_finds_the_sidecar_and_its_token_in_the_environment(monkeypatch, sidecar, capsys,
                                                                                   tmp_path):
    monkeypatch.setenv(c.ENV_SIDECAR, sidecar.url)
    monkeypatch.setenv(c.ENV_TOKEN, "env-token")
    assert pdwatch(["diagnose"]) == 0
    assert "no cluster reports" in capsys.readouterr().out
    assert pdwatch(["trace", "ab" * 16]) == 1
    assert f"the sidecar at {sidecar.url} knows no leg of trace" in capsys.readouterr().err
    assert pdwatch(["report", "--out", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "report.html").is_file()
    assert {path.split("?")[0] for path, _ in sidecar.seen} >= {c.PATH_DIAGNOSIS, "/api/v1/summary",
                                                                 "/api/v1/history", f"/api/v1/requests/{'ab' * 16}"}
    assert {token for _, token in sidecar.seen} == {"Bearer env-token"}
    sidecar.seen.clear()
    assert pdwatch(["diagnose", "--token", "flag-token"]) == 0
    assert sidecar.seen == [(c.PATH_DIAGNOSIS, "Bearer flag-token")]


@pytest.mark.parametrize("command", [["diagnose"], ["trace", "ab" * 16], ["report", "--out"]])
def test_every_client_command_says_which_sidecar_it_could_not_reach(monkeypatch, capsys, tmp_path, command):
    monkeypatch.setenv(c.ENV_SIDECAR, UNREACHABLE)
    assert pdwatch(command + [str(tmp_path)] if command[-1] == "--out" else command) in (1, 2)
    assert f"cannot reach the sidecar at {UNREACHABLE}" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["diagnose"], ["trace", "ab" * 16], ["report"]])
def test_every_client_command_refuses_a_bad_setting_before_reading_anything(monkeypatch, capsys, command):
    monkeypatch.setenv(c.ENV_TIMEOUT, "-1")
    assert pdwatch(command) == 2
    assert f"{c.ENV_TIMEOUT}=" in capsys.readouterr().err


def test_the_version_is_the_distributions():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert c.package_version() == version
    out = subprocess.run([sys.executable, "-m", "pdwatch.cli", "--version"], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == f"pdwatch {version}"


def test_the_sidecar_starts_from_its_own_layer():
    """`python -m pdwatch.sidecar` is the sidecar process (the testbed starts it so); it takes serve's flags."""
    done = subprocess.run([sys.executable, "-m", "pdwatch.sidecar", "--port", "70000"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "--port='70000'" in done.stderr
