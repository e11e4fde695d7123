"""`pdwatch report`: a self-contained incident report, an HTML file with its plots embedded and PNGs beside it.

From a Prometheus that scraped the sidecars (`--prometheus URL`, over `--from`/`--to`,
the last 30 minutes by default), or from one sidecar's recent history (`--sidecar URL`,
the last 10 minutes at most: what it keeps). The report shows stage flow and stuck
legs per stage over time, GPU utilization and power per instance, restarts and alert
state marked, the worst moment (the most stuck legs), the diagnosis in the classifier's
own words (over Prometheus, as it reads at the worst moment; from a sidecar, its
latest), and the oldest stuck traces, linked to a trace store with `--trace-url`.

    pdwatch report --prometheus http://127.0.0.1:9090 --from 2h --to 1h30m --out incident-42
    pdwatch report --sidecar http://node-7:4318 --trace-url 'https://jaeger.example/trace/{trace_id}'
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime, timezone

from pdwatch import settings as client

from .times import parse_time
from .write import write_report

NOTES = {"sidecar": "its last 10 minutes", "prometheus": "read instead of the sidecar when set"}


def build_parser() -> argparse.ArgumentParser:
    doc = (__doc__ or "").splitlines()
    ap = argparse.ArgumentParser(prog="pdwatch report", description=doc[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n".join(doc[2:]))
    client.add_arguments(ap.add_mutually_exclusive_group(), "prometheus", "sidecar", notes=NOTES)
    ap.add_argument("--from", dest="start", metavar="TIME", default=None,
                    help="start: 30m (ago), now-2h, Unix seconds or ISO 8601, UTC unless it says (default 30m)")
    ap.add_argument("--to", dest="end", metavar="TIME", default=None, help="end, as --from (default now)")
    ap.add_argument("--out", metavar="DIR", default=None,
                    help="folder to write into (default pdwatch-report-<UTC time> here)")
    ap.add_argument("--cluster", help="only this cluster")
    ap.add_argument("--title", help="the report's title")
    client.add_arguments(ap, "trace_url", "token", "prometheus_headers", "timeout_s")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = client.for_command("pdwatch report", args)
    if settings is None:
        return 2
    try:
        now = time.time()
        end = parse_time(args.end, now) if args.end else None
        start = parse_time(args.start, now) if args.start else None
        out = args.out or f"pdwatch-report-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
        page = write_report(out, settings, start=start, end=end, cluster=args.cluster, title=args.title)
    except RuntimeError as exc:  # ReportError, SidecarError, PrometheusError
        print(f"pdwatch report: {exc}", file=sys.stderr)
        return 2
    print(f"report written to {page}")
    return 0
