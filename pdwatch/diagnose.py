"""`pdwatch diagnose`: the failure family behind stuck requests, with its evidence and the action.

From one sidecar (its /api/v1/diagnosis) or, with --prometheus, from a
Prometheus that scrapes every sidecar of the cluster: the same classifier
reasons over either.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import httpx


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdwatch diagnose", description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--sidecar", metavar="URL", default=None,
                     help="a sidecar's base URL (default http://127.0.0.1:4318)")
    src.add_argument("--prometheus", metavar="URL", help="a Prometheus base URL that scrapes the sidecars")
    ap.add_argument("--cluster", help="only this cluster")
    ap.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    ap.add_argument("--token", default=os.environ.get("PDWATCH_TOKEN"),
                    help="bearer token for the sidecar [env PDWATCH_TOKEN]")
    ap.add_argument("--timeout-s", type=float, default=10.0)
    ap.add_argument("--flow-window-s", type=float, default=None,
                    help="with --prometheus: the sidecars' flow window [env PDWATCH_FLOW_WINDOW_S, default 60]")
    return ap


def render(verdicts: list[dict]) -> str:
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


def _ratio_sentence(x: dict) -> str:
    return (f"{x['attribute']} {x['value']}: {x['stuck'] * 100:.0f} % of stuck legs, "
            f"{x['flowing'] * 100:.0f} % of flowing legs")


def fetch(args) -> list[dict]:
    if args.prometheus:
        from pdwatch.sidecar.diagnosis.classify import verdict
        from pdwatch.sidecar.diagnosis.from_prometheus import contrasts, gather

        facts = gather(args.prometheus, timeout_s=args.timeout_s, window_s=args.flow_window_s)
        shown = contrasts(args.prometheus, timeout_s=args.timeout_s)
        return [{**verdict(f), "contrast": shown.get(f.cluster, [])} for f in facts]
    url = (args.sidecar or "http://127.0.0.1:4318").rstrip("/")
    headers = {"Authorization": f"Bearer {args.token}"} if args.token else None
    r = httpx.get(f"{url}/api/v1/diagnosis", timeout=args.timeout_s, headers=headers)
    if r.status_code != 200:
        raise RuntimeError(f"{url}/api/v1/diagnosis answered {r.status_code}: {r.text[:200]}")
    return r.json()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.flow_window_s is None:
        from pdwatch.sidecar.settings import Settings

        try:  # the sidecars' own setting, so the cluster-wide verdict judges flow as they do
            args.flow_window_s = Settings.from_sources({}).flow_window_s
        except ValueError as exc:
            print(f"pdwatch diagnose: {exc}", file=sys.stderr)
            return 2
    try:
        verdicts = fetch(args)
    except (httpx.HTTPError, RuntimeError) as exc:
        print(f"pdwatch diagnose: {exc}", file=sys.stderr)
        return 2
    if args.cluster:
        verdicts = [v for v in verdicts if v["cluster"] == args.cluster]
    print(json.dumps(verdicts, indent=2) if args.json else render(verdicts))
    # Exit 1 when something is suspected, so scripts can branch on it.
    return 1 if any(v.get("family") for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
