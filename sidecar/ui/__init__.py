"""The live page at /ui: stuck legs with their waterfalls, instances with their GPUs, the diagnosis.

The page is static HTML, CSS and JavaScript with a vendored chart library
(vendor/README.md); it reads the sidecar's JSON API from the browser and
refreshes itself. One route of its own, /ui/api/stuck, serves the oldest stuck
legs that match a filter with the counts behind them, so that ten thousand
stuck legs cost the browser the same as a hundred. Every route here sits
behind the same bearer token as the API.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import FileResponse, RedirectResponse

from .. import views
from ..auth import Auth
from ..evaluation import StuckLeg

HERE = Path(__file__).resolve().parent
ASSET_DIRS = {"static": HERE / "static", "vendor": HERE / "vendor"}
MEDIA = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
         ".html": "text/html; charset=utf-8"}
# Only the files shipped beside this module are served: names are looked up, never joined into paths.
ASSETS = {(kind, p.name): p for kind, d in ASSET_DIRS.items() if d.is_dir()
          for p in d.iterdir() if p.is_file() and p.suffix in MEDIA}
# The assets change only with a new release; the page itself is never cached (the token may change).
ASSET_CACHE = "private, max-age=300"
ROWS_MAX = 2000

router = APIRouter(include_in_schema=False)


@router.get("/ui")
def page(_: Auth) -> FileResponse:
    return FileResponse(ASSET_DIRS["static"] / "index.html", media_type=MEDIA[".html"],
                        headers={"Cache-Control": "no-store"})


@router.get("/ui/")
def page_slash(_: Auth) -> RedirectResponse:
    # Relative: the page works under a reverse proxy's path prefix, and its relative links with it.
    return RedirectResponse("../ui", status_code=308)


def _haystack(s: StuckLeg) -> str:
    return " ".join(str(x) for x in (s.trace_id, s.rid, s.room, s.cluster, s.role, s.stage, s.pd_instance,
                                     s.peer or "", s.reason)).lower()


@router.get("/ui/api/stuck")
def stuck_page(request: Request, _: Auth, limit: int = Query(200, ge=1, le=ROWS_MAX),
               q: str = Query("", max_length=200)) -> dict[str, Any]:
    """The oldest `limit` stuck legs matching every word of `q`, and counts over all stuck legs."""
    ev = request.app.state.sidecar.latest()
    terms = q.lower().split()
    by_group: Counter[tuple[str, str, str]] = Counter()
    by_reason: Counter[str] = Counter()
    legs: list[dict[str, Any]] = []
    matched = 0
    for s in ev.stuck:  # oldest first
        by_group[(s.cluster, s.role, s.stage)] += 1
        by_reason[s.reason] += 1
        if terms:
            hay = _haystack(s)
            if not all(t in hay for t in terms):
                continue
        matched += 1
        if len(legs) < limit:
            legs.append(views.stuck_leg(s, ev))
    return {
        "at_unix_s": round(ev.at_ns / 1e9, 3),
        "total": len(ev.stuck),
        "matched": matched,
        "by_stage": [{"cluster": cl, "role": role, "stage": stage, "stuck": n}
                     for (cl, role, stage), n in sorted(by_group.items())],
        "by_reason": dict(sorted(by_reason.items())),
        "legs": legs,
    }


# After /ui/api/stuck: this pattern would match that path too, and routes match in order.
@router.get("/ui/{kind}/{name}")
def asset(kind: str, name: str, _: Auth) -> FileResponse:
    path = ASSETS.get((kind, name))
    if path is None:
        raise HTTPException(404, "no such asset")
    return FileResponse(path, media_type=MEDIA[path.suffix], headers={"Cache-Control": ASSET_CACHE})


__all__ = ["router"]
