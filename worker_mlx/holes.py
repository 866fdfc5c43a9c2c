"""Speculation's holes in the decode buffer: the columns of rejected drafts.

A speculative verify step writes S columns of every row; the columns of a row's rejected
drafts hold no token. They become holes, masked out and skipped by RoPE positions, so
rows that accepted different numbers of drafts keep sharing the write column. Only
speculation makes holes (`reject`); the buffer hands `marks` and `gaps` to every step
(all clear without speculation) and moves them with its columns. Holes go away with the
next rebuild of the buffer (which `too_holey` asks for, and a row's admission waits for).
"""

from __future__ import annotations

import mlx.core as mx


class Holes:
    def __init__(self, rows: int, capacity: int, skips: list[int] = ()):
        self.marks = mx.zeros((rows, capacity), dtype=mx.bool_)  # (B, capacity)
        # positions per row RoPE skips: its holes, plus what its prompt skips (a vision
        # model's images take fewer M-RoPE positions than tokens: vision_pass.rope_skip)
        self.gaps = mx.array(list(skips) or [0] * rows, dtype=mx.int32)
        self.counts = [0] * rows
        self.columns = 0  # the most holes any row has

    def reject(self, rejected: list[int], end: int) -> None:
        """The last `rejected[row]` columns before `end` of each row hold no token."""
        if not any(rejected):
            return
        n = mx.array(rejected, dtype=mx.int32)
        cols = mx.arange(self.marks.shape[1])
        self.marks = self.marks | ((cols >= end - n[:, None]) & (cols < end))
        self.gaps = self.gaps + n
        self.counts = [a + b for a, b in zip(self.counts, rejected)]
        self.columns = max(self.counts)

    def seat(self, rows: list[int], skips: list[int]) -> None:
        """Rows taken over by joining requests (the buffer has no holes then) skip theirs."""
        if rows:
            self.gaps[mx.array(rows)] = mx.array(skips, dtype=mx.int32)

    def too_many(self, attended: int) -> bool:
        """Whether holes are a fifth of the `attended` columns: a rebuild is cheaper."""
        return 5 * self.columns > attended

    def recolumn(self, start: int, width: int, cap: int) -> None:
        pad = mx.zeros((self.marks.shape[0], cap - width), dtype=mx.bool_)
        self.marks = mx.concatenate([self.marks[:, start : start + width], pad], axis=1)
