"""Prometheus exposition of the judge's latest evaluation (contract section 6).

Client_python style: collectors build fresh metric families from one
immutable `Evaluation` on each scrape, so no gauge can go stale, label sets
are exactly those of live instances, and a scrape takes no lock and changes
nothing. Ingest only bumps plain counters and the stage-duration buckets.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Exemplar
from prometheus_client.utils import floatToGoString

from pdwatch import contract as c

from .evaluation import Evaluation

Latest = Callable[[], Evaluation]


def _gauge(metric: c.Metric, help_text: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(metric.name, help_text, labels=list(metric.labels))


def _counter(metric: c.Metric, help_text: str) -> CounterMetricFamily:
    return CounterMetricFamily(metric.name, help_text, labels=list(metric.labels))


class DurationCollector:
    def __init__(self, latest: Latest):
        self._latest = latest

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        hist = self._latest().histogram
        family = HistogramMetricFamily(c.STAGE_DURATION.name,
                                       "Time legs spent in each stage, from the engines' finished stage spans.",
                                       labels=list(c.STAGE_DURATION.labels))
        for key, (counts, exemplars, total) in sorted(hist.series.items()):
            buckets: list[Any] = []
            running = 0
            for bound, count, ex in zip((*hist.bounds, math.inf), counts, exemplars):
                running += count
                le = "+Inf" if bound == math.inf else floatToGoString(bound)  # type: ignore[no-untyped-call]
                if ex is None:
                    buckets.append((le, running))
                else:
                    buckets.append((le, running, Exemplar({c.L_TRACE_ID: ex[0]}, ex[1], ex[2])))
            family.add_metric(list(key), buckets, total)
        yield family


class EvaluationCollector:
    """Everything the judge found about legs and instances, and the sidecar's own ingest counters."""

    def __init__(self, latest: Latest):
        self._latest = latest

    def describe(self) -> Iterator[Metric]:
        return iter(())  # built per scrape; nothing to pre-register

    def collect(self) -> Iterator[Metric]:
        ev = self._latest()
        yield from self._legs(ev)
        yield from self._instances(ev)
        yield from self._own(ev)

    @staticmethod
    def _legs(ev: Evaluation) -> Iterator[Metric]:
        inflight = _gauge(c.INFLIGHT, "Open legs per stage, as the engines' latest heartbeats count them.")
        stuck = _gauge(c.STUCK, "Open legs stuck: past their stage's threshold, or on evidence (contract section 5b).")
        evidence = _gauge(c.STUCK_EVIDENCE, "The stuck legs that are stuck on evidence, by reason: peer_gone, "
                                            "loop_frozen, engine_error.")
        oldest = _gauge(c.OLDEST_AGE, "Age of the oldest open leg in each stage (decode: since its last new token).")
        for inst in ev.instances:
            for stage in c.STAGES[inst.role]:
                labels = [inst.cluster, inst.role, stage, inst.name]
                group = ev.groups.get((inst.cluster, inst.role, stage, inst.name))
                inflight.add_metric(labels, inst.open_counts.get(stage, 0))
                stuck.add_metric(labels, group.stuck if group else 0)
                oldest.add_metric(labels, group.oldest_age_s if group else 0.0)
                for reason in c.EVIDENCE_REASONS:
                    evidence.add_metric([*labels, reason], group.evidence.get(reason, 0) if group else 0)
        yield from (inflight, stuck, evidence, oldest)

        thr = _gauge(c.THRESHOLD, "Current stuck threshold: max(floor, 3 x p99 of recent durations).")
        key: tuple[str, ...]  # reused below: a threshold's or a stuck count's 3 labels, a finished count's 4
        for key, seconds in sorted(ev.thresholds.items()):
            thr.add_metric(list(key), seconds)
        yield thr

        info = _gauge(c.STUCK_INFO, "Stage age in seconds of each of the oldest stuck legs, named by trace id, "
                                    "with the reason it is stuck.")
        for s in ev.stuck[:c.STUCK_INFO_TOP]:
            info.add_metric([s.cluster, s.role, s.stage, s.pd_instance, s.trace_id, s.rid, s.reason], round(s.age_s, 3))
        yield info

        contrast = GaugeMetricFamily(
            "pdwatch_stuck_contrast_ratio",
            "What sets a cluster's stuck legs apart: for each attribute that separates them clearly from the legs "
            "that finished ok in the flow window, the share of stuck (legs=\"stuck\") and of flowing legs that have it.",
            labels=[c.L_CLUSTER, "attribute", "value", "legs"])
        for v in ev.diagnosis:
            for item in v.get("contrast", ()):
                for side in ("stuck", "flowing"):
                    contrast.add_metric([v["cluster"], item["attribute"], item["value"], side], item[side])
        yield contrast

        flowing = _gauge(c.CLUSTER_FLOWING, "1 when some leg of the cluster finished ok within the flow window.")
        for cluster, value in sorted(ev.flowing.items()):
            flowing.add_metric([cluster], 1 if value else 0)
        yield flowing

        counts = ev.counters
        finished = _counter(c.FINISHED, "Legs finished, by outcome.")
        for key, n in sorted(counts.finished.items()):
            finished.add_metric(list(key), n)
        yield finished
        probes = CounterMetricFamily("pdwatch_probe_requests_finished",
                                     "Engine probe legs (warm-ups, health checks) finished, by outcome; counted apart "
                                     "from pdwatch_requests_finished_total and never as flow.",
                                     labels=list(c.FINISHED.labels))
        for key, n in sorted(counts.probes_finished.items()):
            probes.add_metric(list(key), n)
        yield probes
        detected = _counter(c.STUCK_DETECTED, "Legs found stuck, each counted once.")
        for key, n in sorted(counts.stuck_detected.items()):
            detected.add_metric(list(key), n)
        yield detected

    @staticmethod
    def _instances(ev: Evaluation) -> Iterator[Metric]:
        up = _gauge(c.INSTANCE_UP, "1 while every rank of the instance heartbeats.")
        start = _gauge(c.INSTANCE_START, "Start time of the instance's current process (rank 0), Unix seconds.")
        restarts = _counter(c.INSTANCE_RESTARTS, "New processes seen under the same pd.instance.")
        stalled = _gauge(c.LOOP_STALLED, "1 when a rank heartbeats but its scheduler loop counter stopped moving.")
        frozen = GaugeMetricFamily("pdwatch_engine_loop_frozen",
                                   "1 while a rank heartbeats but its loop stands still past the loop rule: with legs open "
                                   "(contract section 5b: its legs are stuck on evidence, loop_frozen), or idle "
                                   "when its loop is known to turn while idle.",
                                   labels=list(c.INSTANCE_KEY))
        age = GaugeMetricFamily("pdwatch_instance_heartbeat_age_seconds",
                                "Seconds since the instance's stalest rank last heartbeated.", labels=list(c.INSTANCE_KEY))
        for inst in ev.instances:
            labels = [inst.cluster, inst.role, inst.name]
            up.add_metric(labels, 1 if inst.up else 0)
            if inst.start_ns:
                start.add_metric(labels, inst.start_ns / 1e9)
            restarts.add_metric(labels, inst.restarts)
            stalled.add_metric(labels, 1 if inst.loop_stalled else 0)
            frozen.add_metric(labels, 1 if inst.loop_frozen else 0)
            if inst.heartbeat_age_s is not None:
                age.add_metric(labels, round(inst.heartbeat_age_s, 3))
        yield from (up, start, restarts, stalled, frozen, age)

    @staticmethod
    def _own(ev: Evaluation) -> Iterator[Metric]:
        n = ev.counters
        yield CounterMetricFamily(c.SPANS_RECEIVED.name, "Spans received on /v1/traces.", value=n.spans_received)
        rejected = _counter(c.SPANS_REJECTED, "Spans that could not be used, by reason.")
        for reason, count in n.spans_rejected.items():
            rejected.add_metric([reason], count)
        yield rejected
        yield CounterMetricFamily("pdwatch_spans_foreign",
                                  "Spans that are not pdwatch's (another instrumentation's, on the same endpoint): "
                                  "neither applied nor rejected; forwarded when forwarding is on.",
                                  value=n.spans_foreign)
        yield CounterMetricFamily("pdwatch_spans_duplicate",
                                  "Spans and heartbeats received again or late; applied once only.", value=n.duplicates)
        yield CounterMetricFamily("pdwatch_heartbeats_received", "Heartbeats applied.", value=n.heartbeats)
        yield GaugeMetricFamily(c.TRACKED_LEGS.name, "Open legs the sidecar tracks.", value=n.tracked_legs)
        yield GaugeMetricFamily("pdwatch_tracked_instances", "Engine instances the sidecar tracks.",
                                value=n.tracked_instances)
        yield GaugeMetricFamily("pdwatch_gone_peers",
                                "Peer ids (KV agent names, bootstrap addresses) of ended processes the sidecar "
                                "remembers for the peer_gone rule.", value=n.gone_peers)
        evicted = CounterMetricFamily(
            "pdwatch_legs_evicted",
            "Legs dropped from tracking: open_limit (new legs refused at the memory cap), closed_limit (finished legs "
            "forgotten at the history cap), vanished (gone from their engine's inventory without a leg span), "
            "instance_gone (their instance sent nothing for PDWATCH_INSTANCE_TTL_S).", labels=["reason"])
        for reason, count in n.evicted.items():
            evicted.add_metric([reason], count)
        yield evicted
        yield CounterMetricFamily("pdwatch_instances_expired",
                                  "Instances forgotten after sending nothing for PDWATCH_INSTANCE_TTL_S.",
                                  value=n.instances_expired)
        yield CounterMetricFamily("pdwatch_label_sets_refused",
                                  "Observations dropped because a metric reached its label-set cap.",
                                  value=n.label_sets_refused)
        yield GaugeMetricFamily("pdwatch_evaluation_timestamp_seconds",
                                "When the judge made the evaluation this scrape shows, Unix seconds.",
                                value=ev.at_ns / 1e9)
