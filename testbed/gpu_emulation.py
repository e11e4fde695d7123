"""Emulated GPUs for the testbed: writes the NVML stub's state file.

Each emulated device's utilization and power follow what its engine process
is really doing, in the shapes the diagnosis reads (contract section 8):
a busy decode runs hot, an idle or wedged decode sits near 0 % at idle power,
and a spinning collective reads ~100 % at moderate power. The sidecar reads
the file through the unmodified nvidia-ml-py and the stub library
(nvml_stub/README.md has the format); `env()` gives a process what it needs
to load them.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import threading
import uuid as uuidlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypedDict

from pdwatch import contract as c

STATE_ENV = c.ENV_NVML_STUB_STATE  # the stub (nvml_stub/) reads its state file from here
# Built by `make nvml-stub` (and by make test / make demo).
STUB_DIR = Path(__file__).resolve().parent.parent / "build" / "nvml"
STUB_LIBRARY = STUB_DIR / "libnvidia-ml.so.1"

# Share of the span from idle power to the limit that each shape draws.
BUSY_POWER_SHARE = 0.95  # full decode work: close to the limit
SPIN_POWER_SHARE = 0.30  # a collective spinning on a flag: all SMs "busy", little math
H200_MEMORY = 141 * 10**9

_UNSET: Any = object()


class _Device(TypedDict):
    """One emulated device: what it is, and what it reports now."""

    uuid: str
    name: str
    power_limit_w: float
    idle_w: float
    memory_total: int
    utilization: float  # a fraction
    memory_utilization: float
    power_w: float
    memory_used: int
    pids: tuple[int, ...]
    error: str | None  # an NVML error name every query fails with
    fail: dict[str, str]  # query -> NVML error name
    delay_ms: int


class GpuEmulator:
    def __init__(self, path: str | os.PathLike[str], devices: list[dict[str, Any]], driver: str = "560.35.03-emulated") -> None:
        """`devices`: dicts with `index`, `uuid`, and optionally `name`,
        `power_limit_w` (700), `idle_w` (160), `memory_total` (bytes)."""
        self.path = Path(path)
        self._driver = _text(driver, "driver")
        self._system_errors: dict[str, str] = {}  # init_error / count_error
        self._lock = threading.Lock()
        self._devices: dict[int, _Device] = {}
        self._claimed: set[int] = set()
        self._deferred = 0  # open batch() blocks: writes wait for the last to close
        self._dirty = False
        for spec in devices:
            index = int(spec["index"])
            if index in self._devices:
                raise ValueError(f"emulated GPU index {index} given twice")
            limit = float(spec.get("power_limit_w", 700.0))
            idle = float(spec.get("idle_w", 160.0))
            if not 0 <= idle < limit:
                raise ValueError(f"GPU {index}: idle power {idle} W must lie in [0, power limit {limit} W)")
            self._devices[index] = {
                "uuid": _text(str(spec["uuid"]), "uuid"),
                "name": _text(str(spec.get("name", "NVIDIA H200 (emulated)")), "name"),
                "power_limit_w": limit,
                "idle_w": idle,
                "memory_total": int(spec.get("memory_total", H200_MEMORY)),
                "utilization": 0.0,
                "memory_utilization": 0.0,
                "power_w": idle,
                "memory_used": 0,
                "pids": (),
                "error": None,
                "fail": {},
                "delay_ms": 0,
            }
        if sorted(self._devices) != list(range(len(self._devices))):
            raise ValueError(f"emulated GPU indices must be 0..{len(self._devices) - 1}, got {sorted(self._devices)}")
        self._write()

    @classmethod
    def for_demo(cls, directory: str | os.PathLike[str] | None = None, count: int = 8) -> GpuEmulator:
        """`count` emulated H200s for a testbed stack (`Stack(gpus=...)` claims one per engine process).

        The state file goes under `directory`, or a temporary directory removed
        at exit. Raises FileNotFoundError when the stub library is not built
        (`make nvml-stub`), since nothing could read the file then.
        """
        if not STUB_LIBRARY.is_file():
            raise FileNotFoundError(f"the NVML stub is not built ({STUB_LIBRARY.name}): run make nvml-stub")
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        if directory is None:
            directory = tempfile.mkdtemp(prefix="pdwatch-gpus-")
            atexit.register(shutil.rmtree, directory, True)
        devices = [{"index": i, "uuid": f"GPU-{uuidlib.uuid4()}"} for i in range(count)]
        return cls(Path(directory) / "nvml-state", devices)

    @property
    def count(self) -> int:
        return len(self._devices)

    def uuid(self, index: int) -> str:
        return self._device(index)["uuid"]

    def memory_total(self, index: int) -> int:
        return self._device(index)["memory_total"]

    def claim(self, n: int = 1) -> list[int]:
        """`n` device indices nobody claimed yet (so stacks sharing one emulator get their own GPUs)."""
        with self._lock:
            free = [i for i in sorted(self._devices) if i not in self._claimed][:n]
            if len(free) < n:
                raise ValueError(f"{n} more emulated GPU(s) wanted, {len(self._devices) - len(self._claimed)} free "
                                 f"of {len(self._devices)}")
            self._claimed.update(free)
            return free

    def release(self, indices: list[int]) -> None:
        with self._lock:
            self._claimed.difference_update(indices)

    @contextlib.contextmanager
    def batch(self) -> Iterator[GpuEmulator]:
        """Changes made inside reach the file in one write, at the end."""
        with self._lock:
            self._deferred += 1
        try:
            yield self
        finally:
            with self._lock:
                self._deferred -= 1
                if not self._deferred and self._dirty:
                    self._write_locked()

    def env(self) -> dict[str, str]:
        """Variables that make a new process's nvidia-ml-py see these GPUs."""
        old = os.environ.get("LD_LIBRARY_PATH", "")
        return {
            STATE_ENV: str(self.path),
            "LD_LIBRARY_PATH": str(STUB_DIR) + (os.pathsep + old if old else ""),
        }

    def set(
        self,
        index: int,
        *,
        utilization: float | None = _UNSET,
        power_w: float | None = _UNSET,
        memory_used: int | None = _UNSET,
        pids: list[int] | tuple[int, ...] | None = _UNSET,
        error: str | None = _UNSET,
        fail: dict[str, str] | None = _UNSET,
        delay_ms: int | None = _UNSET,
    ) -> None:
        """Changes what one device reports; arguments left out stay as they are.

        `utilization` is a fraction (0..1). `error` is an NVML error name
        (`GPU_IS_LOST`) that every query of the device then fails with, None to
        clear; `fail` maps single queries (`power`, `processes`, …) to error
        names; `delay_ms` makes every query hang that long.
        """
        with self._lock:
            dev = self._device(index)
            if utilization is not _UNSET:
                dev["utilization"] = _fraction(utilization or 0.0, "utilization")
            if power_w is not _UNSET:
                if power_w is not None and power_w < 0:
                    raise ValueError(f"power must be >= 0 W, not {power_w}")
                dev["power_w"] = dev["idle_w"] if power_w is None else float(power_w)
            if memory_used is not _UNSET:
                used = int(memory_used or 0)
                if not 0 <= used <= dev["memory_total"]:
                    raise ValueError(f"memory used {used} outside 0..{dev['memory_total']}")
                dev["memory_used"] = used
            if pids is not _UNSET:
                dev["pids"] = tuple(int(p) for p in (pids or ()))
            if error is not _UNSET:
                dev["error"] = None if error is None else _text(error, "error")
            if fail is not _UNSET:
                dev["fail"] = {_text(q, "query"): _text(c, "error") for q, c in (fail or {}).items()}
            if delay_ms is not _UNSET:
                dev["delay_ms"] = max(0, int(delay_ms or 0))
            self._write_locked()

    def set_system(self, *, init_error: str | None = _UNSET, count_error: str | None = _UNSET) -> None:
        """Makes NVML itself fail: `nvmlInit` or `nvmlDeviceGetCount` with an
        NVML error name (`DRIVER_NOT_LOADED`, `UNKNOWN`, …); None clears."""
        with self._lock:
            for key, value in (("init_error", init_error), ("count_error", count_error)):
                if value is None:
                    self._system_errors.pop(key, None)
                elif value is not _UNSET:
                    self._system_errors[key] = _text(value, "error")
            self._write_locked()

    def busy(self, index: int, fraction: float) -> None:
        """The device does `fraction` of full work: 0 is idle (0 %, idle power), 1 is ~100 % near the limit."""
        f = _fraction(fraction, "work fraction")
        dev = self._device(index)
        power = dev["idle_w"] + f * (BUSY_POWER_SHARE * dev["power_limit_w"] - dev["idle_w"])
        with self._lock:
            dev["utilization"] = f
            dev["memory_utilization"] = 0.6 * f  # decode is memory-bound: copy engines busy
            dev["power_w"] = power
            self._write_locked()

    def idle(self, index: int) -> None:
        """An idle or wedged device: nothing runs on it."""
        self.busy(index, 0.0)

    def spin(self, index: int) -> None:
        """A collective spinning on a peer that never comes: ~100 % utilization at moderate power."""
        dev = self._device(index)
        with self._lock:
            dev["utilization"] = 1.0
            dev["memory_utilization"] = 0.0
            dev["power_w"] = dev["idle_w"] + SPIN_POWER_SHARE * (dev["power_limit_w"] - dev["idle_w"])
            self._write_locked()

    # ---- the file ---------------------------------------------------------

    def _device(self, index: int) -> _Device:
        try:
            return self._devices[int(index)]
        except KeyError:
            raise ValueError(f"no emulated GPU {index} (have {sorted(self._devices)})") from None

    def _write(self) -> None:
        with self._lock:
            self._write_locked()

    def _write_locked(self) -> None:
        if self._deferred:
            self._dirty = True
            return
        self._dirty = False
        lines = ["# written by testbed/gpu_emulation.py; format in nvml_stub/README.md", f"driver {self._driver}"]
        lines += [f"{key} {code}" for key, code in self._system_errors.items()]
        for index in sorted(self._devices):
            d = self._devices[index]
            lines += [
                "device",
                f"uuid {d['uuid']}",
                f"name {d['name']}",
                f"utilization_gpu {round(d['utilization'] * 100)}",
                f"utilization_memory {round(d['memory_utilization'] * 100)}",
                f"power_mw {round(d['power_w'] * 1000)}",
                f"power_limit_mw {round(d['power_limit_w'] * 1000)}",
                f"memory_total {d['memory_total']}",
                f"memory_used {d['memory_used']}",
            ]
            if d["pids"]:
                lines.append("pids " + " ".join(str(p) for p in d["pids"]))
            if d["error"]:
                lines.append(f"error {d['error']}")
            lines += [f"fail {q} {c}" for q, c in d["fail"].items()]
            if d["delay_ms"]:
                lines.append(f"delay_ms {d['delay_ms']}")
        data = ("\n".join(lines) + "\n").encode()
        # Renamed into place: the stub, reading at any moment, sees a whole file.
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".gpu-state-", dir=self.path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise


def _fraction(value: float, what: str) -> float:
    v = float(value)
    if not 0.0 <= v <= 1.0:
        raise ValueError(f"{what} must be a fraction in [0, 1], not {value}")
    return v


def _text(value: str, what: str) -> str:
    # One value per line in the state file, split on whitespace for single words.
    if not value or "\n" in value or "\r" in value or len(value) > 95:
        raise ValueError(f"{what} must be 1..95 characters on one line, not {value!r}")
    if what in ("uuid", "error", "query", "driver") and any(ch.isspace() for ch in value):
        raise ValueError(f"{what} must not contain whitespace: {value!r}")
    return value
