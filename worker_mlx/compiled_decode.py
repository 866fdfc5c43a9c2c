"""A decode step traced once by `mx.compile` and replayed, instead of rebuilt op by op.

On the CPU a decode step is a hundred small ops, and building and scheduling them costs
more than computing them: 30% of a batch-8 step was Python building the graph and most of
the rest MLX's per-op bookkeeping. Compiled, the graph is reused and its elementwise ops
fuse (batch 1: 3.6 -> 2.5 ms, batch 8 at 300 tokens: 8.9 -> 4.9 ms on the small model).

To be traced once per batch shape rather than every step, the step takes the positions
as arrays: the buffer column to write and each row's left padding. Attention runs over
the first `width` columns, the written ones rounded up to WIDTH_STEP (a retrace every
WIDTH_STEP steps), with the columns past the current one masked.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

DecodeStep = Callable[
    [mx.array, mx.array, mx.array, list[mx.array], list[mx.array], int],
    tuple[mx.array, list[mx.array], list[mx.array]],
]
# Attention width granularity: masked columns past the current one cost attention work
# (at batch 8 and 300 tokens, 256-column steps made a decode step 25% slower than 64).
WIDTH_STEP = 64


class _StepCache:
    """mlx-lm's cache protocol over one layer's decode buffers, written functionally."""

    def __init__(
        self, column: mx.array, left_pad: mx.array, keys: mx.array, values: mx.array, width: int
    ):
        self.column, self.left_pad, self.width = column, left_pad, width
        self.keys, self.values = keys, values
        self.offset = column - left_pad  # each row's RoPE position

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            raise NotImplementedError("sliding-window attention is not supported")
        cols = mx.arange(self.width)
        visible = (cols[None, :] >= self.left_pad[:, None]) & (cols[None, :] <= self.column)
        return visible[:, None, None, :]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = mx.slice_update(self.keys, keys, self.column, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.column, axes=(2,))
        return self.keys[:, :, : self.width], self.values[:, :, : self.width]


def make_decode_step(model: nn.Module) -> DecodeStep:
    """step(tokens (B, 1), column (1,), left_pad (B,), keys, values, width) -> (logits
    (B, V), keys, values), the buffers with the new column written (in place: MLX donates
    them). `width` (a multiple of WIDTH_STEP past the column) is part of the trace."""

    def step(tokens, column, left_pad, keys, values, width):
        caches = [_StepCache(column, left_pad, k, v, width) for k, v in zip(keys, values)]
        logits = model(tokens, cache=caches)[:, -1, :]
        return logits, [c.keys for c in caches], [c.values for c in caches]

    return mx.compile(step)
