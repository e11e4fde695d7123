"""Fixture `grafana`: a loopback HTTP server that answers the few Grafana API calls a push makes,
as Grafana 11 answers them, and records every request it receives."""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class GrafanaState:
    token: str
    requests: list[Recorded] = field(default_factory=list)
    folders: dict[str, dict[str, Any]] = field(default_factory=dict)
    dashboards: dict[str, dict[str, Any]] = field(default_factory=dict)  # uid -> {dashboard, folderUid, version}
    lock: threading.Lock = field(default_factory=threading.Lock)


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


class _Handler(BaseHTTPRequestHandler):
    state: GrafanaState

    def log_message(self, *args):  # keep test output clean
        pass

    def _answer(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _handle(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        st = self.state
        with st.lock:
            st.requests.append(Recorded(method, self.path, dict(self.headers), body))
            if self.headers.get("Authorization") != f"Bearer {st.token}":
                return self._answer(401, {"message": "Unauthorized"})
            if method == "GET" and self.path.startswith("/api/folders/"):
                uid = self.path.rsplit("/", 1)[1]
                if uid not in st.folders:
                    return self._answer(404, {"message": "folder not found", "status": "not-found"})
                return self._answer(200, st.folders[uid])
            if method == "POST" and self.path == "/api/folders":
                uid = body.get("uid") or f"f{len(st.folders) + 1}"
                if uid in st.folders:
                    return self._answer(409, {"message": "a folder with the same uid already exists"})
                folder = {"id": len(st.folders) + 1, "uid": uid, "title": body["title"],
                          "url": f"/dashboards/f/{uid}/{_slug(body['title'])}", "version": 1}
                st.folders[uid] = folder
                return self._answer(200, folder)
            if method == "POST" and self.path == "/api/dashboards/db":
                dash = body["dashboard"]
                uid = dash.get("uid")
                if body.get("folderUid") and body["folderUid"] not in st.folders:
                    return self._answer(400, {"message": "folder not found"})
                old = st.dashboards.get(uid)
                if old and not body.get("overwrite"):
                    return self._answer(412, {"message": "A dashboard with the same uid already exists",
                                              "status": "name-exists"})
                version = old["version"] + 1 if old else 1
                st.dashboards[uid] = {"dashboard": dash, "folderUid": body.get("folderUid"), "version": version}
                return self._answer(200, {"id": list(st.dashboards).index(uid) + 1, "uid": uid,
                                          "url": f"/d/{uid}/{_slug(dash['title'])}", "status": "success",
                                          "version": version, "slug": _slug(dash["title"])})
            return self._answer(404, {"message": "Not found"})

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")


class FakeGrafana:
    def __init__(self, token: str):
        self.state = GrafanaState(token=token)
        handler = type("Handler", (_Handler,), {"state": self.state})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeGrafana:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


GRAFANA_TOKEN = "glsa_test_token"


@pytest.fixture
def grafana():
    with FakeGrafana(GRAFANA_TOKEN) as server:
        yield server
