"""`pdwatch dashboards generate|push`."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from pdwatch.dashboards import push as push_mod
from pdwatch.dashboards import render


def _generate(args: argparse.Namespace) -> int:
    if args.check:
        stale = render.stale(args.out)
        for name in stale:
            print(f"{args.out / name} is stale: run pdwatch dashboards generate", file=sys.stderr)
        return 1 if stale else 0
    for path in render.write(args.out):
        print(path)
    return 0


def _push(args: argparse.Namespace) -> int:
    try:
        dashboards = render.load(args.dir)
    except FileNotFoundError as exc:
        print(f"missing generated dashboard {exc.filename}: run pdwatch dashboards generate", file=sys.stderr)
        return 2
    try:
        result = push_mod.push(
            dashboards, url=args.url, token=args.token, folder=args.folder, folder_uid=args.folder_uid,
            overwrite=args.overwrite, timeout=args.timeout,
        )
    except push_mod.PushError as exc:
        print(f"push failed: {exc}", file=sys.stderr)
        return 1
    verb = "created" if result.folder_created else "found"
    print(f"folder {args.folder!r} ({result.folder_uid}) {verb}")
    for answer in result.saved:
        print(f"saved {answer.get('uid')} version {answer.get('version')} at {answer.get('url')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdwatch dashboards", description="Grafana dashboards for pdwatch.")
    sub = parser.add_subparsers(dest="action", required=True)

    gen = sub.add_parser("generate", help="write the dashboards' JSON (default: the committed dashboards/generated/)")
    gen.add_argument("--out", type=Path, default=render.GENERATED_DIR)
    gen.add_argument("--check", action="store_true", help="exit 1 when the files differ from a fresh render")
    gen.set_defaults(run=_generate)

    push = sub.add_parser("push", help="save the generated dashboards into a folder on a Grafana server")
    push.add_argument("--url", default=os.environ.get("GRAFANA_URL", push_mod.DEFAULT_URL),
                      help="Grafana base URL (env GRAFANA_URL; default %(default)s)")
    push.add_argument("--token", default=os.environ.get("GRAFANA_TOKEN"),
                      help="service account token, sent as a Bearer token (env GRAFANA_TOKEN)")
    push.add_argument("--folder", default=push_mod.DEFAULT_FOLDER, help="folder title (default %(default)s)")
    push.add_argument("--folder-uid", default=push_mod.DEFAULT_FOLDER_UID, help="folder uid (default %(default)s)")
    push.add_argument("--no-overwrite", dest="overwrite", action="store_false",
                      help="fail instead of replacing a dashboard that exists")
    push.add_argument("--dir", type=Path, default=render.GENERATED_DIR, help="where the generated JSON is")
    push.add_argument("--timeout", type=float, default=10.0, help="seconds per HTTP request")
    push.set_defaults(run=_push)

    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    return run(args)

