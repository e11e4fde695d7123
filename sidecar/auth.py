"""The bearer-token check shared by every guarded route (ingest, the API, /ui, the API docs)."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, HTTPException, Request


async def authorized(request: Request) -> None:
    # async: a plain def dependency would hop to the thread pool on every request, ingest included.
    token = request.app.state.sidecar.settings.token
    if not token:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    # Constant-time compare, so response timing does not reveal the token.
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})


# Ingest, the API, /ui and the API docs need the token when one is set; /metrics and /healthz stay open.
Auth = Annotated[None, Depends(authorized)]
