"""The engine side's own health, per instance (contract v1.2): what its recorder lost and how much of the
engine its plugin sees, folded over the instance's current ranks for the judge's instance view."""

from __future__ import annotations

from collections.abc import Iterable

from pdwatch import contract as c

from .model import Incarnation

# Least observed last: an instance reads as its least-observed rank.
_ORDER = {state: i for i, state in enumerate(c.PLUGIN_STATES)}


def recorder_totals(ranks: Iterable[Incarnation]) -> dict[str, int]:
    """pd.recorder.* summed over the ranks: a restarted rank starts again from 0, which a Prometheus
    counter reads as a reset."""
    totals = dict.fromkeys(c.H_RECORDER_HEALTH, 0)
    for inc in ranks:
        for name, value in inc.recorder.items():
            totals[name] += value
    return totals


def plugin_state(ranks: Iterable[Incarnation]) -> tuple[str, tuple[str, ...]]:
    """The least-observed state any rank says (c.PLUGIN_UNKNOWN when none says), and every refusal once."""
    states, refused = [], {}
    for inc in ranks:
        if inc.plugin_state:
            states.append(inc.plugin_state)
        refused.update(dict.fromkeys(inc.plugin_refused))
    state = max(states, key=_ORDER.__getitem__) if states else c.PLUGIN_UNKNOWN
    return state, tuple(refused)
