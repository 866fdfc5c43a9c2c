"""A decode step traced once by `mx.compile` and replayed, instead of rebuilt op by op.

On the CPU a decode step is a hundred small ops, and building and scheduling them costs
more than computing them: 30% of a batch-8 step was Python building the graph and most of
the rest MLX's per-op bookkeeping. Compiled, the graph is reused and its elementwise ops
fuse (batch 1: 3.6 -> 2.5 ms, batch 8 at 300 tokens: 8.9 -> 4.9 ms on the small model).

To be traced once per batch shape rather than every step, the step takes the positions
as arrays: the buffer column to write and each row's left padding. Attention runs over
the first `width` columns, the written ones rounded up (`attention_width`), with the
columns past the current one masked. Traces are bounded (MAX_TRACES).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

# Attention width granularity: masked columns past the current one cost attention work
# (at batch 8 and 300 tokens, 256-column steps made a decode step 25% slower than 64).
# Past 512 columns the step is an eighth of the capacity, so a buffer has at most eight
# widths, each a trace.
WIDTH_STEP = 64
# Each trace keeps about 0.6 MiB (small model); a long-running server meets batch sizes x
# capacities x widths of them, so past this many the step is compiled afresh.
MAX_TRACES = 128


def attention_width(column: int, capacity: int) -> int:
    """The columns a step that writes `column` attends over (a multiple of the step)."""
    step = max(WIDTH_STEP, capacity // 8)
    return min(capacity, (column + step) // step * step)


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


class DecodeStep:
    """step(tokens (B, 1), column (1,), left_pad (B,), keys, values, width) -> (logits
    (B, V), keys, values), the buffers with the new column written (in place: MLX donates
    them). `width` (from `attention_width`) is part of the trace."""

    def __init__(self, model: nn.Module, max_traces: int = MAX_TRACES):
        self.model = model
        self.max_traces = max_traces
        self.shapes: set[tuple[int, int, int]] = set()
        self.compiled = 0  # times the step was compiled afresh
        self._step = self._compile()

    def _compile(self):
        self.shapes.clear()
        self.compiled += 1
        model = self.model

        def step(tokens, column, left_pad, keys, values, width):
            caches = [_StepCache(column, left_pad, k, v, width) for k, v in zip(keys, values)]
            logits = model(tokens, cache=caches)[:, -1, :]
            return logits, [c.keys for c in caches], [c.values for c in caches]

        return mx.compile(step)

    def __call__(
        self,
        tokens: mx.array,
        column: mx.array,
        left_pad: mx.array,
        keys: list[mx.array],
        values: list[mx.array],
        width: int,
    ) -> tuple[mx.array, list[mx.array], list[mx.array]]:
        shape = (tokens.shape[0], keys[0].shape[2], width)
        if shape not in self.shapes:
            if len(self.shapes) >= self.max_traces:
                self._step = self._compile()  # the old function and its traces are freed
            self.shapes.add(shape)
        return self._step(tokens, column, left_pad, keys, values, width)
