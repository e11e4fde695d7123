"""`pdwatch diagnose`: the failure family behind stuck requests, with its evidence and the action.

From one sidecar (its /api/v1/diagnosis) or, with --prometheus, from a
Prometheus that scrapes every sidecar of the cluster: the same classifier
reasons over either.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pdwatch import contract as c
from pdwatch import settings as client


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdwatch diagnose", description=(__doc__ or "").splitlines()[0])
    client.add_arguments(ap.add_mutually_exclusive_group(), "sidecar", "prometheus",
                         notes={"prometheus": "read instead of the sidecar when set"})
    ap.add_argument("--cluster", help="only this cluster")
    ap.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    client.add_arguments(ap, "token", "prometheus_headers", "timeout_s")
    ap.add_argument("--flow-window-s", type=float, default=None,
                    help=f"with --prometheus: the sidecars' flow window [env {c.ENV_FLOW_WINDOW}, "
                         f"default {c.DEFAULT_FLOW_WINDOW_S:g}]")
    return ap


def render(verdicts: list[dict[str, Any]]) -> str:
    if not verdicts:
        return "no cluster reports to pdwatch yet"
    out = []
    for v in verdicts:
        if not v.get("family"):
            out.append(f"cluster {v['cluster']}: no failure suspected ({'; '.join(v.get('evidence', []))})")
            continue
        out.append(f"cluster {v['cluster']}: {v['family'].upper()} (confidence {v['confidence']:.2f})")
        for sentence in v.get("evidence", []):
            out.append(f"  - {sentence}")
        out.append(f"  action: {v['action']}")
        contrast = v.get("contrast") or []
        if contrast:
            out.append("  what sets the stuck legs apart:")
            out.extend(f"    - {x.get('sentence') or _ratio_sentence(x)}" for x in contrast)
        elif v.get("contrast") is not None and v.get("family"):
            out.append("  what sets the stuck legs apart: nothing clear (they share no attribute the flowing legs lack)")
        for cap in v.get("captures") or []:
            where = f"{cap['pd_instance']} rank {cap['tp_rank']} (pid {cap['pid']}), taken because {cap['reason']}"
            if cap.get("error"):
                out.append(f"  stacks of {where}: not taken: {cap['error']}")
                continue
            out.append(f"  stacks of {where}:")
            out.extend(f"    | {line}" for line in cap["stacks"].rstrip().splitlines()[:60])
        others = [f for f in v.get("findings", [])[1:]]
        for f in others:
            out.append(f"  also: {f['family']} ({f['confidence']:.2f})")
            for sentence in f["evidence"]:
                out.append(f"    - {sentence}")
    return "\n".join(out)


def _ratio_sentence(x: dict[str, Any]) -> str:
    return (f"{x['attribute']} {x['value']}: {x['stuck'] * 100:.0f} % of stuck legs, "
            f"{x['flowing'] * 100:.0f} % of flowing legs")


def fetch(settings: client.ClientSettings, flow_window_s: float) -> list[dict[str, Any]]:
    """Every cluster's verdict: the classifier over Prometheus when it is set, else the sidecar's own."""
    if settings.prometheus:
        from pdwatch.sidecar.diagnosis.classify import verdict
        from pdwatch.sidecar.diagnosis.from_prometheus import contrasts, gather

        url, timeout_s, headers = settings.prometheus, settings.timeout_s, settings.prometheus_headers
        facts = gather(url, timeout_s=timeout_s, headers=headers, window_s=flow_window_s)
        shown = contrasts(url, timeout_s=timeout_s, headers=headers)
        return [{**verdict(f), "contrast": shown.get(f.cluster, [])} for f in facts]
    from pdwatch.client import SidecarClient

    with SidecarClient(settings) as sidecar:
        verdicts: list[dict[str, Any]] = sidecar.get(c.PATH_DIAGNOSIS)
    return verdicts


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = client.for_command("pdwatch diagnose", args)
    if settings is None:
        return 2
    if args.flow_window_s is None:
        from pdwatch.sidecar.settings import Settings

        try:  # the sidecars' own setting, so the cluster-wide verdict judges flow as they do
            args.flow_window_s = Settings.from_sources({}).flow_window_s
        except ValueError as exc:
            print(f"pdwatch diagnose: {exc}", file=sys.stderr)
            return 2
    try:
        verdicts = fetch(settings, args.flow_window_s)
    except RuntimeError as exc:  # SidecarError, PrometheusError
        print(f"pdwatch diagnose: {exc}", file=sys.stderr)
        return 2
    if args.cluster:
        verdicts = [v for v in verdicts if v["cluster"] == args.cluster]
    print(json.dumps(verdicts, indent=2) if args.json else render(verdicts))
    # Exit 1 when something is suspected, so scripts can branch on it.
    return 1 if any(v.get("family") for v in verdicts) else 0
