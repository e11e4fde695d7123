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
ALERT_NAMES = c.ALERT_NAMES

# Every metric and label below is the contract's object or constant: `Metric.by` and `_sel` raise on a
# label the metric does not carry, so a misspelt name fails here instead of in a silent rule.
CLUSTER, ROLE, STAGE, INSTANCE, FAMILY = c.L_CLUSTER, c.L_ROLE, c.L_STAGE, c.L_INSTANCE, c.L_FAMILY
TARGET = (c.L_JOB, c.L_TARGET)  # the sidecar as Prometheus scrapes it

# "Others flowed recently": the sidecar's flag (some leg finished ok within its
# 60 s window) seen at least once in this range. The range smooths a cluster
# whose completions are sparse, so the headline does not reset its `for` each
# time a quiet minute passes; a total wedge is its exact complement.
FLOW_RANGE = "2m"
FLOWED = f"max by ({c.CLUSTER_FLOWING.by(CLUSTER)}) (max_over_time({c.CLUSTER_FLOWING.series}[{FLOW_RANGE}])) == 1"
STUCK_BY_LEG_KEY = f"max by ({c.STUCK.by(*c.LEG_GROUP)}) ({c.STUCK.series})"
# The headline has two paths under one name and label set. Legs stuck on evidence (contract
# section 5b) are proof already: they page after HEADLINE_FOR. Legs stuck past their
# threshold must stay so for a minute first, as ever: HOLD of samples all above zero, then
# HEADLINE_FOR; HOLD + HEADLINE_FOR = 1m, so that path pages when it always did.
HEADLINE_FOR = "5s"
HOLD = "55s"
EVIDENCE_BY_LEG_KEY = f"max by ({c.STUCK_EVIDENCE.by(*c.LEG_GROUP)}) ({c.STUCK_EVIDENCE.series})"
HELD_BY_LEG_KEY = f"max by ({c.STUCK.by(*c.LEG_GROUP)}) (min_over_time({c.STUCK.series}[{HOLD}]))"


def _suspected(family: str) -> str:
    if family not in c.FAMILIES:
        raise ValueError(f"{family!r} is not a failure family of contract section 8")
    return f'{c.SUSPECTED_FAILURE.series}{{{FAMILY}="{family}"}}'


# Collective desync, two paths likewise: a loop frozen past the loop rule (the loop-frozen gauge:
# with legs open, contract section 5b; or idle, a loop known to turn while idle) is proof and pages
# after HEADLINE_FOR; a suspicion on a stalled loop alone must hold for HOLD first, 1m in all as before.
DESYNC = _suspected("collective_desync")
SUSPECTED_BY = c.SUSPECTED_FAILURE.by(CLUSTER, FAMILY)
DESYNC_EXPR = (f"(\n  max by ({SUSPECTED_BY}) ({DESYNC}) == 1\n  and on ({CLUSTER})\n"
               f"  max by ({c.LOOP_FROZEN.by(CLUSTER)}) ({c.LOOP_FROZEN.series}) == 1\n)\nor\n"
               f"  max by ({SUSPECTED_BY}) (min_over_time({DESYNC}[{HOLD}])) == 1")


@dataclass(frozen=True)
class Sel:
    """A selector for a Go-template query: `label=%q` per label filled from the alert's own labels
    (`args`), then fixed `label="value"` matchers."""

    text: str
    args: tuple[str, ...]


def _sel(metric: c.Metric, *matched: str, **fixed: str) -> Sel:
    metric.by(*matched, *fixed)  # every label must be the metric's (or the scrape target's)
    matchers = [f"{label}=%q" for label in matched] + [f'{label}="{value}"' for label, value in fixed.items()]
    return Sel(f"{metric.series}{{{','.join(matchers)}}}", tuple(f"$labels.{label}" for label in matched))


def _in(template: str, *sels: Sel) -> tuple[str, ...]:
    """A query template with each `{}` filled by a selector, then the selectors' arguments."""
    return (template.format(*(s.text for s in sels)), *(arg for s in sels for arg in s.args))


def _show(label: str) -> str:
    """Template text for one of the alert's own label values."""
    return f"{{{{ $labels.{label} }}}}"


def _item(label: str) -> str:
    """Template text for a label value of one series a `_list` query returned."""
    return f"{{{{ .Labels.{label} }}}}"


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


