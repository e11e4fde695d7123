"""The judge's own tables: what it has concluded, kept apart from the tracker's facts.

Only the judge writes these, on its tick; what readers see of them is copied
into the `Evaluation`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .model import Incarnation, Leg


@dataclass(slots=True, eq=False)
class LegVerdict:
    """The judge's standing verdict on one open leg; kept only for legs it has something on."""

    leg: Leg  # the leg it is about: a key reused by a new leg starts over
    entries: int  # leg.entries when this stage's verdict began; another entry starts it over
    stage: str | None = None
    # Stuck on evidence (contract section 5b): why, and in which stage; sticks until the stage changes.
    evidence: str | None = None
    evidence_why: str = ""  # the evidence in words, with its figures
    stuck_at_ns: int | None = None  # sidecar clock, while stuck
    ever_stuck: bool = False  # counted in pdwatch_stuck_detected_total and sent as pd.stuck once a leg


@dataclass(slots=True, frozen=True)
class GonePeer:
    """A peer id (KV agent name, bootstrap address) of a process that has ended."""

    ended_ns: int  # sidecar clock: when its restart was seen, or it was found down
    instance: str
    incarnation: str


class GonePeers:
    """Peer ids of ended incarnations, bounded: the oldest is forgotten first."""

    def __init__(self, limit: int = 4096):
        self.limit = limit
        self._by_id: OrderedDict[tuple[str, str], GonePeer] = OrderedDict()  # (cluster, peer id) -> end

    def add(self, cluster: str, inc: Incarnation, instance: str, ended_ns: int) -> None:
        for peer in inc.peer_ids:
            key = (cluster, peer)
            old = self._by_id.get(key)
            if old is not None and old.incarnation == inc.id and old.ended_ns <= ended_ns:
                continue  # the earliest sighting of this end stands
            self._by_id[key] = GonePeer(ended_ns, instance, inc.id)
            self._by_id.move_to_end(key)
        while len(self._by_id) > self.limit:
            self._by_id.popitem(last=False)

    def revive(self, cluster: str, inc: Incarnation) -> None:
        """A process found down heartbeats again: its ids name a live peer once more."""
        for peer in inc.peer_ids:
            gone = self._by_id.get((cluster, peer))
            if gone is not None and gone.incarnation == inc.id:
                del self._by_id[(cluster, peer)]

    def get(self, cluster: str, peer: str) -> GonePeer | None:
        return self._by_id.get((cluster, peer))

    def forget_cluster(self, cluster: str) -> None:
        for key in [k for k in self._by_id if k[0] == cluster]:
            del self._by_id[key]

    def __len__(self) -> int:
        return len(self._by_id)
