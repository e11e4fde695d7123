"""Prometheus exposition of the tracker (contract section 6).

Client_python style: collectors build fresh metric families from tracker
state on each scrape, so no gauge can go stale and label sets are exactly
those of live instances; ingest only bumps plain counters.
"""

from __future__ import annotations

import bisect
import math
import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.samples import Exemplar
from prometheus_client.utils import floatToGoString

from pdwatch import contract as c

from .tracker import Tracker

# Seconds; from sub-millisecond KV transfers to multi-minute generations.
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 30, 60, 120, 300, 600)
STUCK_INFO_TOP = 20

L_INST = ["cluster", "role", "pd_instance"]
L_GROUP = ["cluster", "role", "stage", "pd_instance"]


class StageDurations:
    """pdwatch_stage_duration_seconds with a trace_id exemplar per bucket.

    Kept as plain bucket counts rather than a client `Histogram`: that one
    validates the exemplar's labels on every observation, which cost more than
    the rest of ingest together. Exposition still goes through
    prometheus_client's `HistogramMetricFamily`.
    """

    def __init__(self, lock, max_label_sets: int = 4096, clock=time.time):
        self.lock = lock  # the tracker's: observations happen under it
        self.bounds = DURATION_BUCKETS
        self._series: dict = {}  # (cluster, role, stage) -> [counts, exemplars, sum]
        self.max_label_sets = max_label_sets
        self.refused = 0
        self.clock = clock

    def observe_many(self, cluster: str, role: str, stage: str, seconds: list[float], trace_ids: list[str]) -> None:
        """One batch's durations of one stage; each bucket keeps the batch's last trace id as its exemplar."""
        key = (cluster, role, stage)
        series = self._series.get(key)
        if series is None:
            if len(self._series) >= self.max_label_sets:
                self.refused += 1
                return
            n = len(self.bounds) + 1  # the last slot is +Inf
            series = self._series[key] = [[0] * n, [None] * n, 0.0]
        counts, exemplars, bounds, at = series[0], series[1], self.bounds, self.clock()
        for value, trace_id in zip(seconds, trace_ids):
            i = bisect.bisect_left(bounds, value)
            counts[i] += 1
            exemplars[i] = (trace_id, value, at)
        series[2] += sum(seconds)

    def describe(self):
        return []

    def collect(self):
        family = HistogramMetricFamily(
            "pdwatch_stage_duration_seconds",
            "Time legs spent in each stage, from the engines' finished stage spans.",
            labels=["cluster", "role", "stage"],
        )
        with self.lock:
            for key, (counts, exemplars, total) in sorted(self._series.items()):
                buckets, running = [], 0
                for bound, count, ex in zip((*self.bounds, math.inf), counts, exemplars):
                    running += count
                    le = "+Inf" if bound == math.inf else floatToGoString(bound)
                    if ex is None:
                        buckets.append((le, running))
                    else:
                        buckets.append((le, running, Exemplar({"trace_id": ex[0]}, ex[1], ex[2])))
                family.add_metric(list(key), buckets, total)
        return [family]


