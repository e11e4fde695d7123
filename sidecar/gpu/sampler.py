"""Samples every GPU through NVML (nvidia-ml-py) on a thread of its own.

One pass reads, per device: UUID, name, utilization, power, power limit,
memory used and the PIDs of its compute processes. The result is published as
one immutable GpuSnapshot, so readers (the scrape, /healthz, the diagnosis)
never wait on NVML and never see half a pass. NVML's own calls can hang on a
GPU in trouble; they only ever hold up this thread, and a pass that runs too
long turns the snapshot's `up` off with the reason.

No NVML at all (no library, no driver) is a state, not an error: `up` is
False and `reason` says why; the thread keeps retrying init every
`init_retry_s`. An NVML error on one device is recorded on that device and
the pass goes on to the next.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

log = logging.getLogger("pdwatch.gpu")

MODES = ("auto", "off")
# Bound on what one pass keeps; hosts have at most a few dozen GPUs.
MAX_DEVICES = 64


@dataclass(frozen=True)
class DeviceSample:
    index: int
    uuid: str  # "" when NVML could not say
    name: str
    utilization: float | None  # 0..1
    power_w: float | None
    power_limit_w: float | None
    memory_used_bytes: int | None
    pids: tuple[int, ...]  # compute processes, sorted
    error: str | None  # "query: NVML message; ..." for the queries that failed
    # The same failures as (query, NVML error name), e.g. ("power", "not_supported").
    failures: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class GpuSnapshot:
    up: bool
    reason: str | None  # why not up
    devices: tuple[DeviceSample, ...]
    sampled_at: float | None  # clock() at the end of the pass
    driver: str | None


class GpuSampler:
    def __init__(
        self,
        interval_s: float = 1.0,
        mode: str = "auto",
        clock: Callable[[], float] = time.time,
        *,
        library: str | None = None,
        init_retry_s: float = 5.0,
        stall_after_s: float | None = None,
    ) -> None:
        """`library`: path of an NVML library to load instead of the one the
        loader finds (the stub, or a driver outside the search path).
        `stall_after_s`: a pass running longer than this marks telemetry down
        (default: the larger of 10 s and five intervals)."""
        if mode not in MODES:
            raise ValueError(f"GPU sampling mode must be one of {', '.join(MODES)}, not {mode!r}")
        if not interval_s > 0:
            raise ValueError(f"GPU sampling interval must be > 0 s, not {interval_s!r}")
        self._interval = float(interval_s)
        self._mode = mode
        self._clock = clock
        self._library = library
        self._init_retry = float(init_retry_s)
        self._stall_after = float(stall_after_s) if stall_after_s is not None else max(10.0, 5 * self._interval)

        self._nv: Any = None  # the pynvml module once NVML is initialized
        self._driver: str | None = None
        self._pass_lock = threading.Lock()  # one pass at a time (thread and sample_once)
        self._pass_started: float | None = None  # monotonic, while a pass runs
        self._stall_logged: float | None = None  # _pass_started of the stall last logged
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._device_failures: dict[int, tuple[tuple[str, str], ...]] = {}
        self._identities: dict[int, tuple[str, str]] = {}  # index -> (uuid, name) last read
        reason = "disabled" if mode == "off" else "not sampled yet"
        self._snapshot = GpuSnapshot(False, reason, (), None, None)

    # ---- lifecycle ---------------------------------------------------------

    def start(self) -> GpuSampler:
        """Samples on a daemon thread; NVML is initialized there, never in the caller."""
        if self._mode == "off" or self._thread is not None:
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="pdwatch-gpu-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stops the thread; a thread stuck in an NVML call is left behind (it is a daemon)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("GPU sampler thread still inside an NVML call after %.1f s; leaving it", timeout_s)
                return
        with self._pass_lock:
            self._shutdown_nvml()

    def snapshot(self) -> GpuSnapshot:
        snap = self._snapshot  # one immutable object: nothing to copy or lock
        started = self._pass_started
        if snap.up and started is not None:
            running = time.monotonic() - started
            if running > self._stall_after:
                if self._stall_logged != started:
                    self._stall_logged = started  # once per stalled pass
                    log.warning("GPU telemetry down: an NVML pass has run for %.0f s", running)
                return replace(snap, up=False, reason=f"NVML sampling stalled: a pass has run for {running:.0f} s")
        return snap

    # ---- one pass ----------------------------------------------------------

    def sample_once(self) -> None:
        """One pass over every device; publishes a new snapshot. Never raises."""
        if self._mode == "off":
            self._publish(GpuSnapshot(False, "disabled", (), None, None))
            return
        with self._pass_lock:
            self._pass_started = time.monotonic()
            try:
                self._pass()
            except Exception as exc:  # a bug or an odd binding must not kill the thread
                log.exception("GPU sampling pass failed")
                self._shutdown_nvml()
                self._publish(GpuSnapshot(False, f"GPU sampling failed: {exc!r}", (), None, None))
            finally:
                self._pass_started = None

    def _pass(self) -> None:
        if self._nv is None and not self._init():
            return
        nv = self._nv
        try:
            count = nv.nvmlDeviceGetCount()
        except nv.NVMLError as exc:
            # The library itself stopped answering: start over with a fresh init.
            self._shutdown_nvml()
            self._publish(GpuSnapshot(False, f"NVML device count failed: {exc}", (), None, self._driver))
            return
        devices = tuple(self._read_device(nv, i) for i in range(min(count, MAX_DEVICES)))
        self._log_device_changes(devices)
        self._publish(GpuSnapshot(True, None, devices, self._clock(), self._driver))

    def _init(self) -> bool:
        try:
            import pynvml
        except ImportError as exc:
            self._publish(GpuSnapshot(False, f"nvidia-ml-py is not installed: pip install 'pdwatch[gpu]' ({exc})",
                                      (), None, None))
            return False
        if self._library is not None:
            # pynvml opens "libnvidia-ml.so.1" by soname; once a library with that
            # soname is loaded, the loader hands it back for that name.
            try:
                ctypes.CDLL(self._library)
            except OSError as exc:
                self._publish(GpuSnapshot(False, f"cannot load NVML library {self._library}: {exc}", (), None, None))
                return False
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            self._publish(GpuSnapshot(False, f"NVML init failed: {exc}", (), None, None))
            return False
        try:
            self._driver = str(pynvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError:
            self._driver = None
        self._nv = pynvml
        return True

    def _shutdown_nvml(self) -> None:
        nv, self._nv = self._nv, None
        if nv is not None:
            try:
                nv.nvmlShutdown()
            except Exception:  # shutting down a broken library: nothing more to do
                pass

    def _read_device(self, nv: Any, index: int) -> DeviceSample:
        failures: list[tuple[str, str]] = []
        messages: list[str] = []
        lost = False

        def query(name: str, fn: Callable[..., Any], *args: Any) -> Any:
            nonlocal lost
            if lost:
                return None
            try:
                return fn(*args)
            except nv.NVMLError as exc:
                code, text = _error_name(nv, exc), _error_text(exc)
                # A lost GPU fails every query alike: report it once.
                lost = code == "gpu_is_lost"
            except Exception as exc:  # a binding-level surprise on one query
                code, text = type(exc).__name__.lower(), _error_text(exc)
            failures.append((name, code))
            messages.append(f"{name}: {text}")
            return None

        # A device that fell off the bus no longer says who it is; the identity
        # it had keeps its owner labels on the error series.
        known_uuid, known_name = self._identities.get(index, ("", ""))
        handle = query("handle", nv.nvmlDeviceGetHandleByIndex, index)
        if handle is None:
            return DeviceSample(index, known_uuid, known_name, None, None, None, None, (), "; ".join(messages), tuple(failures))
        uuid = query("uuid", nv.nvmlDeviceGetUUID, handle)
        name = query("name", nv.nvmlDeviceGetName, handle)
        if uuid is not None:
            self._identities[index] = (str(uuid), str(name or ""))  # index < MAX_DEVICES: bounded
        else:
            uuid, name = known_uuid, name or known_name
        util = query("utilization", nv.nvmlDeviceGetUtilizationRates, handle)
        power_mw = query("power", nv.nvmlDeviceGetPowerUsage, handle)
        limit_mw = query("power_limit", _power_limit, nv, handle)
        memory = query("memory", nv.nvmlDeviceGetMemoryInfo, handle)
        procs = query("processes", nv.nvmlDeviceGetComputeRunningProcesses, handle)
        return DeviceSample(
            index=index,
            uuid=str(uuid or ""),
            name=str(name or ""),
            utilization=None if util is None else min(max(util.gpu / 100.0, 0.0), 1.0),
            power_w=None if power_mw is None else power_mw / 1000.0,
            power_limit_w=None if limit_mw is None else limit_mw / 1000.0,
            memory_used_bytes=None if memory is None else int(memory.used),
            pids=tuple(sorted({int(p.pid) for p in procs or ()})),
            error="; ".join(messages) or None,
            failures=tuple(failures),
        )

    # ---- publishing and logs ------------------------------------------------

    def _publish(self, snap: GpuSnapshot) -> None:
        old = self._snapshot
        if (old.up, old.reason) != (snap.up, snap.reason):
            if snap.up:
                log.info("GPU telemetry up: %d device(s), driver %s", len(snap.devices), snap.driver)
            elif snap.reason != "not sampled yet":
                log.warning("GPU telemetry down: %s", snap.reason)
        self._snapshot = snap

    def _log_device_changes(self, devices: tuple[DeviceSample, ...]) -> None:
        # Logged on change only, so a device that stays broken is one line.
        seen = {d.index: d.failures for d in devices}
        for d in devices:
            if d.failures != self._device_failures.get(d.index, ()):
                if d.failures:
                    log.warning("GPU %d (%s): %s", d.index, d.uuid or "uuid unknown", d.error)
                else:
                    log.info("GPU %d (%s): queries answer again", d.index, d.uuid)
        for index in self._device_failures.keys() - seen.keys():
            log.warning("GPU %d no longer listed by NVML", index)
        self._device_failures = seen

    # ---- the thread ----------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            self.sample_once()
            pause = self._interval if self._nv is not None else self._init_retry
            self._stop.wait(max(0.0, pause - (time.monotonic() - began)))
        with self._pass_lock:
            self._shutdown_nvml()


def _power_limit(nv: Any, handle: Any) -> int:
    # The enforced limit is what the GPU is held to; older boards only know the management limit.
    limit: int  # milliwatts; NVML's bindings are untyped
    try:
        limit = nv.nvmlDeviceGetEnforcedPowerLimit(handle)
    except nv.NVMLError_NotSupported:
        limit = nv.nvmlDeviceGetPowerManagementLimit(handle)
    return limit


_ERROR_NAMES: dict[int, str] = {}


def _error_name(nv: Any, exc: Exception) -> str:
    """NVML's error constant without its prefix, lower case: 'gpu_is_lost'."""
    if not _ERROR_NAMES:
        for attr, value in vars(nv).items():
            if attr.startswith("NVML_ERROR_") and isinstance(value, int):
                _ERROR_NAMES.setdefault(value, attr[len("NVML_ERROR_"):].lower())
    value = getattr(exc, "value", None)
    return _ERROR_NAMES.get(value, f"code_{value}") if isinstance(value, int) else "unknown"


def _error_text(exc: Exception) -> str:
    try:
        return str(exc)
    except Exception:  # pynvml's __str__ itself calls into the library
        return repr(exc)
