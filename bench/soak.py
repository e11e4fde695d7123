"""Soak: a real `pdwatch serve` churns through a million legs or more while its
resident memory (VmRSS from /proc/<pid>/status) is sampled every second.

Each OTLP request is one engine's heartbeat cycle:
  - an inventory heartbeat listing `--inventory` legs that are open now, all new;
    the legs of its previous heartbeat are no longer listed, so they end
    (`vanished`): the path that catches lost leg spans;
  - `--full` legs that live a whole lifecycle: their finished stage spans and a
    `pd.request` leg span that closes them (`ok`, now and then `failed`);
  - now and then a process restart (a new incarnation: its open legs end
    `lost`), and a generation of instance names that goes silent, so the
    instance TTL and the instance cap are churned too.
Memory is flat when every bound holds: open legs, finished-leg history, the
de-duplication memory, threshold windows, label sets, instances.

    python bench/soak.py [--legs 1000000] [--max-seconds 600] [--inventory 2048] [--full 512]

Prints legs churned, requests, RSS at start, after warm-up and at the end,
and whether RSS stayed flat (growth after warm-up within --flat-tolerance).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pdwatch import contract as c
from pdwatch.contract.otlp import set_value
from pdwatch.sidecar.overload import read_rss_bytes
from pdwatch.testbed.sidecar_process import SidecarProcess

PREFILL = ("bootstrap", "queued", "prefill", "transfer")


def rss_bytes(pid: int) -> int:
    rss = read_rss_bytes(f"/proc/{pid}/status")  # the reader the sidecar's own memory guard uses
    if rss is None:
        raise RuntimeError(f"no VmRSS for pid {pid}")
    return rss


def _kv(key: str, value) -> KeyValue:
    kv = KeyValue(key=key)
    set_value(kv.value, value)  # the writer the engine and the forwarder use
    return kv


class Engines:
    """Builds the requests: `instances` prefill engines, new trace ids for every leg, engine clock = wall clock."""

    def __init__(self, instances: int, inventory: int, full: int, restart_every: int, generation_s: float):
        self.instances, self.inventory, self.full = instances, inventory, full
        self.restart_every, self.generation_s = restart_every, generation_s
        self.next_leg = 1
        self.next_span = 1
        self.seq: dict[tuple[int, int], int] = {}
        self.incarnation: dict[tuple[int, int], int] = {}
        self.rounds = 0
        self.t0 = time.monotonic()

    def _ids(self) -> tuple[bytes, bytes]:
        tid = self.next_leg.to_bytes(16, "big")
        self.next_leg += 1
        return tid, self._span_id()

    def _span_id(self) -> bytes:
        sid = self.next_span.to_bytes(8, "big")
        self.next_span += 1
        return sid

    def body(self, k: int) -> tuple[bytes, int]:
        """One request from engine k; returns (serialized body, legs it opens or closes)."""
        gen = int((time.monotonic() - self.t0) / self.generation_s)
        key = (gen, k)
        self.rounds += 1
        restarts = self.incarnation.setdefault(key, 0)
        if self.restart_every and self.rounds % self.restart_every == 0:
            restarts = self.incarnation[key] = restarts + 1
            self.seq[key] = 0
        seq = self.seq[key] = self.seq.get(key, 0) + 1
        now = time.time_ns()
        req = ExportTraceServiceRequest()
        rs = req.resource_spans.add()
        rs.resource.attributes.extend([
            _kv(c.R_ROLE, "prefill"), _kv(c.R_CLUSTER, "soak"), _kv(c.R_INSTANCE, f"soak-{gen}-{k}"),
            _kv(c.R_INSTANCE_ID, f"soak-{gen}-{k}-{restarts}"), _kv(c.R_START_NS, now - 10**9 + restarts),
            _kv(c.R_SERVICE_NAME, "soak"),
        ])
        spans = rs.scope_spans.add().spans
        # Full lifecycles: four stage spans and the leg span, each leg its own trace.
        for i in range(self.full):
            tid, leg_sid = self._ids()
            t = now - 10**9
            for stage in PREFILL:
                spans.append(Span(name=c.stage_span_name(stage), trace_id=tid, span_id=self._span_id(),
                                  parent_span_id=leg_sid, start_time_unix_nano=t, end_time_unix_nano=t + 10**8))
                t += 10**8
            outcome = "failed" if i % 50 == 0 else "ok"
            leg = Span(name=c.SPAN_LEG, trace_id=tid, span_id=leg_sid, start_time_unix_nano=now - 10**9,
                       end_time_unix_nano=t, attributes=[_kv(c.A_ROLE, "prefill"), _kv(c.A_OUTCOME, outcome),
                                                        _kv(c.A_RID, f"r-{tid.hex()[-8:]}")])
            if outcome != "ok":
                leg.status.code = Status.STATUS_CODE_ERROR
            spans.append(leg)
        # The inventory: new legs open now in queued; the previous heartbeat's are gone.
        tids = []
        for _ in range(self.inventory):
            tids.append(f"{self.next_leg:032x}")
            self.next_leg += 1
        n = len(tids)
        hb = Span(name=c.SPAN_HEARTBEAT, trace_id=(10**6 + k).to_bytes(16, "big"), span_id=self._span_id(),
                  start_time_unix_nano=now, end_time_unix_nano=now, attributes=[
                      _kv(c.H_SEQ, seq), _kv(c.H_INTERVAL, 2.0), _kv(c.H_OPEN_TOTAL, n),
                      _kv(c.H_OPEN_TRACE_IDS, tids), _kv(c.H_OPEN_STAGES, ["queued"] * n),
                      _kv(c.H_OPEN_SINCE, [now - 10**9] * n), _kv(c.H_OPEN_COUNT_PREFIX + "queued", n),
                  ])
        spans.append(hb)
        return req.SerializeToString(), self.full + n


class RssSampler(threading.Thread):
    def __init__(self, pid: int, every_s: float = 1.0):
        super().__init__(daemon=True)
        self.pid, self.every = pid, every_s
        self.samples: list[tuple[float, int, int]] = []  # (seconds, rss, legs churned so far)
        self.legs = 0
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    def run(self):
        while not self.stop.is_set():
            self.samples.append((time.monotonic() - self.t0, rss_bytes(self.pid), self.legs))
            self.stop.wait(self.every)


def soak(legs: int = 1_000_000, max_seconds: float = 600.0, min_seconds: float = 0.0, inventory: int = 2048,
         full: int = 512, instances: int = 8, warmup: float = 0.25, flat_tolerance: float = 0.10,
         env: dict | None = None, log=print) -> dict:
    """Run the soak; returns its figures. Bounded by `legs` (and `min_seconds`) and by `max_seconds`."""
    settings = {c.ENV_NVML: "off", c.ENV_INSTANCE_TTL: "5", c.ENV_MAX_INSTANCES: "64",
                c.ENV_LOG_LEVEL: "warning", **(env or {})}
    engines = Engines(instances, inventory, full, restart_every=97, generation_s=3.0)
    statuses: dict[int, int] = {}
    with SidecarProcess(env=settings) as sc:
        pid = sc.proc.pid
        sampler = RssSampler(pid)
        rss_start = rss_bytes(pid)
        sampler.start()
        t0 = time.monotonic()
        requests = churned = 0
        with httpx.Client(base_url=sc.url, timeout=30, headers={"content-type": "application/x-protobuf"}) as http:
            while True:
                elapsed = time.monotonic() - t0
                if elapsed >= max_seconds or (churned >= legs and elapsed >= min_seconds):
                    break
                body, n = engines.body(requests % instances)
                r = http.post("/v1/traces", content=body)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                if r.status_code == 200:
                    churned += n
                elif r.status_code in (429, 503):
                    time.sleep(float(r.headers.get("retry-after", "1")))
                requests += 1
                sampler.legs = churned
        seconds = time.monotonic() - t0
        time.sleep(1.2)  # one more sample after the last request
        sampler.stop.set()
        sampler.join()
        health = sc.get("/healthz")
        metrics = sc.client.get("/metrics").text
    samples = sampler.samples
    warm = [s for s in samples if s[2] >= warmup * churned] or samples[-1:]
    rss_warm = warm[0][1]
    rss_after = [s[1] for s in warm]
    rss_end, rss_peak = samples[-1][1], max(s[1] for s in samples)
    growth = (max(rss_after) - rss_warm) / rss_warm
    figures = {
        "legs_churned": churned, "requests": requests, "seconds": round(seconds, 1),
        "legs_per_s": round(churned / seconds), "statuses": statuses,
        "rss_start_mib": round(rss_start / 2**20, 1), "rss_after_warmup_mib": round(rss_warm / 2**20, 1),
        "rss_end_mib": round(rss_end / 2**20, 1), "rss_peak_mib": round(rss_peak / 2**20, 1),
        "growth_after_warmup": round(growth, 4), "flat": growth <= flat_tolerance,
        "tracked_legs_end": health["tracked_legs"], "instances_end": health["instances"],
        "rss_samples": len(samples),
        "evicted": {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                    if line.startswith(c.LEGS_EVICTED.series + "{")},
        "instances_expired": next((float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                                   if line.startswith(c.INSTANCES_EXPIRED.series + " ")), 0.0),
    }
    log(json.dumps(figures))
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--legs", type=int, default=1_000_000, help="legs to churn at least")
    ap.add_argument("--min-seconds", type=float, default=0.0, help="keep going at least this long")
    ap.add_argument("--max-seconds", type=float, default=600.0, help="stop after this long whatever the count")
    ap.add_argument("--inventory", type=int, default=2048, help="new legs listed per heartbeat")
    ap.add_argument("--full", type=int, default=512, help="legs with a whole lifecycle per request")
    ap.add_argument("--instances", type=int, default=8, help="engines sending at once")
    ap.add_argument("--flat-tolerance", type=float, default=0.10, help="allowed RSS growth after warm-up")
    args = ap.parse_args()
    f = soak(args.legs, args.max_seconds, args.min_seconds, args.inventory, args.full, args.instances,
             flat_tolerance=args.flat_tolerance, log=lambda s: None)
    print(f"legs churned: {f['legs_churned']:,} in {f['seconds']} s ({f['legs_per_s']:,}/s), "
          f"{f['requests']:,} requests, statuses {f['statuses']}")
    print(f"sidecar RSS (VmRSS): start {f['rss_start_mib']} MiB, after warm-up {f['rss_after_warmup_mib']} MiB, "
          f"end {f['rss_end_mib']} MiB, peak {f['rss_peak_mib']} MiB ({f['rss_samples']} samples)")
    print(f"growth after warm-up: {f['growth_after_warmup'] * 100:.1f} % "
          f"({'flat' if f['flat'] else 'NOT flat'} within {args.flat_tolerance * 100:.0f} %)")
    print(f"at the end: {f['tracked_legs_end']} legs tracked, {f['instances_end']} instances; "
          f"evicted {f['evicted']}, instances expired {f['instances_expired']:.0f}")
    ok = f["legs_churned"] >= args.legs and f["flat"] and set(f["statuses"]) <= {200, 429, 503}
    print(f"goal (>= {args.legs:,} legs, RSS flat, no other status): {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