def _sum(s: Sel) -> str:
    return _count(*_in("sum({})", s))


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
    # Each group names how often it is evaluated: a `for` of 5 s means nothing under Prometheus's
    # common 30 s default (kube-prometheus-stack's), where it would wait a whole evaluation.
    interval: str
    rules: tuple[Alert, ...]


# Per down instance, the legs it held when it went silent (contract section 6, v1.2): a departed or up
# instance has no down series at 1, so neither PDEngineSilent rule sees it.
def _silent(held: str) -> str:
    return (f"max by ({c.OPEN_AT_SILENCE.by(*c.INSTANCE_KEY)}) ({c.OPEN_AT_SILENCE.series}) {held}\n"
            f"and on ({c.INSTANCE_STATE.by(*c.INSTANCE_KEY)}) "
            f"max by ({c.INSTANCE_STATE.by(*c.INSTANCE_KEY)}) "
            f'({c.INSTANCE_STATE.series}{{{c.L_STATE}="{c.STATE_DOWN}"}}) == 1')
# A sidecar that heard from engines (its counter is above 0 since it started) and hears nothing for 5
# minutes, unless every engine it knows left in order (a scale-down): a node that runs no engine
# (training, spare) never fires.
_BY_TARGET = c.SPANS_RECEIVED.by(*TARGET)
NO_SPANS = (f"sum by ({_BY_TARGET}) (rate({c.SPANS_RECEIVED.series}[5m])) == 0\n"
            f"and on ({_BY_TARGET}) sum by ({_BY_TARGET}) ({c.SPANS_RECEIVED.series}) > 0\n"
            f"unless on ({_BY_TARGET}) sum by ({c.INSTANCE_STATE.by(*TARGET)}) "
            f'({c.INSTANCE_STATE.series}{{{c.L_STATE}!="{c.STATE_DEPARTED}"}}) == 0')


# pdwatch's own blind spots (contract section 9, v1.2).
# Prometheus's `up` for the sidecars' scrape jobs (the contract module says which jobs, and why).
SIDECAR_JOBS, SIDECAR_UP = c.SIDECAR_JOBS, c.SIDECAR_UP
# An engine's recorder losing spans in every LOSS_RANGE for LOSS_FOR: a loss that lasts, not the exports that
# fail for the seconds a sidecar restarts (those leave one window with an increase, shorter than LOSS_FOR).
LOSS_RANGE, LOSS_FOR = "5m", "10m"
_LOSS_BY = c.ENGINE_SPANS_DROPPED.by(*c.INSTANCE_KEY)
TELEMETRY_LOSS = (f"sum by ({_LOSS_BY}) (increase({c.ENGINE_SPANS_DROPPED.series}[{LOSS_RANGE}])) > 0\n"
                  f"or sum by ({c.ENGINE_EXPORTS_FAILED.by(*c.INSTANCE_KEY)}) "
                  f"(increase({c.ENGINE_EXPORTS_FAILED.series}[{LOSS_RANGE}])) > 0")
_INFO_BY = c.ENGINE_INFO.by(*c.ENGINE_INFO.labels)
PLUGIN_BLIND = (f"max by ({_INFO_BY}) "
                f'({c.ENGINE_INFO.series}{{{c.L_PLUGIN_STATE}=~"{c.PLUGIN_PARTIAL}|{c.PLUGIN_INACTIVE}"}}) == 1')
# The judge's age past which it is stalled for any evaluate interval up to 10 s (3 intervals: /healthz's
# 503), and well past the default 0.5 s; with JUDGE_FOR, a judge stopped for about 90 s.
JUDGE_STALLED_S, JUDGE_FOR = 30, "1m"


def _silent_alert(held: str, severity: str, summary: str, what: str) -> Alert:
    """PDEngineSilent for the down instances whose legs held at silence compare as `held`."""
    return Alert(
        name=c.ALERT_ENGINE_SILENT,
        expr=_silent(held),
        for_="1m",
        severity=severity,
        summary=summary,
        description=(
            f"No heartbeat from {_show(ROLE)} instance {_show(INSTANCE)} (cluster {_show(CLUSTER)}) for "
            + _scalar(*_in("max({})", _sel(c.HEARTBEAT_AGE, CLUSTER, INSTANCE)))
            + " and no final heartbeat" + what
        ),
    )


def _family(name: str, family: str, severity: str, summary: str, description: str) -> Alert:
    return Alert(
        name=name,
        expr=f"max by ({SUSPECTED_BY}) ({_suspected(family)}) == 1",
        for_="1m",
        severity=severity,
        summary=summary,
        description=description,
    )


