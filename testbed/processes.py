"""One engine OS process: spawn, wait until ready, stop or kill, never orphan.

Each engine runs in its own process group (so a kill reaches anything it
started) and holds a pipe to us on stdin (so it exits if we die without
stopping it). Its stderr is kept in a bounded ring for error messages.
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import IO, cast

from .engine import Ready

# The checkout this testbed runs from, or None when it runs from an installed wheel (then the
# engines import pdwatch from site-packages like everything else).
_TOP = Path(__file__).resolve().parent.parent
CHECKOUT = _TOP if (_TOP / "pyproject.toml").is_file() else None
LOG_LINES = 400


class EngineStartError(RuntimeError):
    pass


class PortInUse(EngineStartError):
    """The engine could not bind one of its ports; a retry on fresh ports may succeed."""


# What uvicorn, ZMQ and torch's store print when a port is taken; such a server does not
# exit (uvicorn waits on its lifespan), so the wait must notice the line itself.
_PORT_TAKEN = ("address already in use",)


# Listening ports come from below the kernel's ephemeral range: every outgoing connection
# (UCX over TCP, HTTP clients, the router) takes its source port from that range, so a
# port picked there can be taken between the pick and the engine's bind. Below it only
# other listeners compete, and the bind test sees those.
_LOW_PORT = 20000
_handed_out: set[int] = set()
_port_lock = threading.Lock()
_port_rng = random.Random()


@functools.cache
def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port free right now, outside the ephemeral range, not handed out before."""
    high = max(_ephemeral_low(), _LOW_PORT + 1000)
    with _port_lock:
        if len(_handed_out) > (high - _LOW_PORT) // 2:
            _handed_out.clear()  # a long run cycles; the bind test still guards each pick
        for _ in range(200):
            port = _port_rng.randrange(_LOW_PORT, high)
            if port in _handed_out:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a crowded range: let the kernel pick
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EngineProcess:
    def __init__(self, instance: str, role: str, args: list[str], env: dict[str, str]):
        self.instance = instance
        self.role = role
        self.args = list(args)
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: Ready = {}
        self.log: deque[str] = deque(maxlen=LOG_LINES)
        self._ready = threading.Event()
        self._port_taken = threading.Event()

    def command(self) -> list[str]:
        return [sys.executable, "-m", "pdwatch.testbed.engine", "--role", self.role, "--instance", self.instance, *self.args]

    def python_path(self) -> list[str]:
        return [str(CHECKOUT)] if CHECKOUT is not None else []

    def ready_info(self, line: str) -> Ready | None:
        """The process's ready message, if this output line is one (a JSON line with "ready")."""
        if not line.startswith("{"):
            return None
        try:
            msg = json.loads(line)
        except ValueError:
            return None
        return cast(Ready, msg) if isinstance(msg, dict) and msg.get("ready") else None

    def spawn(self) -> None:
        env = dict(os.environ)
        env.update(self.env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (*self.python_path(), env.get("PYTHONPATH", "")) if p)
        self._ready.clear()
        self._port_taken.clear()
        self.info = {}
        self.proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=env, cwd=str(CHECKOUT) if CHECKOUT is not None else None, start_new_session=True,
        )
        threading.Thread(target=self._read_stdout, args=(self.proc,), name=f"{self.instance}-stdout",
                         daemon=True).start()
        threading.Thread(target=self._read_stderr, args=(self.proc,), name=f"{self.instance}-stderr",
                         daemon=True).start()

    def _read_stdout(self, proc: subprocess.Popen[bytes]) -> None:
        self._read(proc, proc.stdout)

    def _read_stderr(self, proc: subprocess.Popen[bytes]) -> None:
        self._read(proc, proc.stderr)

    def _read(self, proc: subprocess.Popen[bytes], stream: IO[bytes] | None) -> None:
        for raw in stream or ():
            line = raw.decode(errors="replace").rstrip()
            info = self.ready_info(line)
            if info is not None and proc is self.proc:
                self.info = info
                self._ready.set()
                if line.startswith("{"):
                    continue  # the engine's own ready message, not a log line
            if proc is self.proc and any(m in line.lower() for m in _PORT_TAKEN):
                self._port_taken.set()
            self.log.append(line)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def live_pid(self) -> int | None:
        """The PID while the process runs, else None."""
        return self.pid if self.alive() else None

    def wait_ready(self, timeout_s: float, cancel: threading.Event | None = None) -> Ready:
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.05):
            if cancel is not None and cancel.is_set():
                raise EngineStartError(f"{self.instance}: the stack stopped before it was ready")
            if self.proc is None or self.proc.poll() is not None:
                rc = self.proc.returncode if self.proc else None
                time.sleep(0.1)  # let the reader threads catch the last lines
                raise EngineStartError(f"{self.instance} exited with status {rc} before it was ready:\n"
                                       + self.tail())
            if self._port_taken.is_set():
                raise PortInUse(f"{self.instance} could not bind a port:\n" + self.tail())
            if time.monotonic() > deadline:
                raise EngineStartError(f"{self.instance} not ready after {timeout_s:.0f} s:\n" + self.tail())
        return self.info

    def tail(self, n: int = 20) -> str:
        return "\n".join(list(self.log)[-n:]) or "(no output)"

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self, wait_s: float = 5.0) -> None:
        """SIGKILL the whole group and reap it."""
        if self.proc is None:
            return
        self.signal(signal.SIGKILL)
        try:
            self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            pass
        self._close_pipes()

    def begin_stop(self) -> None:
        """Ask for a clean exit: the engine flushes its recorder, then exits."""
        self.signal(signal.SIGCONT)  # a frozen engine could not act on SIGTERM
        self.signal(signal.SIGTERM)

    def finish_stop(self, deadline: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        # Whatever is left in the group (the engine or anything it started) goes now.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(2.0)
        except subprocess.TimeoutExpired:
            pass
        self._close_pipes()

    def _close_pipes(self) -> None:
        if self.proc is not None and self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
