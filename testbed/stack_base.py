"""What every testbed stack shares: its arguments, start, timed scenario actions, events, restarts, load and stop.

A kind of stack (`stack.Stack`, pdwatch's emulated engines; `sglang_pd.stack.SglangStack`,
live SGLang servers) names its scenarios (`catalogue`) and its own defaults (`defaults`),
starts its processes and returns the client that sends the load (`_launch`), says which
NIXL agent each engine has (`agents`), and defines `_action_<name>` for the actions its
scenarios take. Both take the arguments of `StackArgs`, by keyword, and a few of their own.
"""

from __future__ import annotations

import atexit
import logging
import math
import signal
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar, TypedDict, TypeVar

from pdwatch import contract as c

from .processes import EngineProcess
from .router import LoadGenerator, StackClient, Truth
from .scenarios import Catalogue, Params

if TYPE_CHECKING:
    from typing_extensions import Unpack

log = logging.getLogger("pdwatch.testbed.stack")

# What a stack says happened: {"event": name, "t": wall clock, ...}, JSON values by event.
Event = dict[str, Any]
S = TypeVar("S", bound="StackBase")

_live: weakref.WeakSet[StackBase] = weakref.WeakSet()
EVENTS_KEPT = 1000  # a caller that never polls loses the oldest


class StackArgs(TypedDict, total=False):
    """The arguments every stack takes; what a caller leaves out comes from the kind's defaults."""

    otlp_endpoint: str  # where the engines export (a loopback URL)
    heartbeat_s: float
    rate: float  # requests per second
    restart_at: float  # seconds after the load starts when the scenario's fault happens
    seed: int
    decode_floor_s: float  # the decode stuck floor the long-decode generations are sized against
    cluster: str
    duration_s: float | None  # seconds of load (None: until max_requests are sent)
    traceparent: bool  # every request carries a W3C traceparent
    decodes: int
    token_interval_s: float
    max_requests: int | None  # None: half as many again as the rate sends in the duration (or an hour)
    ready_timeout_s: float
    stop_timeout_s: float


# What both kinds default to alike; each kind's `defaults` gives the rest.
SHARED_DEFAULTS = StackArgs(otlp_endpoint=c.DEFAULT_SIDECAR_URL, heartbeat_s=1.0, seed=1, decode_floor_s=30.0,
                            cluster="default", duration_s=None, decodes=2, max_requests=None)


@atexit.register
def _stop_all() -> None:
    for stack in list(_live):
        stack.stop()


