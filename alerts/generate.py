"""Writes alerts/pdwatch-alerts.yml, the Prometheus alert rules, from the table below.

The rules live here as data (as the kubernetes-mixin keeps them in jsonnet) so
that every alert gets its `runbook_url` from its name, never typed by hand, and
a test can regenerate the file and compare. The YAML emitter is tiny because
the shape is fixed: groups of rules whose values are all strings.

    python -m pdwatch.alerts.generate                  # rewrite the rule file
    python -m pdwatch.alerts.generate --check          # exit 1 if the file is stale
    python -m pdwatch.alerts.generate --runbook-base https://git.example/pdwatch/blob/main/

Stuck legs, thresholds, "flowing" and the failure families are judged by the
sidecar (contract section 5); these rules read its verdicts and never
re-derive them.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from pdwatch import contract as c

HERE = Path(__file__).resolve().parent
RULE_FILE = HERE / "pdwatch-alerts.yml"
RUNBOOK_DIR = "docs/runbooks"
# A placeholder under the reserved .example domain: point it at wherever the
# repository's docs are served, e.g. a forge's blob URL ending in "/".
DEFAULT_RUNBOOK_BASE = "https://pdwatch.example/"

# Alert names, contract section 9.
STUCK_WHILE_OTHERS_FLOW = c.ALERT_STUCK_WHILE_OTHERS_FLOW
TOTAL_WEDGE = c.ALERT_TOTAL_WEDGE
TRANSFER_WEDGE = c.ALERT_TRANSFER_WEDGE
BOOTSTRAP_WEDGE = c.ALERT_BOOTSTRAP_WEDGE
COLLECTIVE_DESYNC = c.ALERT_COLLECTIVE_DESYNC
QUEUE_STARVATION = c.ALERT_QUEUE_STARVATION
RESTART_SKEW = c.ALERT_RESTART_SKEW
ENGINE_SILENT = c.ALERT_ENGINE_SILENT
TELEMETRY_MISSING = c.ALERT_TELEMETRY_MISSING
ALERT_NAMES = c.ALERT_NAMES

# "Others flowed recently": the sidecar's flag (some leg finished ok within its
# 60 s window) seen at least once in this range. The range smooths a cluster
# whose completions are sparse, so the headline does not reset its `for` each
# time a quiet minute passes; a total wedge is its exact complement.
FLOW_RANGE = "2m"
FLOWED = f"max by (cluster) (max_over_time({c.CLUSTER_FLOWING.name}[{FLOW_RANGE}])) == 1"
LEG_KEY = "cluster, role, stage, pd_instance"
STUCK_BY_LEG_KEY = f"max by ({LEG_KEY}) ({c.STUCK.name})"
# The headline has two paths under one name and label set. Legs stuck on evidence (contract
# section 5b) are proof already: they page after HEADLINE_FOR. Legs stuck past their
# threshold must stay so for a minute first, as ever: HOLD of samples all above zero, then
# HEADLINE_FOR; HOLD + HEADLINE_FOR = 1m, so that path pages when it always did.
HEADLINE_FOR = "5s"
HOLD = "55s"
EVIDENCE_BY_LEG_KEY = f"max by ({LEG_KEY}) ({c.STUCK_EVIDENCE.name})"
HELD_BY_LEG_KEY = f"max by ({LEG_KEY}) (min_over_time({c.STUCK.name}[{HOLD}]))"


# Collective desync, two paths likewise: a loop frozen past the loop rule (pdwatch_engine_loop_frozen:
# with legs open, contract section 5b; or idle, a loop known to turn while idle) is proof and pages
# after HEADLINE_FOR; a suspicion on a stalled loop alone must hold for HOLD first, 1m in all as before.
DESYNC = 'pdwatch_suspected_failure{family="collective_desync"}'
DESYNC_EXPR = (f"(\n  max by (cluster, family) ({DESYNC}) == 1\n  and on (cluster)\n"
               "  max by (cluster) (pdwatch_engine_loop_frozen) == 1\n)\nor\n"
               f"  max by (cluster, family) (min_over_time({DESYNC}[{HOLD}])) == 1")


def _q(template_query: str, *args: str) -> str:
    """A Go-template `query` call: printf the PromQL with label values, then query."""
    return " ".join(["printf", f"`{template_query}`", *args, "| query"])


def _scalar(template_query: str, *args: str, fmt: str = "humanizeDuration", missing: str = "unknown") -> str:
    """Template text that renders the first sample of a query, or `missing`."""
    return f"{{{{ with {_q(template_query, *args)} }}}}{{{{ . | first | value | {fmt} }}}}{{{{ else }}}}{missing}{{{{ end }}}}"


def _count(template_query: str, *args: str) -> str:
    return _scalar(template_query, *args, fmt='printf "%.0f"', missing="0")


def _list(template_query: str, *args: str, item: str) -> str:
    """Template text listing one `item` per series of a query, or "none"."""
    return (f"{{{{ range {_q(template_query, *args)} }}}}{item} {{{{ else }}}}none {{{{ end }}}}")


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str
    extra_labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Group:
    name: str
    rules: tuple[Alert, ...]


def _family(name: str, family: str, severity: str, summary: str, description: str) -> Alert:
    return Alert(
        name=name,
        expr=f'max by (cluster, family) (pdwatch_suspected_failure{{family="{family}"}}) == 1',
        for_="1m",
        severity=severity,
        summary=summary,
        description=description,
    )


def _stuck_in(stage: str) -> str:
    return _count(f'sum(pdwatch_stuck_requests{{cluster=%q,stage="{stage}"}})', "$labels.cluster")


GROUPS = (
    Group("pdwatch.requests", (
        Alert(
            name=STUCK_WHILE_OTHERS_FLOW,
            expr=(f"(\n  {EVIDENCE_BY_LEG_KEY} > 0\nor\n  {HELD_BY_LEG_KEY} > 0\n)\n"
                  f"and on (cluster)\n{FLOWED}"),
            for_=HEADLINE_FOR,
            severity="critical",
            summary="PD request legs are stuck while other requests keep finishing.",
            description=(
                _count("sum(pdwatch_stuck_requests{cluster=%q,role=%q,stage=%q,pd_instance=%q})",
                       "$labels.cluster", "$labels.role", "$labels.stage", "$labels.pd_instance")
                + " {{ $labels.role }} leg(s) on {{ $labels.pd_instance }} (cluster {{ $labels.cluster }}) are "
                "stuck in stage {{ $labels.stage }} while other requests of the cluster keep finishing; "
                + _count("sum(pdwatch_stuck_evidence_requests{cluster=%q,role=%q,stage=%q,pd_instance=%q})",
                         "$labels.cluster", "$labels.role", "$labels.stage", "$labels.pd_instance")
                + " of them on evidence that they cannot progress"
                + ", the rest past the stuck threshold of "
                + _scalar("max(pdwatch_stuck_threshold_seconds{cluster=%q,role=%q,stage=%q})",
                          "$labels.cluster", "$labels.role", "$labels.stage")
                + ". The oldest has been there "
                + _scalar("max(pdwatch_oldest_stage_age_seconds{cluster=%q,role=%q,stage=%q,pd_instance=%q})",
                          "$labels.cluster", "$labels.role", "$labels.stage", "$labels.pd_instance")
                + ". What sets the cluster's stuck legs apart from those that flow: "
                + _list('topk(3, pdwatch_stuck_contrast_ratio{cluster=%q,legs="stuck"})', "$labels.cluster",
                        item="{{ .Labels.attribute }} {{ .Labels.value }} ({{ . | value | humanizePercentage }} of them)")
                + "(pdwatch diagnose shows the flowing legs' share). Their trace ids and reasons are in "
                "pdwatch_stuck_request_info and the sidecar's /api/v1/stuck."
            ),
        ),
        Alert(
            name=TOTAL_WEDGE,
            expr=(f"sum by (cluster) ({STUCK_BY_LEG_KEY}) > 0\n"
                  f"unless on (cluster)\n{FLOWED}"),
            for_="2m",
            severity="critical",
            summary="A PD cluster has stuck legs and no request finishes at all.",
            description=(
                "{{ $value }} leg(s) are stuck in cluster {{ $labels.cluster }} and no leg of the cluster "
                f"finished ok in the last {FLOW_RANGE} plus the sidecar's 60 s flow window. Legs in flight: "
                + _count("sum(pdwatch_inflight_requests{cluster=%q})", "$labels.cluster")
                + ". Instances down: "
                + _list("max by (pd_instance) (pdwatch_instance_up{cluster=%q}) == 0", "$labels.cluster",
                        item="{{ .Labels.pd_instance }}")
                + "(the sidecar's diagnosis says which family the wedge resembles)."
            ),
        ),
    )),
    Group("pdwatch.diagnosis", (
        _family(
            TRANSFER_WEDGE, "transfer_wedge", "warning",
            "The sidecar suspects a KV transfer wedge in a PD cluster.",
            "pdwatch diagnoses transfer_wedge in cluster {{ $labels.cluster }}: "
            + _stuck_in("transfer")
            + " leg(s) stuck in transfer while others flow and the engines' loops advance."
            " Inspect the KV transfer peers; with a recent lone restart, co-restart the PD pair.",
        ),
        _family(
            BOOTSTRAP_WEDGE, "bootstrap_wedge", "warning",
            "The sidecar suspects a bootstrap wedge in a PD cluster.",
            "pdwatch diagnoses bootstrap_wedge in cluster {{ $labels.cluster }}: "
            + _stuck_in("bootstrap")
            + " leg(s) stuck in bootstrap while others flow."
            " Inspect the bootstrap server and peers; with a recent lone restart, co-restart the PD pair.",
        ),
        replace(_family(
            COLLECTIVE_DESYNC, "collective_desync", "critical",
            "The sidecar suspects a collective desync: an engine loop frozen while it heartbeats.",
            "pdwatch diagnoses collective_desync in cluster {{ $labels.cluster }}. Instances whose engine "
            "loop stands still while they heartbeat: "
            + _list("max by (pd_instance) (pdwatch_engine_loop_stalled{cluster=%q} == 1 "
                    "or pdwatch_engine_loop_frozen{cluster=%q} == 1)", "$labels.cluster", "$labels.cluster",
                    item="{{ .Labels.pd_instance }}")
            + "(GPUs at >= 90 % utilization confirm a collective hang; the sidecar's diagnosis says what "
            "they read). Dump stacks, check the collective library, restart the TP group.",
        ), expr=DESYNC_EXPR, for_=HEADLINE_FOR),
        _family(
            QUEUE_STARVATION, "queue_starvation", "warning",
            "Legs starve in a queue while the same instance serves others.",
            "pdwatch diagnoses queue_starvation in cluster {{ $labels.cluster }}: "
            + _stuck_in("queued")
            + " leg(s) stuck in queued and "
            + _count('sum(pdwatch_stuck_requests{cluster=%q,role="decode",stage="bootstrap"})', "$labels.cluster")
            + " decode leg(s) stuck in bootstrap (KV memory). Check capacity and KV memory.",
        ),
        _family(
            RESTART_SKEW, "restart_skew", "warning",
            "One PD role restarted alone and transfer or bootstrap trouble followed.",
            "pdwatch diagnoses restart_skew in cluster {{ $labels.cluster }}. Restarted in the last hour: "
            + _list("changes(pdwatch_instance_start_time_seconds{cluster=%q}[1h]) > 0", "$labels.cluster",
                    item="{{ .Labels.pd_instance }} ({{ .Labels.role }})")
            + "- co-restart the PD pair so that both sides start with clean bootstrap state.",
        ),
    )),
    Group("pdwatch.health", (
        Alert(
            name=ENGINE_SILENT,
            expr="max by (cluster, role, pd_instance) (pdwatch_instance_up) == 0",
            for_="1m",
            severity="critical",
            summary="A PD engine instance stopped sending heartbeats.",
            description=(
                "No heartbeat from {{ $labels.role }} instance {{ $labels.pd_instance }} (cluster "
                "{{ $labels.cluster }}) for "
                + _scalar("max(pdwatch_instance_heartbeat_age_seconds{cluster=%q,pd_instance=%q})",
                          "$labels.cluster", "$labels.pd_instance")
                + "; its process is dead or frozen. Legs open on it: "
                + _count("sum(pdwatch_inflight_requests{cluster=%q,pd_instance=%q})",
                         "$labels.cluster", "$labels.pd_instance")
                + "."
            ),
        ),
        Alert(
            name=TELEMETRY_MISSING,
            expr="absent(pdwatch_spans_received_total)",
            for_="5m",
            severity="warning",
            summary="Prometheus has no pdwatch metrics: the sidecar is down or not scraped.",
            description=(
                "No series pdwatch_spans_received_total for 5 minutes among the "
                + _count("count(up)")
                + " targets Prometheus scrapes: the pdwatch sidecar is not running or Prometheus does not "
                "scrape it, so no stuck request can be seen."
            ),
            extra_labels={"reason": "sidecar_absent"},
        ),
        Alert(
            name=TELEMETRY_MISSING,
            expr="sum by (job, instance) (rate(pdwatch_spans_received_total[5m])) == 0",
            for_="5m",
            severity="warning",
            summary="The pdwatch sidecar receives no spans: no engine reports to it.",
            description=(
                "The sidecar {{ $labels.instance }} received no span for 5 minutes although every engine "
                "heartbeats every few seconds: the engines' OTLP endpoint or the recorder is broken. "
                "Spans rejected in that time: "
                + _count("sum(increase(pdwatch_spans_rejected_total{instance=%q}[5m]))", "$labels.instance")
                + "."
            ),
            extra_labels={"reason": "no_spans"},
        ),
        Alert(
            name=TELEMETRY_MISSING,
            expr=("max by (job, instance) (pdwatch_gpu_telemetry_up) == 0\n"
                  "and max by (job, instance) (max_over_time(pdwatch_gpu_telemetry_up[1h])) == 1"),
            for_="5m",
            severity="warning",
            summary="The pdwatch sidecar lost its GPU telemetry.",
            description=(
                "GPU telemetry on the sidecar {{ $labels.instance }} worked within the last hour and is down "
                "now: the diagnosis loses its GPU evidence (utilization and power that tell a transfer wedge "
                "from a collective desync)."
            ),
            extra_labels={"reason": "gpu_telemetry_lost"},
        ),
    )),
)


def runbook_url(alert_name: str, base: str = DEFAULT_RUNBOOK_BASE) -> str:
    if not base.endswith("/"):
        base += "/"
    return f"{base}{RUNBOOK_DIR}/{alert_name}.md"


def alerts() -> list[Alert]:
    return [rule for group in GROUPS for rule in group.rules]


def _str(value: str) -> str:
    # JSON string syntax is valid YAML double-quoted syntax.
    return json.dumps(value)


def _block(key: str, text: str, indent: str) -> list[str]:
    # A literal block keeps PromQL free of escapes, as a person would write it.
    return [f"{indent}{key}: |-"] + [f"{indent}  {line}" for line in text.splitlines()]


def render(base: str = DEFAULT_RUNBOOK_BASE) -> str:
    names = {rule.name for rule in alerts()}
    unknown = names.symmetric_difference(ALERT_NAMES)
    if unknown:
        raise ValueError(f"alert names differ from contract section 9: {sorted(unknown)}")
    out = [
        "# Generated by alerts/generate.py (python -m pdwatch.alerts.generate); edit the table there and run it again.",
        "groups:",
    ]
    for group in GROUPS:
        out += [f"  - name: {group.name}", "    rules:"]
        for rule in group.rules:
            out.append(f"      - alert: {rule.name}")
            out += _block("expr", rule.expr, "        ")
            out.append(f"        for: {rule.for_}")
            out.append("        labels:")
            for key, value in {"severity": rule.severity, **rule.extra_labels}.items():
                out.append(f"          {key}: {_str(value)}")
            out.append("        annotations:")
            out.append(f"          summary: {_str(rule.summary)}")
            out.append(f"          description: {_str(rule.description)}")
            out.append(f"          runbook_url: {_str(runbook_url(rule.name, base))}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the pdwatch Prometheus alert rules.")
    parser.add_argument("--out", type=Path, default=RULE_FILE)
    parser.add_argument("--runbook-base", default=DEFAULT_RUNBOOK_BASE,
                        help="URL under which docs/runbooks/<AlertName>.md is served")
    parser.add_argument("--check", action="store_true", help="exit 1 when --out differs from a fresh render")
    args = parser.parse_args(argv)
    text = render(args.runbook_base)
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is stale: run python -m pdwatch.alerts.generate", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
