"""Which PD instance owns which GPU.

A device is joined to an instance, in this order of trust:
1. by UUID: the instance's heartbeats list it in `pd.gpu.uuids`;
2. by PID: one of NVML's compute processes on the device is an instance's
   `process.pid` (true when the sidecar and the engine share a PID namespace);
3. by configuration: `PDWATCH_GPU_MAP`, keyed by device index or UUID;
otherwise it stays unclaimed and its metrics carry empty owner labels.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdwatch.contract import ROLES

from .sampler import DeviceSample

DEFAULT_CLUSTER = "default"


@dataclass(frozen=True)
class Owner:
    cluster: str
    role: str
    pd_instance: str


@dataclass(frozen=True)
class InstanceClaim:
    """What one live engine process says about itself (from its heartbeats)."""

    owner: Owner
    gpu_uuids: tuple[str, ...]
    pids: tuple[int, ...]


def normalize_uuid(uuid: str) -> str:
    """'GPU-AbC…' and 'abc…' (torch prints UUIDs without the prefix) compare equal."""
    u = uuid.strip().lower()
    return u[4:] if u.startswith("gpu-") else u


def parse_gpu_map(text: str) -> dict[str, Owner]:
    """Parses `PDWATCH_GPU_MAP`: comma-separated `DEVICE=[CLUSTER/]ROLE/INSTANCE`.

    DEVICE is an NVML index (`0`) or a UUID (`GPU-…`); CLUSTER defaults to
    `default`. Example: `0=decode/decode-0,GPU-8f2e…=prod/prefill/prefill-0`.
    Keys come back as the index in decimal or the UUID as written.
    """
    out: dict[str, Owner] = {}
    seen: set[str] = set()
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        key, sep, value = entry.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise ValueError(f"GPU map entry {entry!r}: expected DEVICE=[CLUSTER/]ROLE/INSTANCE")
        if key.isdigit():
            key = str(int(key))
            ident = "index:" + key
        elif key.lower().startswith("gpu-") and len(key) > 4:
            ident = "uuid:" + normalize_uuid(key)
        else:
            raise ValueError(f"GPU map entry {entry!r}: device must be an index (0) or a UUID (GPU-…), not {key!r}")
        if ident in seen:
            raise ValueError(f"GPU map names device {key!r} twice")
        seen.add(ident)
        parts = [p.strip() for p in value.split("/")]
        if len(parts) == 2:
            parts.insert(0, DEFAULT_CLUSTER)
        if len(parts) != 3 or not all(parts):
            raise ValueError(f"GPU map entry {entry!r}: owner must be [CLUSTER/]ROLE/INSTANCE, not {value!r}")
        cluster, role, instance = parts
        if role not in ROLES:
            raise ValueError(f"GPU map entry {entry!r}: role must be one of {', '.join(ROLES)}, not {role!r}")
        out[key] = Owner(cluster, role, instance)
    return out


def join(
    devices: Iterable[DeviceSample],
    claims: Sequence[InstanceClaim],
    configured: dict[str, Owner],
) -> list[tuple[DeviceSample, Owner | None, str]]:
    """Each device with its owner and how it was found: "uuid", "pid", "config" or "none".

    When two claims name the same device the first wins, so the caller orders
    claims by preference (e.g. freshest heartbeat first).
    """
    by_uuid: dict[str, Owner] = {}
    by_pid: dict[int, Owner] = {}
    for claim in claims:
        for u in claim.gpu_uuids:
            if u:
                by_uuid.setdefault(normalize_uuid(u), claim.owner)
        for pid in claim.pids:
            by_pid.setdefault(int(pid), claim.owner)
    conf_index = {k: o for k, o in configured.items() if k.isdigit()}
    conf_uuid = {normalize_uuid(k): o for k, o in configured.items() if not k.isdigit()}

    out: list[tuple[DeviceSample, Owner | None, str]] = []
    for dev in devices:
        key = normalize_uuid(dev.uuid) if dev.uuid else ""
        if key and key in by_uuid:
            out.append((dev, by_uuid[key], "uuid"))
            continue
        owner = next((by_pid[p] for p in dev.pids if p in by_pid), None)
        if owner is not None:
            out.append((dev, owner, "pid"))
            continue
        owner = (conf_uuid.get(key) if key else None) or conf_index.get(str(dev.index))
        if owner is not None:
            out.append((dev, owner, "config"))
            continue
        out.append((dev, None, "none"))
    return out


class OwnerMemory:
    """`join`, remembering each device's last owner.

    A GPU that fell off the bus lists no processes, so a PID join would lose it
    exactly when its owner matters most: a failing device keeps the owner it
    had when last joined (marked `*_last_known`). Bounded by the devices seen.
    """

    def __init__(self, configured: dict[str, Owner]):
        self.configured = dict(configured)
        self._last: dict[int, tuple[str, Owner, str]] = {}

    def join(self, devices: Sequence[DeviceSample], claims: Sequence[InstanceClaim]
             ) -> list[tuple[DeviceSample, Owner | None, str]]:
        out = []
        for dev, owner, how in join(devices, claims, self.configured):
            last = self._last.get(dev.index)
            if owner is not None:
                self._last[dev.index] = (dev.uuid, owner, how)
            elif dev.failures and last is not None and last[0] == dev.uuid:
                owner, how = last[1], last[2] + "_last_known"
            out.append((dev, owner, how))
        for index in self._last.keys() - {d.index for d in devices}:
            del self._last[index]
        return out
