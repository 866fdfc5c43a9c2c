"""One decode step of the whole decode buffer, as a function of arrays.

The step takes the positions as arrays (the buffer column to write, each row's left
padding) and returns the buffers with that column written, so the same code runs eagerly
or traced once per batch shape by `mx.compile` and replayed. Whether to compile is the
device backend's decision (`worker_mlx/backends`). On the CPU a decode step is a hundred
small ops whose graph building and bookkeeping cost more than their compute; compiled,
the graph is reused and its elementwise ops fuse (batch 1: 3.6 -> 2.5 ms, batch 8 at 300
tokens: 8.9 -> 4.9 ms on the small model).

Compiled, attention runs over the first `attention_width` columns, the written ones
rounded up, with the columns past the current one masked, so a trace serves many steps;
eager, over exactly the written columns. Traces are bounded (MAX_TRACES).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from worker_mlx.kv_pool import KVLayout
from worker_mlx.layer_caches import StateCache, StepCache, StepColumns
from worker_mlx.lora import NO_LORA, LoraBank, NoLora

# Attention width granularity: masked columns past the current one cost attention work
# (at batch 8 and 300 tokens, 256-column steps made a decode step 25% slower than 64).
# Past 512 columns the step is an eighth of the capacity, so a buffer has at most eight
# widths, each a trace.
WIDTH_STEP = 64
# Each trace keeps about 0.6 MiB (small model); a long-running server meets batch sizes x
# capacities x widths of them, so past this many the step is compiled afresh.
MAX_TRACES = 128


def attention_width(column: int, capacity: int, queries: int = 1) -> tuple[int, int]:
    """(width, lowest): a compiled step that writes `queries` columns from `column` attends
    over the first `width` columns (a multiple of the step), and serves every first
    column from `lowest` on."""
    step = max(WIDTH_STEP, capacity // 8)
    last = column + queries - 1
    width = min(capacity, (last + step) // step * step)
    return width, max(0, width - step - queries + 1)


class DecodeStep:
    """step(tokens (B, S), column, left_pad (B,), keys, values, states, parts, holes, gaps)
    -> (logits (B, V), or (B, S, V) when S > 1, keys, values, states, parts): the
    per-layer buffers with columns `column`.. written (in place: MLX donates them), the
    recurrent layers' states (B rows each) after the step, and for a quantized pool the
    per-layer stored parts with the columns written. S > 1 is a speculative verify step;
    `holes` (B, capacity) are columns without a token and `gaps` (B,) their count per row,
    which RoPE positions skip."""

    def __init__(
        self, model: nn.Module, compile: bool, layout: KVLayout, max_traces: int = MAX_TRACES,
        lora: LoraBank | NoLora = NO_LORA,
    ):  # fmt: skip
        self.model = model
        self.lora = lora  # the rows' adapters: the runner's bank, bound in the traced step
        self.layout = layout
        self.windows = layout.windows or (None,) * layout.num_layers
        self.compiles = compile
        self.max_traces = max_traces
        self.shapes: set[tuple] = set()
        self.compiled = 0  # times the step was compiled afresh
        self._step = self._compile() if compile else self._function()

    def _function(self):
        model, windows, layout, lora = self.model, self.windows, self.layout, self.lora
        codec = layout.codec

        def step(
            tokens, column, left_pad, keys, values, states, parts, width, lowest, holes, gaps,
            adapters,
        ):  # fmt: skip
            S = tokens.shape[1]
            columns = StepColumns(column, left_pad, width, lowest, holes, S)
            offset = column - left_pad - gaps  # each row's RoPE position
            layer_parts = parts or [()] * len(keys)
            kv = [
                StepCache(offset, columns, k, v, w, codec, p)
                for k, v, w, p in zip(keys, values, windows, layer_parts)
            ]
            recurrent = [StateCache(len(s), s, None) for s in states]
            caches = layout.in_model_order(kv, recurrent) if recurrent else kv
            with lora.bound(adapters):  # an argument: a compiled graph's captures are constants
                logits = model(tokens, cache=caches)
            logits = logits[:, -1, :] if S == 1 else logits
            new_states = [c.state for c in recurrent]
            new_parts = [c.parts for c in kv] if parts else []
            return logits, [c.keys for c in kv], [c.values for c in kv], new_states, new_parts

        return step

    def retrace(self) -> None:
        """After the model's adapters changed (LoraBank.load / unload): a compiled step
        traced before holds their old stacks as constants."""
        if self.compiles:
            self._step = self._compile()

    def _compile(self):
        self.shapes.clear()
        self.compiled += 1
        return mx.compile(self._function())

    def __call__(
        self,
        tokens: mx.array,
        column: int,
        left_pad: mx.array,
        keys: list[mx.array],
        values: list[mx.array],
        states: list[list[mx.array]] = (),
        parts: list[list[mx.array]] = (),
        holes: mx.array | None = None,
        gaps: mx.array | None = None,
    ) -> tuple[
        mx.array, list[mx.array], list[mx.array], list[list[mx.array]], list[list[mx.array]]
    ]:
        capacity = keys[0].shape[2]
        B, S = tokens.shape
        if holes is None:
            holes, gaps = mx.zeros((B, capacity), dtype=mx.bool_), mx.zeros((B,), mx.int32)
        if self.compiles:
            width, lowest = attention_width(column, capacity, S)
            shape = (B, capacity, width, S, self.lora.rows is None)
            if shape not in self.shapes:
                if len(self.shapes) >= self.max_traces:
                    self._step = self._compile()  # the old function and its traces are freed
                self.shapes.add(shape)
        else:
            width, lowest = column + S, column
        at = mx.array([column], dtype=mx.int32)
        args = (keys, values, list(states), [list(p) for p in parts])
        adapters = self.lora.rows  # the rows' adapters the runner set for this step
        return self._step(tokens, at, left_pad, *args, width, lowest, holes, gaps, adapters)
