"""The one thread that owns the tracker: it applies ingested requests, runs the
judge's tick, and answers the few read-only queries that need a leg's detail.

Ingest hands work over with `submit` and awaits the returned future, so the
event loop that serves ingest, the API and /healthz never waits on a lock or
on the judge's walk over every open leg. Everything the tracker and the judge
touch is touched from this thread alone, so none of it needs a lock.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from pdwatch import contract as c

log = logging.getLogger("pdwatch.sidecar.worker")

T = TypeVar("T")
_STOP = object()


class Worker:
    def __init__(self, tick: Callable[[], object], interval_s: float, *, name: str = "pdwatch-tracker"):
        self._tick = tick
        self.interval_s = interval_s
        self._name = name
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.ticks = 0
        self.tick_errors = 0
        self.last_tick_s = 0.0  # how long the latest tick took
        # When the latest tick finished (monotonic; the worker's making until its first): the judge's age.
        self._done_at = time.monotonic()

    def start(self) -> Worker:
        if self._thread is None:
            self._done_at = time.monotonic()  # a judge that has not run yet is young, not stalled
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(_STOP)
            thread.join(timeout_s)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run fn(*args) on the tracker's thread; the future holds its result or its exception."""
        future: Future[T] = Future()
        self._queue.put((fn, args, future))
        self.start()  # a sidecar whose app runs without a lifespan still ingests
        return future

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """submit and wait (tests, and callers that are not on the event loop)."""
        if self._thread is None or threading.current_thread() is self._thread:
            return fn(*args)
        return self.submit(fn, *args).result()

    def tick_now(self) -> None:
        self.call(self._run_tick)

    def _run_tick(self) -> None:
        started = time.perf_counter()
        try:
            self._tick()
        except Exception:  # a judge bug must not stop ingest
            self.tick_errors += 1
            log.exception("the judge's tick failed")
        self.ticks += 1
        self.last_tick_s = time.perf_counter() - started
        self._done_at = time.monotonic()

    def age_s(self) -> float:
        """Seconds since the judge last finished a pass (a failed one counts: it ran, and will again)."""
        return time.monotonic() - self._done_at

    def stalled(self) -> bool:
        """The judge has not finished a pass for JUDGE_STALLED_INTERVALS of its intervals (contract v1.2)."""
        return self.age_s() > c.JUDGE_STALLED_INTERVALS * self.interval_s

    def _run(self) -> None:
        next_tick = time.monotonic()
        while True:
            try:
                item = self._queue.get(timeout=max(0.0, next_tick - time.monotonic()))
            except queue.Empty:
                item = None
            if item is _STOP:
                return
            if item is not None:
                fn, args, future = item
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(*args))
                    except BaseException as exc:  # handed to the caller, who answers for it
                        future.set_exception(exc)
            # The tick keeps its pace under any ingest load: checked after every item.
            if time.monotonic() >= next_tick:
                self._run_tick()
                next_tick = time.monotonic() + self.interval_s
