"""Repetition loops: an answer whose tail repeats one short stretch of tokens over and over.

Greedy decoding of a long answer (a thinking trace, a list) can fall into such a loop and then runs to
the token cap; a draft trained on it learns to predict the loop, which the target at its serving
temperature rarely produces. 01c counts them per source (stats.json `repetition_loops`), so the pilot
shows how often the generation temperature makes them (train_plan_v4.md step 2, docs/design.md section 12).
"""
from __future__ import annotations

MIN_TAIL = 64      # tokens of the tail that must be periodic
MIN_REPEATS = 3    # the period must fit this many times into the periodic tail
MAX_PERIOD = 64    # longest repeated stretch (tokens) looked for


def loop_period(ids: list[int], min_tail: int = MIN_TAIL, max_period: int = MAX_PERIOD) -> int:
    """The shortest period p <= max_period such that the last max(min_tail, MIN_REPEATS * p) tokens repeat
    with period p (ids[i] == ids[i - p] all along that tail), or 0 when there is none. List slices compare
    in C: a few microseconds per answer."""
    for p in range(1, max_period + 1):
        w = max(min_tail, MIN_REPEATS * p)
        if len(ids) < w + p:
            return 0
        if ids[-w:] == ids[-w - p:-p]:
            return p
    return 0
