"""`pdwatch trace TRACE_ID`: both legs of one request as a waterfall in the
terminal, from a sidecar's /api/v1/requests/{trace_id}; `--jaeger-json FILE`
writes the same request in the JSON that Jaeger's UI opens ("JSON File" tab).

Open stages are drawn up to "now" (the sidecar's clock, in the engine's time)
and marked open; a stage past its stuck threshold is marked STUCK.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import sys
from dataclasses import dataclass
from typing import Any

from pdwatch import contract as c
from pdwatch import settings as client
from pdwatch.client import SidecarClient, SidecarError

TRACE_ID = re.compile(r"^[0-9a-fA-F]{32}$")
LABEL_W = 24  # the stage / leg column
NOTE_W = 30  # duration and marks
MIN_BAR_W = 10


@dataclass(frozen=True)
class Row:
    """One line of the waterfall: a leg or one of its stages, in seconds since the epoch (engine clock)."""

    leg: int  # index of the leg in the request detail
    label: str
    start: float
    end: float
    open: bool = False
    stuck: bool = False
    error: str | None = None
    threshold_s: float | None = None
    is_leg: bool = False


def _now(detail: dict[str, Any]) -> float | None:
    """The sidecar's "now" in engine time: an open leg's stage entry plus its age."""
    nows = [leg["stage_since_unix_s"] + leg["stage_age_s"] for leg in detail["legs"]
            if leg.get("state") == "open" and leg.get("stage_since_unix_s") is not None
            and leg.get("stage_age_s") is not None]
    return max(nows) if nows else None


def rows(detail: dict[str, Any]) -> list[Row]:
    """Every leg and stage of a request detail, open stages ending at now."""
    now = _now(detail)
    out: list[Row] = []
    for i, leg in enumerate(detail["legs"]):
        stage_rows = [
            Row(i, s["stage"], s["start_unix_s"], s["end_unix_s"], error=s.get("error"))
            for s in leg.get("stages", []) if s.get("start_unix_s") is not None and s.get("end_unix_s") is not None
        ]
        is_open = leg.get("state") == "open"
        if is_open and leg.get("stage") and leg.get("stage_since_unix_s") is not None:
            since = leg["stage_since_unix_s"]
            stage_rows.append(Row(i, leg["stage"], since, max(since, now if now is not None else since), open=True,
                                  stuck=bool(leg.get("stuck")), threshold_s=leg.get("threshold_s")))
        starts = [r.start for r in stage_rows] + ([leg["arrived_unix_s"]] if leg.get("arrived_unix_s") else [])
        ends = [r.end for r in stage_rows] + ([leg["ended_unix_s"]] if leg.get("ended_unix_s") else [])
        if not starts:
            continue
        end = max(ends) if not is_open or now is None else max(max(ends), now)
        out.append(Row(i, leg["role"], min(starts), end, open=is_open, stuck=any(r.stuck for r in stage_rows),
                       is_leg=True))
        out.extend(stage_rows)
    return out


def _bar(row: Row, t0: float, span: float, width: int, ascii_only: bool) -> str:
    def col(t: float) -> int:
        return min(width - 1, max(0, int((t - t0) / span * width))) if span > 0 else 0

    a, b = col(row.start), col(row.end)
    full, opened = ("#", "=") if ascii_only else ("\u2588", "\u2592")
    fill = opened if row.open else full
    body = fill * (b - a + 1)
    if row.open:
        body = body[:-1] + ">" if len(body) > 1 else ">"
    if row.error:
        body = body[:-1] + "x"
    return (" " * a + body).ljust(width)[:width]


def _note(row: Row) -> str:
    secs = row.end - row.start
    text = f"{secs:9.3f} s" if secs < 100 else f"{secs:9.1f} s"
    if row.stuck and not row.is_leg:
        text += f"  STUCK (>{row.threshold_s:g} s)" if row.threshold_s is not None else "  STUCK"
    elif row.open and not row.is_leg:
        text += "  open"
    if row.error:
        text += f"  error: {row.error}"
    return text


def render(detail: dict[str, Any], width: int = 100, ascii_only: bool = False) -> str:
    """The waterfall as text, `width` columns wide."""
    all_rows = rows(detail)
    tid = detail["trace_id"]
    if not all_rows:
        return f"trace {tid}: no stage times known yet"
    t0 = min(r.start for r in all_rows)
    t1 = max(r.end for r in all_rows)
    bar_w = max(MIN_BAR_W, width - LABEL_W - NOTE_W - 2)
    out = [f"trace {tid}  {len(detail['legs'])} leg(s) over {t1 - t0:.3f} s"
           + ("  (open stages drawn to now)" if _now(detail) is not None else "")]
    out.append(" " * LABEL_W + "|" + "0 s".ljust(bar_w - 12) + f"{t1 - t0:10.3f} s"[-12:].rjust(12) + "|")
    for row in all_rows:
        leg = detail["legs"][row.leg]
        if row.is_leg:
            state = leg.get("outcome") or ("open" if leg.get("state") == "open" else "ended, no leg span")
            head = f"{leg['role']} {leg.get('pd_instance', '')}  rid {leg.get('rid') or '?'}"
            if leg.get("bootstrap_room") is not None:
                head += f"  room {leg['bootstrap_room']}"
            out.append(f"{head}  [{state}{', STUCK' if row.stuck else ''}]")
            label = f"  {c.SPAN_LEG}"
        else:
            label = f"    {row.label}"
        out.append(label[:LABEL_W].ljust(LABEL_W) + "|" + _bar(row, t0, t1 - t0, bar_w, ascii_only) + "|"
                   + _note(row))
    return "\n".join(out)


# ---- Jaeger UI JSON ----------------------------------------------------------
#
# The shape Jaeger's query service answers on /api/traces/{id} and its UI reads
# back from an uploaded file: jaeger-ui's trace reducer (`loadJsonDone` in
# packages/jaeger-ui/src/reducers/trace) takes `payload.data`, a list of traces
# each with a `spans` list, and transforms them with `transformTraceData`, which
# looks each span's process up in the trace's `processes` by `processID`, links
# spans through `references` ({refType: CHILD_OF, traceID, spanID}) and reads
# `startTime` and `duration` in microseconds. Tags are {key, type, value} with
# type one of string, bool, int64, float64 (Jaeger's model/json KeyValue).


def _tag(key: str, value: object) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"key": key, "type": "bool", "value": value}
    if isinstance(value, int):
        return {"key": key, "type": "int64", "value": value}
    if isinstance(value, float):
        return {"key": key, "type": "float64", "value": value}
    return {"key": key, "type": "string", "value": str(value)}


def _synthetic_id(*parts: object) -> str:
    """A stable span id for what the API reports without one (stages, pd.stuck)."""
    return hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()[:16]


def _us(seconds: float) -> int:
    return int(round(seconds * 1e6))


def jaeger_json(detail: dict[str, Any], family: dict[str, str] | None = None) -> dict[str, Any]:
    """The request detail as a Jaeger UI trace file ({"data": [trace]})."""
    tid = detail["trace_id"]
    spans: list[dict[str, Any]] = []
    processes: dict[str, Any] = {}
    all_rows = rows(detail)
    for i, leg in enumerate(detail["legs"]):
        pid = f"p{i + 1}"
        processes[pid] = {
            "serviceName": leg.get("pd_instance") or leg["role"],
            "tags": [_tag(c.R_CLUSTER, leg.get("cluster", "")), _tag(c.R_ROLE, leg["role"]),
                     _tag(c.R_INSTANCE_ID, leg.get("incarnation") or "")],
        }
        leg_rows = [r for r in all_rows if r.leg == i]
        if not leg_rows:
            continue
        leg_row = leg_rows[0]
        leg_id = leg.get("span_id") or _synthetic_id(tid, leg["role"])
        leg_tags = [_tag(c.A_ROLE, leg["role"]), _tag(c.A_RID, leg.get("rid") or ""),
                    _tag(c.A_INSTANCE, leg.get("pd_instance", ""))]
        if leg.get("bootstrap_room") is not None:
            leg_tags.append(_tag(c.A_ROOM, leg["bootstrap_room"]))
        if leg.get("outcome"):
            leg_tags.append(_tag(c.A_OUTCOME, leg["outcome"]))
        if leg_row.open:
            leg_tags.append(_tag("pdwatch.open", True))
        if not leg.get("span_id"):
            leg_tags.append(_tag("pdwatch.synthetic_id", True))

        def span(span_id: str, name: str, row_start: float, row_end: float, tags: list[dict[str, Any]],
                 parent: bool = True, leg_id: str = leg_id, pid: str = pid) -> dict[str, Any]:
            return {
                "traceID": tid, "spanID": span_id, "operationName": name, "flags": 1,
                "references": [{"refType": "CHILD_OF", "traceID": tid, "spanID": leg_id}] if parent else [],
                "startTime": _us(row_start), "duration": max(0, _us(row_end) - _us(row_start)),
                "tags": tags, "logs": [], "processID": pid, "warnings": None,
            }

        spans.append(span(leg_id, c.SPAN_LEG, leg_row.start, leg_row.end, leg_tags, parent=False))
        for r in leg_rows[1:]:
            tags = [_tag(c.A_STAGE, r.label), _tag("pdwatch.synthetic_id", True)]
            if r.open:
                tags.append(_tag("pdwatch.open", True))
            if r.error:
                tags += [_tag("error", True), _tag("otel.status_code", "ERROR"),
                         _tag("otel.status_description", r.error)]
            spans.append(span(_synthetic_id(tid, leg["role"], r.label, r.start), c.stage_span_name(r.label),
                              r.start, r.end, tags))
            if r.stuck:
                # What the sidecar's forwarder sends as pd.stuck (contract section 10).
                thr = f" (threshold {r.threshold_s:.0f} s)" if r.threshold_s is not None else ""
                desc = f"stuck in {r.label} for {r.end - r.start:.0f} s{thr}"
                spans.append(span(_synthetic_id(tid, leg["role"], c.SPAN_STUCK, r.start), c.SPAN_STUCK, r.start,
                                  r.end, [
                                      _tag(c.A_ROLE, leg["role"]), _tag(c.A_STAGE, r.label),
                                      _tag(c.A_INSTANCE, leg.get("pd_instance", "")),
                                      _tag(c.A_FAMILY, (family or {}).get(leg.get("cluster", "")) or "unknown"),
                                      _tag("error", True), _tag("otel.status_code", "ERROR"),
                                      _tag("otel.status_description", desc), _tag("pdwatch.synthetic_id", True),
                                  ]))
    return {"data": [{"traceID": tid, "spans": spans, "processes": processes, "warnings": None}]}


# ---- command -------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdwatch trace", description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("trace_id", metavar="TRACE_ID", help="32 hex digits")
    client.add_arguments(ap, "sidecar", "token")
    ap.add_argument("--jaeger-json", metavar="FILE", help="also write the trace as a Jaeger UI JSON file")
    ap.add_argument("--width", type=int, default=None, help="columns to draw in (default: the terminal's)")
    ap.add_argument("--ascii", action="store_true", help="draw bars with ASCII characters only")
    client.add_arguments(ap, "timeout_s")
    return ap


def fetch(settings: client.ClientSettings, trace_id: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The request detail, and each cluster's diagnosed family (best effort, for pd.stuck)."""
    with SidecarClient(settings) as sidecar:
        try:
            detail: dict[str, Any] = sidecar.get(c.PATH_REQUEST.format(trace_id=trace_id))
        except SidecarError as exc:
            if exc.status == 404:
                raise SidecarError(f"the sidecar at {sidecar.url} knows no leg of trace {trace_id}", 404) from None
            raise
        family: dict[str, str] = {}
        try:
            family = {v["cluster"]: v["family"] for v in sidecar.get(c.PATH_DIAGNOSIS) if v.get("family")}
        except SidecarError:
            pass
    return detail, family


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not TRACE_ID.match(args.trace_id):
        print(f"pdwatch trace: {args.trace_id!r} is not a trace id (32 hex digits)", file=sys.stderr)
        return 2
    settings = client.for_command("pdwatch trace", args)
    if settings is None:
        return 2
    try:
        detail, family = fetch(settings, args.trace_id.lower())
    except SidecarError as exc:
        print(f"pdwatch trace: {exc}", file=sys.stderr)
        return 1
    width = args.width or shutil.get_terminal_size((100, 24)).columns
    print(render(detail, width=width, ascii_only=args.ascii))
    if args.jaeger_json:
        with open(args.jaeger_json, "w", encoding="utf-8") as f:
            json.dump(jaeger_json(detail, family), f, indent=1)
        print(f"wrote {args.jaeger_json}: open it in Jaeger's UI (Search, JSON File)")
    return 0
