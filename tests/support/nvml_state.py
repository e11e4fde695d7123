"""Reads the NVML stub's state file back, independently of the emulator that wrote it."""

from __future__ import annotations

from pathlib import Path


def state_devices(path: Path) -> list[dict]:
    """One dict of the raw `key value` lines per `device` block, in file order."""
    out: list[dict] = []
    for line in Path(path).read_text().splitlines():
        if line == "device":
            out.append({})
        elif out and " " in line:
            key, value = line.split(" ", 1)
            out[-1][key] = value
    return out
