"""`pdwatch` command line: one subcommand per job, each module imported lazily
so that `pdwatch --help` stays fast and a subcommand's dependencies load only
when it runs."""

from __future__ import annotations

import argparse
import sys

SUBCOMMANDS = {
    "serve": ("pdwatch.sidecar.server", "run the sidecar: OTLP ingest, stuck detection, metrics and API"),
    "trace": ("pdwatch.trace", "draw both legs of one request as a waterfall; write it as a Jaeger UI JSON file"),
    "diagnose": ("pdwatch.diagnose", "name the failure family behind stuck requests, from a sidecar or Prometheus"),
    "report": ("pdwatch.report.cli", "write an incident report (HTML and PNG plots) from Prometheus or a sidecar's history"),
    "demo": ("pdwatch.demo", "run the incident in the testbed, watched by a sidecar, and report it"),
    "testbed": ("pdwatch.testbed.cli", "run the PD testbed alone (prefill and decode over NIXL, with faults)"),
    "dashboards": ("pdwatch.dashboards.cli", "generate the Grafana dashboards, or push them to a Grafana server"),
    "check": ("pdwatch.engine_patches.sglang.check",
              "before a rollout, in the engine image: would the SGLang plugin be active on the SGLang installed here?"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="pdwatch",
        description="Finds the request that hangs in a prefill/decode disaggregated LLM stack while others flow.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    parser.add_argument("--version", action="store_true", help="print pdwatch's version and exit")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    if argv[0] == "--version":
        from pdwatch import contract as c

        print(f"pdwatch {c.package_version()}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        parser.error(f"unknown command {name!r} (choose from {', '.join(SUBCOMMANDS)})")
    from pdwatch import extras

    try:
        module = extras.load(name, SUBCOMMANDS[name][0])
    except extras.MissingExtra as exc:
        print(f"pdwatch: {exc}", file=sys.stderr)
        return 2
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
