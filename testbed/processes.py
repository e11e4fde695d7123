"""One engine OS process: spawn, wait until ready, stop or kill, never orphan.

Each engine runs in its own process group (so a kill reaches anything it
started) and holds a pipe to us on stdin (so it exits if we die without
stopping it). Its stderr is kept in a bounded ring for error messages.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

# The checkout this testbed runs from, or None when it runs from an installed wheel (then the
# engines import pdwatch from site-packages like everything else).
_TOP = Path(__file__).resolve().parent.parent
CHECKOUT = _TOP if (_TOP / "pyproject.toml").is_file() else None
LOG_LINES = 400


class EngineStartError(RuntimeError):
    pass


def free_port() -> int:
    """A loopback port free right now (the engine binds it with SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineProcess:
    def __init__(self, instance: str, role: str, args: list[str], env: dict[str, str]):
        self.instance = instance
        self.role = role
        self.args = list(args)
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}
        self.log: deque[str] = deque(maxlen=LOG_LINES)
        self._ready = threading.Event()

    def command(self) -> list[str]:
        return [sys.executable, "-m", "pdwatch.testbed.engine", "--role", self.role, "--instance", self.instance, *self.args]

    def python_path(self) -> list[str]:
        return [str(CHECKOUT)] if CHECKOUT is not None else []

    def ready_info(self, line: str) -> dict | None:
        """The process's ready message, if this output line is one (a JSON line with "ready")."""
        if not line.startswith("{"):
            return None
        try:
            msg = json.loads(line)
        except ValueError:
            return None
        return msg if isinstance(msg, dict) and msg.get("ready") else None

    def spawn(self) -> None:
        env = dict(os.environ)
        env.update(self.env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (*self.python_path(), env.get("PYTHONPATH", "")) if p)
        self._ready.clear()
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

    def _read_stdout(self, proc: subprocess.Popen) -> None:
        self._read(proc, proc.stdout)

    def _read_stderr(self, proc: subprocess.Popen) -> None:
        self._read(proc, proc.stderr)

    def _read(self, proc: subprocess.Popen, stream) -> None:
        for raw in stream:
            line = raw.decode(errors="replace").rstrip()
            info = self.ready_info(line)
            if info is not None and proc is self.proc:
                self.info = info
                self._ready.set()
                if line.startswith("{"):
                    continue  # the engine's own ready message, not a log line
            self.log.append(line)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout_s: float, cancel: threading.Event | None = None) -> dict:
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.05):
            if cancel is not None and cancel.is_set():
                raise EngineStartError(f"{self.instance}: the stack stopped before it was ready")
            if self.proc is None or self.proc.poll() is not None:
                rc = self.proc.returncode if self.proc else None
                time.sleep(0.1)  # let the reader threads catch the last lines
                raise EngineStartError(f"{self.instance} exited with status {rc} before it was ready:\n"
                                       + self.tail())
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
