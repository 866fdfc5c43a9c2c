"""What a verify step costs against a plain decode step, from the worker's own timings.

A decode step in which any row drafts is a verify step for every row: S = K + 1 columns
each. Where a step is bound by reading the weights (a Mac; a wide model on a CPU at small
batches) S columns cost little more than one, and any row's drafts pay. Where it is bound
by compute (a CPU at larger batches, or a narrow model) they cost up to S times one, and
a few drafting rows would slow every other row of the batch. So the drafts go out only
when the tokens they are expected to add pay for the verify step's time over a plain
step's, both as this machine measures them: a running mean of the worker's
`StepResult.step_seconds` per (batch rows, columns per row), the median of its last
steps.

A plain step's cost is learnt first, a verify step's by drafting until it is known, and
a refused verify step is measured again after `RETRY_AFTER` refusals in a row (then
after twice as many, up to `MAX_RETRY_AFTER`), so that slow measurements cannot switch
drafting off for good.
"""

from __future__ import annotations

import statistics
from collections import deque

SAMPLES = 16  # a shape's cost: the median of its last this many steps
MIN_SAMPLES = 3  # steps of a shape measured before its cost is trusted
RETRY_AFTER = 32  # refusals in a row after which a verify step is measured again,
MAX_RETRY_AFTER = 512  # twice as many after each retry that still loses, up to this


class StepCost:
    def __init__(self):
        self.samples: dict[tuple[int, int], deque[float]] = {}
        self.seen: set[tuple[int, int]] = set()  # shapes whose first (warm-up) step passed
        self.refused: dict[tuple[int, int], int] = {}  # refusals in a row, per shape
        self.retry_after: dict[tuple[int, int], int] = {}  # refusals before the next retry
        self.measured = False  # whether the worker reports its steps' seconds at all

    def record(self, rows: int, columns: int, seconds: float | None) -> None:
        """A decode step of `rows` rows and `columns` columns each took `seconds` in the
        worker (None: not measured). A shape's first step is not counted: it may hold
        first-call costs that no later step has."""
        if seconds is None:
            return
        self.measured = True
        key = (rows, columns)
        if key not in self.seen:
            self.seen.add(key)
            return
        self.samples.setdefault(key, deque(maxlen=SAMPLES)).append(seconds)

    def seconds(self, rows: int, columns: int) -> float | None:
        """A step's usual seconds (the median: a step that also admitted rows or released
        requests is slower), once MIN_SAMPLES were measured."""
        got = self.samples.get((rows, columns))
        return statistics.median(got) if got and len(got) >= MIN_SAMPLES else None

    def pays(self, rows: int, columns: int, expected_tokens: float) -> bool:
        """Whether a verify step of `columns` per row over `rows` rows, expected to make
        `expected_tokens` tokens, makes them at least as fast as a plain step would.
        A plain step's cost is learnt first (by not drafting for those few steps), a
        verify step's by drafting."""
        if not self.measured:  # a worker without timings: no grounds to refuse
            return True
        plain = self.seconds(rows, 1)
        if plain is None:
            return False
        key = (rows, columns)
        verify = self.seconds(rows, columns)
        if verify is None or expected_tokens * plain >= rows * verify:
            self.refused.pop(key, None)
            self.retry_after.pop(key, None)
            return True
        self.refused[key] = self.refused.get(key, 0) + 1
        wait = self.retry_after.get(key, RETRY_AFTER)
        if self.refused[key] < wait:
            return False
        self.refused.pop(key)  # measure it again, and wait twice as long if it still loses
        self.retry_after[key] = min(2 * wait, MAX_RETRY_AFTER)
        return True
