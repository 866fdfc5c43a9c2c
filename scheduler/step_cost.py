"""What a verify step costs against a plain decode step, from the worker's own timings.

A decode step in which any row drafts is a verify step for every row: S = K + 1 columns
each. Where a step is bound by reading the weights (a Mac; a wide model on a CPU at small
batches) S columns cost little more than one, and any row's drafts pay. Where it is bound
by compute (a CPU at larger batches, or a narrow model) they cost up to S times one, and
a few drafting rows would slow every other row of the batch. So the drafts go out only
when the tokens they are expected to add pay for the verify step's time over a plain
step's, both as this machine measures them: a running mean of the worker's
`StepResult.step_seconds` per (batch rows, columns per row).

Until both are known the drafts go out (that is how a verify step's cost is learnt), and
a refused verify step is tried again after `RETRY_AFTER` refusals in a row, so that one
slow measurement cannot switch drafting off for good.
"""

from __future__ import annotations

ALPHA = 0.2  # weight of a new measurement in the running mean
RETRY_AFTER = 32  # refusals in a row after which a verify step is measured again


class StepCost:
    def __init__(self):
        self.seconds: dict[tuple[int, int], float] = {}
        self.seen: set[tuple[int, int]] = set()  # shapes whose first (warm-up) step passed
        self.refused: dict[tuple[int, int], int] = {}

    def record(self, rows: int, columns: int, seconds: float | None) -> None:
        """A decode step of `rows` rows and `columns` columns each took `seconds` in the
        worker (None: not measured). A shape's first step is not counted: it may hold
        first-call costs that no later step has."""
        key = (rows, columns)
        if seconds is None:
            return
        if key not in self.seen:
            self.seen.add(key)
            return
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else old + ALPHA * (seconds - old)

    def pays(self, rows: int, columns: int, expected_tokens: float) -> bool:
        """Whether a verify step of `columns` per row over `rows` rows, expected to make
        `expected_tokens` tokens, makes them at least as fast as a plain step would."""
        key = (rows, columns)
        plain, verify = self.seconds.get((rows, 1)), self.seconds.get(key)
        if plain is None or verify is None or expected_tokens * plain >= rows * verify:
            self.refused.pop(key, None)
            return True
        self.refused[key] = self.refused.get(key, 0) + 1
        if self.refused[key] >= RETRY_AFTER:
            self.refused.pop(key)
            return True
        return False
