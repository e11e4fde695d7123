"""When the overtaken evidence against a leg was complete, from the legs' own stages.

Contract section 5b's overtaken, read back from what `/api/v1/requests/{trace_id}`
answers for every request of a run: the sidecar names a leg overtaken at a
judge tick, some time after the engines' stage spans made the evidence
whole. The live tests and `bench/time_to_page.py` measure that delay
against this moment.
"""

from __future__ import annotations

from typing import Any

from pdwatch import contract as c

# A leg as /api/v1/requests/{trace_id} lists it (JSON).
LegView = dict[str, Any]


def evidence_at(leg: LegView, legs: list[LegView], *, k: int = c.DEFAULT_OVERTAKEN_K,
                m: float = c.DEFAULT_OVERTAKEN_M, interval_s: float) -> float | None:
    """The first moment (wall clock) at which at least k legs of `leg`'s role and instance that entered its
    stage after it, with at least its prompt tokens (and in bootstrap its peer), had left that stage, and
    it had waited past max(2 intervals, m x the longest of the k quickest of them). `leg` is an open leg
    (its `stage` and `stage_since_unix_s`); None if never, as far as these legs' stages tell."""
    since, size, stage = leg["stage_since_unix_s"], leg["prompt_tokens"], leg["stage"]
    passes = sorted(
        (st["end_unix_s"], st["duration_s"]) for other in legs
        if other["role"] == leg["role"] and other["pd_instance"] == leg["pd_instance"]
        and (other["prompt_tokens"] or -1) >= size and (stage != "bootstrap" or other["peer"] == leg["peer"])
        for st in other["stages"]
        if st["stage"] == stage and st["start_unix_s"] > since and st["end_unix_s"] and not st["error"])
    # Each pass may shorten the rule (the k quickest get quicker): the earliest moment over all of them.
    quickest: list[float] = []
    best: float | None = None
    for end, duration in passes:
        quickest = sorted([*quickest, duration])
        if len(quickest) >= k:
            at = max(end, since + max(c.OVERTAKEN_INTERVALS * interval_s, m * quickest[k - 1]))
            best = at if best is None else min(best, at)
    return best