def _stuck_in(stage: str) -> str:
    return _sum(_sel(c.STUCK, CLUSTER, stage=stage))



GROUPS = (
    Group("pdwatch.requests", HEADLINE_FOR, (
        Alert(
            name=c.ALERT_STUCK_WHILE_OTHERS_FLOW,
            expr=(f"(\n  {EVIDENCE_BY_LEG_KEY} > 0\nor\n  {HELD_BY_LEG_KEY} > 0\n)\n"
                  f"and on ({CLUSTER})\n{FLOWED}"),
            for_=HEADLINE_FOR,
            severity="critical",
            summary="PD request legs are stuck while other requests keep finishing.",
            description=(
                _sum(_sel(c.STUCK, CLUSTER, ROLE, STAGE, INSTANCE))
                + f" {_show(ROLE)} leg(s) on {_show(INSTANCE)} (cluster {_show(CLUSTER)}) are "
                f"stuck in stage {_show(STAGE)} while other requests of the cluster keep finishing; "
                + _sum(_sel(c.STUCK_EVIDENCE, CLUSTER, ROLE, STAGE, INSTANCE))
                + " of them on evidence that they cannot progress"
                + ", the rest past the stuck threshold of "
                + _scalar(*_in("max({})", _sel(c.THRESHOLD, CLUSTER, ROLE, STAGE)))
                + ". The oldest has been there "
                + _scalar(*_in("max({})", _sel(c.OLDEST_AGE, CLUSTER, ROLE, STAGE, INSTANCE)))
                + ". What sets the cluster's stuck legs apart from those that flow: "
                + _list(*_in("topk(3, {})", _sel(c.STUCK_CONTRAST, CLUSTER, legs="stuck")),
                        item=f"{_item(c.L_ATTRIBUTE)} {_item(c.L_VALUE)} "
                             "({{ . | value | humanizePercentage }} of them)")
                + "(pdwatch diagnose shows the flowing legs' share). Their trace ids and reasons are in "
                f"{c.STUCK_INFO.name} and the sidecar's {c.PATH_STUCK}."
            ),
        ),
        Alert(
            name=c.ALERT_TOTAL_WEDGE,
            expr=(f"sum by ({c.STUCK.by(CLUSTER)}) ({STUCK_BY_LEG_KEY}) > 0\n"
                  f"unless on ({CLUSTER})\n{FLOWED}"),
            for_="2m",
            severity="critical",
            summary="A PD cluster has stuck legs and no request finishes at all.",
            description=(
                f"{{{{ $value }}}} leg(s) are stuck in cluster {_show(CLUSTER)} and no leg of the cluster "
                f"finished ok in the last {FLOW_RANGE} plus the sidecar's {c.DEFAULT_FLOW_WINDOW_S:g} s flow "
                "window. Legs in flight: "
                + _sum(_sel(c.INFLIGHT, CLUSTER))
                + ". Instances down: "
                + _list(*_in(f"max by ({c.INSTANCE_UP.by(INSTANCE)}) ({{}}) == 0", _sel(c.INSTANCE_UP, CLUSTER)),
                        item=_item(INSTANCE))
                + "(the sidecar's diagnosis says which family the wedge resembles)."
            ),
        ),
    )),
    Group("pdwatch.diagnosis", "15s", (
        _family(
            c.ALERT_TRANSFER_WEDGE, "transfer_wedge", "warning",
            "The sidecar suspects a KV transfer wedge in a PD cluster.",
            f"pdwatch diagnoses transfer_wedge in cluster {_show(CLUSTER)}: "
            + _stuck_in("transfer")
            + " leg(s) stuck in transfer while others flow and the engines' loops advance."
            " Inspect the KV transfer peers; with a recent lone restart, co-restart the PD pair.",
        ),
        _family(
            c.ALERT_BOOTSTRAP_WEDGE, "bootstrap_wedge", "warning",
            "The sidecar suspects a bootstrap wedge in a PD cluster.",
            f"pdwatch diagnoses bootstrap_wedge in cluster {_show(CLUSTER)}: "
            + _stuck_in("bootstrap")
            + " leg(s) stuck in bootstrap while others flow."
            " Inspect the bootstrap server and peers; with a recent lone restart, co-restart the PD pair.",
        ),
        replace(_family(
            c.ALERT_COLLECTIVE_DESYNC, "collective_desync", "critical",
            "The sidecar suspects a collective desync: an engine loop frozen while it heartbeats.",
            f"pdwatch diagnoses collective_desync in cluster {_show(CLUSTER)}. Instances whose engine "
            "loop stands still while they heartbeat: "
            + _list(*_in(f"max by ({c.LOOP_STALLED.by(INSTANCE)}) ({{}} == 1 or {{}} == 1)",
                         _sel(c.LOOP_STALLED, CLUSTER), _sel(c.LOOP_FROZEN, CLUSTER)), item=_item(INSTANCE))
            + "(GPUs at >= 90 % utilization confirm a collective hang; the sidecar's diagnosis says what "
            "they read). Dump stacks, check the collective library, restart the TP group.",
        ), expr=DESYNC_EXPR, for_=HEADLINE_FOR),
        _family(
            c.ALERT_QUEUE_STARVATION, "queue_starvation", "warning",
            "Legs starve in a queue while the same instance serves others.",
            f"pdwatch diagnoses queue_starvation in cluster {_show(CLUSTER)}: "
            + _stuck_in("queued")
            + " leg(s) stuck in queued and "
            + _sum(_sel(c.STUCK, CLUSTER, role="decode", stage="bootstrap"))
            + " decode leg(s) stuck in bootstrap (KV memory). Check capacity and KV memory.",
        ),
        _family(
            c.ALERT_RESTART_SKEW, "restart_skew", "warning",
            "One PD role restarted alone and transfer or bootstrap trouble followed.",
            f"pdwatch diagnoses restart_skew in cluster {_show(CLUSTER)}. Restarted in the last hour: "
            + _list(*_in("changes({}[1h]) > 0", _sel(c.INSTANCE_START, CLUSTER)),
                    item=f"{_item(INSTANCE)} ({_item(ROLE)})")
            + "- co-restart the PD pair so that both sides start with clean bootstrap state.",
        ),
    )),
    Group("pdwatch.health", "15s", (
        # Contract section 9 (v1.2): critical only for a down instance that held legs (clients wait on
        # them), warning for one that held none, nothing for one that left in order (departed).
        _silent_alert("> 0", "critical", "A PD engine instance stopped sending heartbeats while it held requests.",
                      ": its process is dead or frozen. Legs it held when it went silent: {{ $value }}; their "
                      "clients wait."),
        _silent_alert("== 0", "warning", "A PD engine instance stopped sending heartbeats; it held no request.",
                      ", holding no request: killed, or frozen while idle. The sidecar forgets it after "
                      f"{c.DEFAULT_DOWN_FORGET_S:.0f} s ({c.ENV_DOWN_FORGET})."),
        Alert(
            name=c.ALERT_TELEMETRY_MISSING,
            expr=f"absent({c.SPANS_RECEIVED.series})",
            for_="5m",
            severity="warning",
            summary="Prometheus has no pdwatch metrics: the sidecar is down or not scraped.",
            description=(
                f"No series {c.SPANS_RECEIVED.series} for 5 minutes among the "
                + _count("count(up)")
                + " targets Prometheus scrapes: the pdwatch sidecar is not running or Prometheus does not "
                "scrape it, so no stuck request can be seen."
            ),
            extra_labels={c.L_REASON: "sidecar_absent"},
        ),
        Alert(
            name=c.ALERT_TELEMETRY_MISSING,
            expr=NO_SPANS,
            for_="5m",
            severity="warning",
            summary="The pdwatch sidecar receives no spans: no engine reports to it any more.",
            description=(
                f"The sidecar {_show(c.L_TARGET)} heard from engines before and received no span for 5 "
                "minutes, although every engine heartbeats every few seconds and not every engine it knows "
                "left in order: the engines' OTLP endpoint or the recorder is broken. "
                "Spans rejected in that time: "
                + _count(*_in("sum(increase({}[5m]))", _sel(c.SPANS_REJECTED, c.L_TARGET)))
                + "."
            ),
            extra_labels={c.L_REASON: "no_spans"},
        ),
        Alert(
            name=c.ALERT_TELEMETRY_MISSING,
            expr=(f"max by ({c.GPU_TELEMETRY_UP.by(*TARGET)}) ({c.GPU_TELEMETRY_UP.series}) == 0\n"
                  f"and max by ({c.GPU_TELEMETRY_UP.by(*TARGET)}) "
                  f"(max_over_time({c.GPU_TELEMETRY_UP.series}[1h])) == 1"),
            for_="5m",
            severity="warning",
            summary="The pdwatch sidecar lost its GPU telemetry.",
            description=(
                f"GPU telemetry on the sidecar {_show(c.L_TARGET)} worked within the last hour and is down "
                "now: the diagnosis loses its GPU evidence (utilization and power that tell a transfer wedge "
                "from a collective desync)."
            ),
            extra_labels={c.L_REASON: "gpu_telemetry_lost"},
        ),
        Alert(
            name=c.ALERT_ENGINE_TELEMETRY_LOSS,
            expr=TELEMETRY_LOSS,
            for_=LOSS_FOR,
            severity="warning",
            summary="An engine's pdwatch recorder keeps losing spans: the sidecar sees part of its requests.",
            description=(
                f"{_show(ROLE)} instance {_show(INSTANCE)} (cluster {_show(CLUSTER)}) has lost telemetry in every "
                f"{LOSS_RANGE} for {LOSS_FOR}. In the last {LOSS_RANGE}: "
                + _count(*_in(f"sum(increase({{}}[{LOSS_RANGE}]))", _sel(c.ENGINE_SPANS_DROPPED, CLUSTER, INSTANCE)))
                + " span(s) dropped on the engine side (queue or buffer full), "
                + _count(*_in(f"sum(increase({{}}[{LOSS_RANGE}]))", _sel(c.ENGINE_EXPORTS_FAILED, CLUSTER, INSTANCE)))
                + " span(s) in exports the sidecar did not take. Legs it lost may never be judged, and "
                "stages may look stuck that finished."
            ),
        ),
        Alert(
            name=c.ALERT_PLUGIN_INACTIVE,
            expr=PLUGIN_BLIND,
            for_="2m",
            severity="warning",
            summary="A pdwatch engine plugin observes only part of its engine, or none of it.",
            description=(
                f"The pdwatch plugin {_show(c.L_PLUGIN_VERSION)} in {_show(c.L_ENGINE)} "
                f"{_show(c.L_ENGINE_VERSION)} on {_show(ROLE)} instance {_show(INSTANCE)} (cluster "
                f"{_show(CLUSTER)}) is {_show(c.L_PLUGIN_STATE)}: hook targets it needs are missing in this "
                "engine version, so stuck legs there may go unseen. The refused targets are in the sidecar's "
                "/api/v1/summary (plugin_refused)."
            ),
        ),
        Alert(
            name=c.ALERT_JUDGE_STALLED,
            expr=f"max by ({c.EVALUATION_AGE.by(*TARGET)}) ({c.EVALUATION_AGE.series}) > {JUDGE_STALLED_S}",
            for_=JUDGE_FOR,
            # Critical: while the judge stands still its evaluation is frozen, so no stuck-leg alert can
            # fire or resolve for that sidecar's engines: nothing else can page for them.
            severity="critical",
            summary="The pdwatch sidecar's judge has stopped: nothing can page for its engines.",
            description=(
                f"The judge of the sidecar {_show(c.L_TARGET)} last finished a pass {{{{ $value | humanizeDuration }}}} "
                "ago (it runs every fraction of a second): its metrics are frozen, so no stuck request on its "
                f"engines can page. Its {c.PATH_HEALTH} answers 503; its latest tick took "
                + _scalar(*_in("max({})", _sel(c.JUDGE_TICK_SECONDS, c.L_TARGET)))
                + "."
            ),
        ),
        Alert(
            name=c.ALERT_SIDECAR_DOWN,
            expr=f"{SIDECAR_UP} == 0",
            for_="2m",
            # Critical for the same reason: the engines this sidecar watches can page for nothing.
            severity="critical",
            summary="A pdwatch sidecar does not answer Prometheus: nothing can page for its engines.",
            description=(
                f"Prometheus could not scrape the pdwatch sidecar {_show(c.L_TARGET)} (job {_show(c.L_JOB)}) "
                "for 2 minutes; "
                + _count(f'count({SIDECAR_UP} == 1)')
                + " other sidecar(s) answer. When it last answered it tracked "
                + _count(*_in("max(last_over_time({}[1h]))", _sel(c.TRACKED_INSTANCES, c.L_TARGET)))
                + " engine instance(s): they are unwatched, their stuck requests cannot page."
            ),
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
        out += [f"  - name: {group.name}", f"    interval: {group.interval}", "    rules:"]
        for rule in group.rules:
            out.append(f"      - alert: {rule.name}")
            out += _block("expr", rule.expr, "        ")
            out.append(f"        for: {rule.for_}")
            out.append("        labels:")
            for key, value in {c.L_SEVERITY: rule.severity, **rule.extra_labels}.items():
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