class StackBase:
    catalogue: ClassVar[Catalogue]
    defaults: ClassVar[StackArgs]  # rate, restart_at, traceparent, token_interval_s, ready and stop timeouts

    def __init__(self, scenario: str, *, tuning: Mapping[str, Any] | None = None, **given: Unpack[StackArgs]):
        unknown = sorted(set(given) - StackArgs.__optional_keys__)
        if unknown:
            raise TypeError(f"{type(self).__name__}() got unexpected keyword arguments: {', '.join(unknown)}")
        args: StackArgs = {**SHARED_DEFAULTS, **self.defaults, **given}
        self.scenario = self.catalogue.get(scenario)
        rate, restart_at, duration_s = args["rate"], args["restart_at"], args["duration_s"]
        decode_floor_s, token_interval_s = args["decode_floor_s"], args["token_interval_s"]
        for name, value in (("heartbeat_s", args["heartbeat_s"]), ("rate", rate), ("decode_floor_s", decode_floor_s),
                            ("token_interval_s", token_interval_s), ("ready_timeout_s", args["ready_timeout_s"])):
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if restart_at < 0:
            raise ValueError(f"restart_at must not be negative, got {restart_at}")
        if duration_s is not None and not duration_s > 0:
            raise ValueError(f"duration_s must be positive or None, got {duration_s}")
        self._check_decodes(args["decodes"])
        otlp_endpoint = args["otlp_endpoint"]
        if not otlp_endpoint.startswith(("http://127.0.0.1", "http://localhost", "http://[::1]")):
            raise ValueError(f"otlp_endpoint must be a loopback http URL, got {otlp_endpoint!r}")
        self.params = Params(rate=rate, restart_at=restart_at, decode_floor_s=decode_floor_s,
                             token_interval_s=token_interval_s)
        if tuning:  # the scenario's other knobs (Params' fields: overload_s, idle_s, ...)
            self.params = replace(self.params, **tuning)
        self.decode_names = [f"decode-{i}" for i in range(args["decodes"])]
        self.otlp_endpoint = otlp_endpoint
        self.heartbeat_s = args["heartbeat_s"]
        self.cluster = args["cluster"]
        self.seed = args["seed"]
        self.duration_s = duration_s
        self.traceparent = args["traceparent"]
        self.ready_timeout_s = args["ready_timeout_s"]
        self.stop_timeout_s = args["stop_timeout_s"]
        self.load = True  # False (SglangStack(load=False)): start() starts no load and no actions
        max_requests = args["max_requests"]
        if max_requests is None:
            # Bounded even when no duration is given: one hour at the rate.
            horizon = duration_s if duration_s is not None else 3600.0
            max_requests = math.ceil(rate * self.scenario.peak_factor(self.params) * horizon * 1.5) + 10
        self.max_requests = max_requests
        self.engines: dict[str, EngineProcess] = {}
        self.router: StackClient | None = None
        self.loadgen: LoadGenerator | None = None
        self.started_at: float | None = None
        self._events: list[Event] = []
        self._events_lock = threading.Lock()
        self._stop = threading.Event()
        self._stopped = False
        self._actions_thread: threading.Thread | None = None
        self._proc_lock = threading.Lock()

    def _check_decodes(self, decodes: int) -> None:
        if decodes < 1:
            raise ValueError(f"decodes must be at least 1, got {decodes}")

    # ---- what a kind of stack provides -------------------------------------------

    def _launch(self) -> StackClient:
        """Start every process and return the client of the ready stack; start() stops what it left on failure."""
        raise NotImplementedError

    def agents(self) -> dict[str, str | None]:
        """Each engine's current NIXL agent name (None where it has none or it is unknown)."""
        raise NotImplementedError

    def _check_restartable(self, instance: str) -> None:
        """Raise ValueError unless restart() can restart this instance."""
        raise NotImplementedError

    def _before_respawn(self, instance: str) -> None:
        """Between the kill of a restarted instance and its new start (its process is down)."""

    def _release(self) -> None:
        """What the stack holds beyond its processes (folders, emulated GPUs); stop() calls it once."""

    # ---- start ---------------------------------------------------------------------

    def start(self: S) -> S:
        """Returns once every engine is ready and the load (unless `load` is False) has begun."""
        if self.started_at is not None:
            raise RuntimeError(f"{type(self).__name__}.start() was already called")
        _live.add(self)
        self.started_at = time.time()
        try:
            self.router = router = self._launch()
        except BaseException:
            self.stop()
            raise
        self._event("ready", instances=self.agents(), startup_s=round(time.time() - self.started_at, 3))
        if not self.load:
            return self
        self.loadgen = LoadGenerator(router, lambda rng, i: self.scenario.shape(self.params, rng, i),
                                     rate=self.params.rate, seed=self.seed, duration_s=self.duration_s,
                                     max_requests=self.max_requests)
        self.loadgen.start()
        self._actions_thread = threading.Thread(target=self._run_actions, name="scenario-actions", daemon=True)
        self._actions_thread.start()
        return self

    # ---- scenario actions ----------------------------------------------------

    def _run_actions(self) -> None:
        t0 = time.monotonic()
        for at_s, action, instance in sorted(self.scenario.actions(self.params)):
            if self._stop.wait(max(0.0, at_s - (time.monotonic() - t0))):
                return
            try:
                getattr(self, f"_action_{action.replace('-', '_')}")(instance)
            except Exception as e:
                log.exception("scenario action %s on %s failed", action, instance)
                self._event("action_failed", action=action, instance=instance, error=str(e))

    def _action_freeze(self, instance: str) -> None:
        """SIGSTOP the engine's process group: it keeps its sockets and state but runs nothing,
        heartbeats included (stop sends SIGCONT first, so it can still exit cleanly)."""
        self.engines[instance].signal(signal.SIGSTOP)
        self._event("frozen", instance=instance)

    def _action_restart(self, instance: str) -> None:
        self.restart(instance)

    def restart(self, instance: str) -> Event:
        """Kill `instance` (SIGKILL) and start it again alone, on the same ports, with a new NIXL agent."""
        self._check_restartable(instance)
        proc = self.engines[instance]
        with self._proc_lock:  # stop() must not miss a process spawned while it runs
            if self._stopped:
                raise RuntimeError("the stack is stopped")
            old_agent = self.agents().get(instance)
            t = time.time()
            proc.kill()
            if self.router is not None:
                self.router.note_restart(instance, t)
            self._event("killed", instance=instance, t=t, agent=old_agent)
            self._before_respawn(instance)
            proc.spawn()
        proc.wait_ready(self.ready_timeout_s, cancel=self._stop)
        return self._event("restart", instance=instance, t=t, old_agent=old_agent,
                           new_agent=self.agents().get(instance), ready_after_s=round(time.time() - t, 3))

    # ---- what callers read -----------------------------------------------------

    def _event(self, name: str, **fields: Any) -> Event:
        event = {"event": name, "t": fields.pop("t", time.time()), **fields}
        with self._events_lock:
            self._events.append(event)
            del self._events[:-EVENTS_KEPT]
        return event

    def poll_events(self) -> list[Event]:
        with self._events_lock:
            out, self._events = self._events, []
        return out

    def truth(self) -> Truth:
        if self.router is None:
            return Truth(requests=[])
        return self.router.truth()

    def logs(self, instance: str, n: int = 50) -> list[str]:
        return list(self.engines[instance].log)[-n:]

    def pids(self) -> dict[str, int | None]:
        return {name: proc.pid for name, proc in self.engines.items()}

    # ---- stop ------------------------------------------------------------------

    def stop(self) -> None:
        """Stop load, router and engines within about stop_timeout_s; idempotent."""
        with self._proc_lock:
            if self._stopped:
                return
            self._stopped = True
        self._stop.set()
        if self.loadgen is not None:
            self.loadgen.stop()
        if self.router is not None:
            self.router.close()
        if self._actions_thread is not None:
            self._actions_thread.join(self.stop_timeout_s)
        for proc in self.engines.values():
            proc.begin_stop()
        deadline = time.monotonic() + self.stop_timeout_s
        for proc in self.engines.values():
            proc.finish_stop(deadline)
        self._release()
        _live.discard(self)
        self._event("stopped")

    def stop_load(self) -> None:
        """End the load early; engines keep running (and open requests stay open)."""
        if self.loadgen is not None:
            self.loadgen.stop()

    @property
    def load_done(self) -> bool:
        return self.loadgen is not None and self.loadgen.finished

    def __enter__(self: S) -> S:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
