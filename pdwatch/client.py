"""A sidecar's JSON API as the client commands read it: one connection, the token, and errors that say where."""

from __future__ import annotations

from types import TracebackType
from typing import Any

import httpx

from pdwatch.settings import ClientSettings


class SidecarError(RuntimeError):
    """The sidecar could not be reached, or answered something other than 200 with JSON; `status` when it answered."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class SidecarClient:
    def __init__(self, settings: ClientSettings):
        self.url = settings.sidecar
        self._http = httpx.Client(base_url=self.url, timeout=settings.timeout_s, headers=settings.sidecar_headers)

    def get(self, path: str, **params: Any) -> Any:
        """The JSON body of GET `path`; SidecarError otherwise."""
        try:
            r = self._http.get(path, params=params or None)
        except httpx.HTTPError as exc:
            raise SidecarError(f"cannot reach the sidecar at {self.url}: {exc}") from None
        if r.status_code != 200:
            raise SidecarError(f"{self.url}{path} answered {r.status_code}: {r.text[:200]}", r.status_code)
        try:
            return r.json()
        except ValueError:
            raise SidecarError(f"{self.url}{path} answered a body that is not JSON", r.status_code) from None

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
