"""Real Prometheus and Alertmanager on loopback ports, wired to the repository's
rules and Alertmanager configuration, with a webhook receiver that records
every notification. Used by the demo and the end-to-end tests.

Prometheus scrapes the given sidecars and evaluates `alerts/pdwatch-alerts.yml`;
Alertmanager runs `alerts/alertmanager.example.yml` with its webhook URLs
pointed at the recorder here (routes, grouping and inhibitions unchanged,
except waits shortened so a demo does not sit through production timers).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import yaml

from pdwatch import alerts

from .processes import free_port

# A JSON object as Prometheus, Alertmanager and its webhooks send them.
Json = dict[str, Any]

RULES = Path(alerts.__file__).resolve().parent / "pdwatch-alerts.yml"
AM_CONFIG = RULES.with_name("alertmanager.example.yml")


class MonitoringError(RuntimeError):
    pass


class WebhookRecorder:
    """An Alertmanager webhook receiver that keeps what it was sent, with arrival times."""

    def __init__(self) -> None:
        self.received: list[tuple[float, str, Json]] = []  # (time.time(), path, payload)
        self._lock = threading.Lock()
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(min(length, 1 << 20))
                try:
                    payload = json.loads(body)
                except ValueError:
                    payload = {"unparsed": body.decode("utf-8", "replace")}
                with recorder._lock:
                    recorder.received.append((time.time(), self.path, payload))
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> WebhookRecorder:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def alerts(self, name: str | None = None, status: str = "firing") -> list[tuple[float, str, Json]]:
        """(arrival time, receiver path, alert) for each alert in each notification."""
        with self._lock:
            out = []
            for t, path, payload in self.received:
                for alert in payload.get("alerts", []):
                    if alert.get("status") == status and (name is None or alert["labels"].get("alertname") == name):
                        out.append((t, path, alert))
            return out


def _binary(*names: str) -> str:
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    raise MonitoringError(f"none of {', '.join(names)} is installed (Debian packages prometheus and "
                          "prometheus-alertmanager; `make test` installs them)")


def _program(proc: subprocess.Popen[bytes]) -> str:
    """The program a process runs, for messages."""
    args = proc.args  # a list here: Monitoring starts each with one
    return os.fsdecode(args[0]) if isinstance(args, list) else str(args)


class Monitoring:
    def __init__(self, sidecars: list[str], *, scrape_interval_s: float = 2.0, evaluation_interval_s: float = 1.0,
                 group_wait_s: float = 1.0, rules: Path = RULES, am_config: Path = AM_CONFIG,
                 workdir: str | None = None):
        self.sidecars = [s.replace("http://", "").rstrip("/") for s in sidecars]
        self.scrape_s, self.eval_s, self.group_wait_s = scrape_interval_s, evaluation_interval_s, group_wait_s
        self.rules, self.am_config = Path(rules), Path(am_config)
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="pdwatch-monitoring-")
            workdir = self._tmp.name
        self.dir = Path(workdir)
        self.webhook = WebhookRecorder()
        self.prom_port, self.am_port = free_port(), free_port()
        self.prometheus_url = f"http://127.0.0.1:{self.prom_port}"
        self.alertmanager_url = f"http://127.0.0.1:{self.am_port}"
        self.procs: list[subprocess.Popen[bytes]] = []

    def _alertmanager_config(self) -> Json:
        config: Json = yaml.safe_load(self.am_config.read_text())
        wait = f"{self.group_wait_s:g}s"

        def shorten(route: Json) -> None:
            route["group_wait"] = wait
            route["group_interval"] = f"{max(self.group_wait_s, 1):g}s"
            for child in route.get("routes", []):
                shorten(child)

        shorten(config["route"])
        for receiver in config.get("receivers", []):
            for hook in receiver.get("webhook_configs", []):
                # Keep the receiver's path so the recorder can tell pager from tickets.
                path = "/" + hook["url"].split("/", 3)[3] if hook["url"].count("/") >= 3 else "/"
                hook["url"] = self.webhook.url + path
        return config

    def _rules(self) -> Json:
        """The rule file with every group evaluated at this Prometheus's pace (each group names its own
        interval, seconds apart, for production; a test judges in seconds, as the Alertmanager above)."""
        rules: Json = yaml.safe_load(self.rules.read_text())
        for group in rules.get("groups", []):
            group["interval"] = f"{self.eval_s:g}s"
        return rules

    def _prometheus_config(self) -> Json:
        return {
            "global": {"scrape_interval": f"{self.scrape_s:g}s", "evaluation_interval": f"{self.eval_s:g}s"},
            "rule_files": [str(self.dir / "rules.yml")],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{self.am_port}"]}]}]},
            "scrape_configs": [{"job_name": "pdwatch", "static_configs": [{"targets": self.sidecars}]}],
        }

    def start(self, timeout_s: float = 30.0) -> Monitoring:
        self.webhook.start()
        (self.dir / "alertmanager.yml").write_text(yaml.safe_dump(self._alertmanager_config()))
        (self.dir / "rules.yml").write_text(yaml.safe_dump(self._rules()))
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(self._prometheus_config()))
        log = open(self.dir / "monitoring.log", "ab")
        self.procs.append(subprocess.Popen([
            _binary("prometheus-alertmanager", "alertmanager"), f"--config.file={self.dir / 'alertmanager.yml'}",
            f"--storage.path={self.dir / 'am-data'}", f"--web.listen-address=127.0.0.1:{self.am_port}",
            "--cluster.listen-address=",
        ], stdout=log, stderr=log, stdin=subprocess.DEVNULL))
        self.procs.append(subprocess.Popen([
            _binary("prometheus"), f"--config.file={self.dir / 'prometheus.yml'}",
            f"--storage.tsdb.path={self.dir / 'prom-data'}", f"--web.listen-address=127.0.0.1:{self.prom_port}",
        ], stdout=log, stderr=log, stdin=subprocess.DEVNULL))
        for url in (self.alertmanager_url, self.prometheus_url):
            self._wait_ready(url, timeout_s)
        self._wait_scraping(timeout_s)
        return self

    def _wait_scraping(self, timeout_s: float) -> None:
        """Until every sidecar has been scraped once, so nothing that happens next predates the first sample."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if len(self.query('up{job="pdwatch"} == 1')) >= len(self.sidecars):
                    return
            except (httpx.HTTPError, MonitoringError):
                pass
            time.sleep(0.2)
        raise MonitoringError(f"Prometheus did not scrape {', '.join(self.sidecars)} within {timeout_s:.0f} s")

    def _wait_ready(self, url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    tail = (self.dir / "monitoring.log").read_text(errors="replace")[-2000:]
                    raise MonitoringError(f"{_program(p)} exited with status {p.returncode}:\n{tail}")
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise MonitoringError(f"{url} not ready after {timeout_s:.0f} s")

    def query(self, expr: str) -> list[Json]:
        r = httpx.get(f"{self.prometheus_url}/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        if body.get("status") != "success":
            raise MonitoringError(f"query {expr!r}: {body.get('error')}")
        result: list[Json] = body["data"]["result"]
        return result

    def alerts(self) -> list[Json]:
        """Every alert Prometheus holds now, pending or firing."""
        held: list[Json] = httpx.get(f"{self.prometheus_url}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
        return held

    def firing(self) -> list[Json]:
        return [a for a in self.alerts() if a["state"] == "firing"]

    def alert_names(self) -> dict[str, list[str]]:
        """The names of the alerts held now by state ("pending", "firing"), sorted, each once; one request."""
        names: dict[str, set[str]] = {"pending": set(), "firing": set()}
        for a in self.alerts():
            names.setdefault(a["state"], set()).add(a["labels"]["alertname"])
        return {state: sorted(n) for state, n in names.items()}

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.procs.clear()
        self.webhook.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> Monitoring:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
