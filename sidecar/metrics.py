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

from prometheus_client.core import Metric
from prometheus_client.samples import Exemplar
from prometheus_client.utils import floatToGoString

from pdwatch import contract as c

from .evaluation import Evaluation
from .families import counter, gauge, histogram

Latest = Callable[[], Evaluation]


class DurationCollector:
    def __init__(self, latest: Latest):
        self._latest = latest

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        hist = self._latest().histogram
        family = histogram(c.STAGE_DURATION)
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
        inflight, stuck = gauge(c.INFLIGHT), gauge(c.STUCK)
        evidence, oldest = gauge(c.STUCK_EVIDENCE), gauge(c.OLDEST_AGE)
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

        thr = gauge(c.THRESHOLD)
        key: tuple[str, ...]  # reused below: a threshold's or a stuck count's 3 labels, a finished count's 4
        for key, seconds in sorted(ev.thresholds.items()):
            thr.add_metric(list(key), seconds)
        yield thr

        info = gauge(c.STUCK_INFO)
        for s in ev.stuck[:c.STUCK_INFO_TOP]:
            info.add_metric([s.cluster, s.role, s.stage, s.pd_instance, s.trace_id, s.rid, s.reason], round(s.age_s, 3))
        yield info

        contrast = gauge(c.STUCK_CONTRAST)
        for v in ev.diagnosis:
            for item in v.get("contrast", ()):
                for side in ("stuck", "flowing"):
                    contrast.add_metric([v["cluster"], item["attribute"], item["value"], side], item[side])
        yield contrast

        flowing = gauge(c.CLUSTER_FLOWING)
        for cluster, value in sorted(ev.flowing.items()):
            flowing.add_metric([cluster], 1 if value else 0)
        yield flowing

        counts = ev.counters
        finished = counter(c.FINISHED)
        for key, n in sorted(counts.finished.items()):
            finished.add_metric(list(key), n)
        yield finished
        probes = counter(c.PROBES_FINISHED)
        for key, n in sorted(counts.probes_finished.items()):
            probes.add_metric(list(key), n)
        yield probes
        detected = counter(c.STUCK_DETECTED)
        for key, n in sorted(counts.stuck_detected.items()):
            detected.add_metric(list(key), n)
        yield detected

    @staticmethod
    def _instances(ev: Evaluation) -> Iterator[Metric]:
        up, start, restarts = gauge(c.INSTANCE_UP), gauge(c.INSTANCE_START), counter(c.INSTANCE_RESTARTS)
        stalled, frozen, age = gauge(c.LOOP_STALLED), gauge(c.LOOP_FROZEN), gauge(c.HEARTBEAT_AGE)
        kv_used = gauge(c.KV_USED)
        state, at_silence = gauge(c.INSTANCE_STATE), gauge(c.OPEN_AT_SILENCE)
        for inst in ev.instances:
            labels = [inst.cluster, inst.role, inst.name]
            up.add_metric(labels, 1 if inst.up else 0)
            for name in c.INSTANCE_STATES:  # every state, so a state left reads 0 rather than vanishing
                state.add_metric([*labels, name], 1 if inst.state == name else 0)
            at_silence.add_metric(labels, inst.open_at_silence)
            if inst.start_ns:
                start.add_metric(labels, inst.start_ns / 1e9)
            restarts.add_metric(labels, inst.restarts)
            stalled.add_metric(labels, 1 if inst.loop_stalled else 0)
            frozen.add_metric(labels, 1 if inst.loop_frozen else 0)
            if inst.heartbeat_age_s is not None:
                age.add_metric(labels, round(inst.heartbeat_age_s, 3))
            if inst.kv_used is not None:
                kv_used.add_metric(labels, inst.kv_used)
        yield from (up, state, at_silence, start, restarts, stalled, frozen, age, kv_used)
        yield from EvaluationCollector._engines(ev)

    @staticmethod
    def _engines(ev: Evaluation) -> Iterator[Metric]:
        """The engine side's own health (contract v1.2): what its recorders lost, what its plugins see."""
        counts = {name: counter(metric) for name, metric in ((c.H_SPANS_DROPPED, c.ENGINE_SPANS_DROPPED),
                                                             (c.H_EXPORTS_FAILED, c.ENGINE_EXPORTS_FAILED),
                                                             (c.H_HOOK_ERRORS, c.ENGINE_HOOK_ERRORS))}
        info = gauge(c.ENGINE_INFO)
        for inst in ev.instances:
            labels = [inst.cluster, inst.role, inst.name]
            for name, family in counts.items():
                family.add_metric(labels, inst.recorder.get(name, 0))
            info.add_metric([*labels, inst.engine, inst.engine_version, inst.plugin_version, inst.plugin_state], 1)
        yield from (*counts.values(), info)

    @staticmethod
    def _own(ev: Evaluation) -> Iterator[Metric]:
        n = ev.counters
        yield counter(c.SPANS_RECEIVED, n.spans_received)
        rejected = counter(c.SPANS_REJECTED)
        for reason, count in n.spans_rejected.items():
            rejected.add_metric([reason], count)
        yield rejected
        yield counter(c.SPANS_FOREIGN, n.spans_foreign)
        yield counter(c.SPANS_DUPLICATE, n.duplicates)
        yield counter(c.HEARTBEATS_RECEIVED, n.heartbeats)
        yield gauge(c.TRACKED_LEGS, n.tracked_legs)
        yield gauge(c.TRACKED_INSTANCES, n.tracked_instances)
        yield gauge(c.GONE_PEERS, n.gone_peers)
        evicted = counter(c.LEGS_EVICTED)
        for reason, count in n.evicted.items():
            evicted.add_metric([reason], count)
        yield evicted
        yield counter(c.INSTANCES_EXPIRED, n.instances_expired)
        yield counter(c.LABEL_SETS_REFUSED, n.label_sets_refused)
        yield gauge(c.EVALUATION_TIMESTAMP, ev.at_ns / 1e9)