class TrackerCollector:
    def __init__(self, tracker: Tracker, durations: StageDurations | None = None):
        self.tracker = tracker
        self.durations = durations

    def describe(self):
        return []  # built per scrape; nothing to pre-register

    def collect(self):
        t = self.tracker
        # Built in full under the lock, handed over after it is released.
        with t.lock:
            ev = t.evaluate()
            return [*self._legs(t, ev), *self._instances(t, ev.at_ns), *self._own(t)]

    def _legs(self, t: Tracker, ev):
        inflight = GaugeMetricFamily("pdwatch_inflight_requests",
                                     "Open legs per stage, as the engines' latest heartbeats count them.", labels=L_GROUP)
        stuck = GaugeMetricFamily("pdwatch_stuck_requests",
                                  "Open legs past their stage's stuck threshold.", labels=L_GROUP)
        oldest = GaugeMetricFamily("pdwatch_oldest_stage_age_seconds",
                                   "Age of the oldest open leg in each stage (decode: since its last new token).",
                                   labels=L_GROUP)
        for inst in t.instances.values():
            owner = inst.owner
            counts = owner.open_counts if owner is not None else {}
            for stage in c.STAGES[inst.role]:
                labels = [inst.cluster, inst.role, stage, inst.name]
                group = ev.groups.get((inst.cluster, inst.role, stage, inst.name), (0, 0.0))
                inflight.add_metric(labels, counts.get(stage, 0))
                stuck.add_metric(labels, group[0])
                oldest.add_metric(labels, round(group[1], 3))
        yield inflight
        yield stuck
        yield oldest

        thr = GaugeMetricFamily("pdwatch_stuck_threshold_seconds",
                                "Current stuck threshold: max(floor, 3 x p99 of recent durations).",
                                labels=["cluster", "role", "stage"])
        for (cluster, role, stage), seconds in sorted(ev.thresholds.items()):
            thr.add_metric([cluster, role, stage], seconds)
        yield thr

        info = GaugeMetricFamily("pdwatch_stuck_request_info",
                                 "Stage age in seconds of each of the oldest stuck legs, named by trace id.",
                                 labels=L_GROUP + ["trace_id", "rid"])
        for s in ev.stuck[:STUCK_INFO_TOP]:
            leg = s.leg
            info.add_metric([leg.cluster, leg.role, leg.stage, leg.pd_instance, leg.trace_id, leg.rid], round(s.age_s, 3))
        yield info

        flowing = GaugeMetricFamily("pdwatch_cluster_flowing",
                                    "1 when some leg of the cluster finished ok within the flow window.",
                                    labels=["cluster"])
        for cluster, value in sorted(ev.flowing.items()):
            flowing.add_metric([cluster], 1 if value else 0)
        yield flowing

        finished = CounterMetricFamily("pdwatch_requests_finished", "Legs finished, by outcome.",
                                       labels=L_INST + ["outcome"])
        for (cluster, role, inst, outcome), n in sorted(t.finished.items()):
            finished.add_metric([cluster, role, inst, outcome], n)
        yield finished

        probes = CounterMetricFamily("pdwatch_probe_requests_finished",
                                     "Engine probe legs (warm-ups, health checks) finished, by outcome; "
                                     "counted apart from pdwatch_requests_finished_total and never as flow.",
                                     labels=L_INST + ["outcome"])
        for (cluster, role, inst, outcome), n in sorted(t.probes_finished.items()):
            probes.add_metric([cluster, role, inst, outcome], n)
        yield probes

        detected = CounterMetricFamily("pdwatch_stuck_detected", "Legs found stuck, each counted once.",
                                       labels=["cluster", "role", "stage"])
        for (cluster, role, stage), n in sorted(t.stuck_detected.items()):
            detected.add_metric([cluster, role, stage], n)
        yield detected

    def _instances(self, t: Tracker, now: int):
        up = GaugeMetricFamily("pdwatch_instance_up", "1 while every rank of the instance heartbeats.", labels=L_INST)
        start = GaugeMetricFamily("pdwatch_instance_start_time_seconds",
                                  "Start time of the instance's current process (rank 0), Unix seconds.", labels=L_INST)
        restarts = CounterMetricFamily("pdwatch_instance_restarts",
                                       "New processes seen under the same pd.instance.", labels=L_INST)
        stalled = GaugeMetricFamily("pdwatch_engine_loop_stalled",
                                    "1 when a rank heartbeats but its scheduler loop counter stopped moving.",
                                    labels=L_INST)
        age = GaugeMetricFamily("pdwatch_instance_heartbeat_age_seconds",
                                "Seconds since the instance's stalest rank last heartbeated.", labels=L_INST)
        for inst in t.instances.values():
            labels = [inst.cluster, inst.role, inst.name]
            owner = inst.owner
            up.add_metric(labels, 1 if t.instance_up(inst, now) else 0)
            if owner is not None and owner.start_ns:
                start.add_metric(labels, owner.start_ns / 1e9)
            restarts.add_metric(labels, inst.restarts)
            stalled.add_metric(labels, 1 if t.loop_stalled(inst, now) else 0)
            beats = [inc.last_heartbeat_ns for inc in inst.ranks.values() if inc.last_heartbeat_ns]
            if beats:
                age.add_metric(labels, round((now - min(beats)) / 1e9, 3))
        yield from (up, start, restarts, stalled, age)

    def _own(self, t: Tracker):
        received = CounterMetricFamily("pdwatch_spans_received", "Spans received on /v1/traces.")
        received.add_metric([], t.spans_received)
        rejected = CounterMetricFamily("pdwatch_spans_rejected", "Spans that could not be used, by reason.",
                                       labels=["reason"])
        for reason, n in t.rejected.items():
            rejected.add_metric([reason], n)
        duplicates = CounterMetricFamily("pdwatch_spans_duplicate",
                                         "Spans and heartbeats received again or late; applied once only.")
        duplicates.add_metric([], t.duplicates)
        heartbeats = CounterMetricFamily("pdwatch_heartbeats_received", "Heartbeats applied.")
        heartbeats.add_metric([], t.heartbeats_received)
        tracked = GaugeMetricFamily("pdwatch_tracked_legs", "Open legs the sidecar tracks.")
        tracked.add_metric([], len(t.open))
        instances = GaugeMetricFamily("pdwatch_tracked_instances", "Engine instances the sidecar tracks.")
        instances.add_metric([], len(t.instances))
        evicted = CounterMetricFamily("pdwatch_legs_evicted",
                                      "Legs dropped from tracking: open_limit (new legs refused at the memory cap), "
                                      "closed_limit (finished legs forgotten at the history cap), vanished (gone from their engine's inventory without a leg span), "
                                      "instance_gone (their instance sent nothing for PDWATCH_INSTANCE_TTL_S).",
                                      labels=["reason"])
        for reason, n in t.evicted.items():
            evicted.add_metric([reason], n)
        expired = CounterMetricFamily("pdwatch_instances_expired",
                                      "Instances forgotten after sending nothing for PDWATCH_INSTANCE_TTL_S.")
        expired.add_metric([], t.instances_expired)
        yield from (received, rejected, duplicates, heartbeats, tracked, instances, evicted, expired)
        if self.durations is not None:
            refused = CounterMetricFamily("pdwatch_label_sets_refused",
                                          "Observations dropped because a metric reached its label-set cap.")
            refused.add_metric([], self.durations.refused + t.thresholds.keys_refused)
            yield refused
