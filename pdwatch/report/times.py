"""Times as people write them on the command line, and as the report prints them (UTC)."""

from __future__ import annotations

import re
from datetime import datetime, timezone

from .model import ReportError

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_time(text: str | None, now: float) -> float:
    """`now`, a duration before now (`30m`, `now-2h`, `-90s`), Unix seconds, or ISO 8601 (UTC unless it says)."""
    if text is None or text.strip() in ("", "now"):
        return now
    s = text.strip()
    m = re.fullmatch(r"(?:now\s*)?-?\s*(\d+(?:\.\d+)?)\s*([smhd])", s)
    if m:
        return now - float(m[1]) * UNITS[m[2]]
    try:
        return float(s)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(s.replace("Z", "+00:00"))
    except ValueError:
        raise ReportError(f"cannot read the time {text!r}: use now, 30m, now-2h, Unix seconds or ISO 8601") from None
    return (dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)).timestamp()


def utc(t: float | None, with_date: bool = True) -> str:
    if t is None:
        return "–"
    fmt = "%Y-%m-%d %H:%M:%S UTC" if with_date else "%H:%M:%S"
    return datetime.fromtimestamp(t, timezone.utc).strftime(fmt)


def duration(s: float | None) -> str:
    if s is None:
        return "–"
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def dates(ts: list[float]) -> list[datetime]:
    """Unix seconds as aware UTC datetimes, for matplotlib's date axis."""
    return [datetime.fromtimestamp(t, timezone.utc) for t in ts]
