"""Sends the dashboards to a Grafana server through its HTTP API (grafana-client):
one folder, each dashboard saved into it by uid, overwriting the previous
version unless told not to."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import requests
from grafana_client import GrafanaApi
from grafana_client.client import GrafanaClientError, GrafanaException, GrafanaUnauthorizedError

DEFAULT_URL = "http://127.0.0.1:3000"
DEFAULT_FOLDER = "pdwatch"
DEFAULT_FOLDER_UID = "pdwatch"


class PushError(RuntimeError):
    """A push that Grafana refused or could not be reached for, said plainly."""


@dataclass
class PushResult:
    folder_uid: str
    folder_created: bool
    saved: list[dict[str, Any]] = field(default_factory=list)  # Grafana's answer per dashboard


def _ensure_folder(api: GrafanaApi, title: str, uid: str) -> bool:
    """True when the folder had to be created."""
    try:
        api.folder.get_folder(uid)
        return False
    except GrafanaClientError as exc:
        if exc.status_code != 404:
            raise
    api.folder.create_folder(title, uid=uid)
    return True


def push(dashboards: dict[str, dict[str, Any]], *, url: str = DEFAULT_URL, token: str | None = None,
         folder: str = DEFAULT_FOLDER, folder_uid: str = DEFAULT_FOLDER_UID, overwrite: bool = True,
         timeout: float = 10.0) -> PushResult:
    """Save each dashboard (name -> dashboard JSON) into `folder` on the Grafana at `url`.

    `token` is a Grafana service account token (sent as a Bearer token); None
    sends no credentials (or those in the URL, `http://user:pass@host:3000`).
    """
    if not dashboards:
        raise PushError("no dashboards to push")
    api = GrafanaApi.from_url(url, credential=token or None, timeout=timeout)
    try:
        created = _ensure_folder(api, folder, folder_uid)
        result = PushResult(folder_uid=folder_uid, folder_created=created)
        for name, doc in dashboards.items():
            if not doc.get("uid"):
                raise PushError(f"{name}: dashboard has no uid, so a push could not overwrite it later")
            body = {
                # id None: Grafana matches by uid, so the same dashboard is updated in place.
                "dashboard": {**doc, "id": None},
                "folderUid": folder_uid,
                "overwrite": overwrite,
                "message": "pdwatch dashboards push",
            }
            try:
                result.saved.append(api.dashboard.update_dashboard(body))
            except GrafanaClientError as exc:
                if exc.status_code == 412:
                    raise PushError(
                        f"{name}: Grafana already has dashboard {doc['uid']!r} and overwrite is off "
                        f"({exc.message})") from exc
                raise
        return result
    except GrafanaUnauthorizedError as exc:
        raise PushError(f"Grafana at {url} refused the credentials (401): give a valid --token") from exc
    except GrafanaException as exc:
        raise PushError(f"Grafana at {url} answered {exc.status_code}: {exc.message}") from exc
    except requests.exceptions.RequestException as exc:
        raise PushError(f"cannot reach Grafana at {url}: {exc}") from exc
