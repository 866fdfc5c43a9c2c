"""The decode buffer's stores, one small class per kind of cache (as mlx-lm has one cache
class per kind): float KV columns, a quantized pool's stored parts, recurrent states.

A `DecodeBuffer` (decode_buffer.py) keeps the rows and columns (which request sits in
which row, where its KV starts, which column a step writes, which are flushed) and
composes these for the data. Each store answers the same few calls for its own arrays:
`fill` joining rows from the pool, `write` the unflushed columns (or state) to the pool,
`recolumn` when the columns move, `arrays`. A new kind of KV storage is one more class
here and the line in `gather_stores` that builds it.
"""

from __future__ import annotations

import mlx.core as mx

from worker_mlx.kv_pool import MlxKVPool
from worker_mlx.state_pool import StatePool


def gather_stores(pool: MlxKVPool, head_idx: mx.array) -> tuple[KVColumns, QuantizedParts | None]:
    """The KV columns of the pool at `head_idx` (`MlxKVPool.head_index`), decoded, and
    over a quantized pool the stored parts of the same columns."""
    layers = range(pool.layout.num_layers)
    if not pool.codec.quantized:
        pairs = [pool.gather_heads(layer, head_idx) for layer in layers]
        return KVColumns([k for k, _ in pairs], [v for _, v in pairs], writes=True), None
    parts = [pool.gather_parts(layer, head_idx) for layer in layers]
    pairs = [pool.decode(p) for p in parts]
    kv = KVColumns([k for k, _ in pairs], [v for _, v in pairs], writes=False)
    return kv, QuantizedParts(parts)


class KVColumns:
    """Per layer, (B, H, capacity, D) keys and values, decoded: what a step attends. Over
    a float pool the flush writes them (`writes`); over a quantized one the parts do, as
    quantizing decoded values again would not give back the same codes."""

    def __init__(self, keys: list[mx.array], values: list[mx.array], writes: bool):
        self.keys, self.values, self.writes = keys, values, writes

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def replace(self, keys: list[mx.array], values: list[mx.array]) -> None:
        """The arrays a step returned (it writes its columns functionally)."""
        self.keys, self.values = keys, values

    def fill(self, at: mx.array, joined: KVColumns) -> None:
        """Row `at` becomes `joined`'s one row of the full width (a slice update per row
        is 7x faster than a row scatter, which copied the whole buffer)."""
        for layer in range(len(self.keys)):
            self.keys[layer] = mx.slice_update(self.keys[layer], joined.keys[layer], at, (0,))
            self.values[layer] = mx.slice_update(self.values[layer], joined.values[layer], at, (0,))

    def write(self, pool: MlxKVPool, slots: mx.array, row_idx: mx.array, cols: slice) -> None:
        if not self.writes:
            return
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            pool.write(layer, slots, unflushed(k, row_idx, cols), unflushed(v, row_idx, cols))

    def recolumn(self, start: int, width: int, cap: int) -> None:
        self.keys = [shifted(k, start, width, cap) for k in self.keys]
        self.values = [shifted(v, start, width, cap) for v in self.values]

    def arrays(self) -> list[mx.array]:
        return self.keys + self.values


class QuantizedParts:
    """Per layer, the stored parts (codes, scales, biases of K then V) of every column
    over a quantized pool: gathered with the rows, written by each step, and what the
    flush writes."""

    def __init__(self, parts: list[list[mx.array]]):
        self.parts = parts

    def replace(self, parts: list[list[mx.array]]) -> None:
        self.parts = parts

    def fill(self, at: mx.array, joined: QuantizedParts) -> None:
        for layer, parts in enumerate(joined.parts):
            for i, part in enumerate(parts):
                self.parts[layer][i] = mx.slice_update(self.parts[layer][i], part, at, (0,))

    def write(self, pool: MlxKVPool, slots: mx.array, row_idx: mx.array, cols: slice) -> None:
        for layer, parts in enumerate(self.parts):
            pool.write_parts(layer, slots, [unflushed(p, row_idx, cols) for p in parts])

    def recolumn(self, start: int, width: int, cap: int) -> None:
        self.parts = [[shifted(p, start, width, cap) for p in layer] for layer in self.parts]

    def arrays(self) -> list[mx.array]:
        return [p for layer in self.parts for p in layer]


class RecurrentRows:
    """A model's recurrent layers keep one state per row, not per column: a step replaces
    it, the flush writes it to the row's working state slot (its home). Gathered from
    `start_from` (default: the homes themselves)."""

    def __init__(self, states: StatePool, homes: list[int], start_from: list[int] | None = None):
        self.states = states
        self.homes = list(homes)
        self.state = self._gather(start_from if start_from is not None else homes)

    def _gather(self, slots: list[int]) -> list[list[mx.array]]:
        idx = mx.array(slots, dtype=mx.int32)
        return [self.states.gather(layer, idx) for layer in range(self.states.layout.num_layers)]

    def replace(self, state: list[list[mx.array]]) -> None:
        self.state = state

    def fill(self, rows: list[int], homes: list[int]) -> None:
        """Joining rows' states from their working slots (written in place)."""
        joined = self._gather(homes)
        at = mx.array(rows, dtype=mx.int32)
        for layer, arrays in enumerate(self.state):
            for i, a in enumerate(arrays):
                a[at] = joined[layer][i]
        for row, home in zip(rows, homes):
            self.homes[row] = home

    def write(self, rows: list[int]) -> None:
        row_idx = mx.array(rows, dtype=mx.int32)
        homes = mx.array([self.homes[i] for i in rows], dtype=mx.int32)
        for layer, arrays in enumerate(self.state):
            self.states.write(layer, homes, [a[row_idx] for a in arrays])

    def arrays(self) -> list[mx.array]:
        return [a for layer in self.state for a in layer]


class NoRecurrentRows:
    """The recurrent store of a model without recurrent layers: nothing to keep, so the
    buffer composes this once instead of asking at every use."""

    state: tuple = ()

    def replace(self, state: list[list[mx.array]]) -> None:
        pass

    def fill(self, rows: list[int], homes: list[int]) -> None:
        pass

    def write(self, rows: list[int]) -> None:
        pass

    def arrays(self) -> list[mx.array]:
        return []


def unflushed(buffer: mx.array, row_idx: mx.array, cols: slice) -> mx.array:
    """`buffer`'s columns `cols` of rows `row_idx` as (rows x columns, H, width)."""
    # slice, then pick rows: `x[row_idx, :, a:b]` gathers whole rows first
    x = buffer[:, :, cols, :][row_idx]
    return x.transpose(0, 2, 1, 3).reshape(-1, x.shape[1], x.shape[3])


def shifted(buffer: mx.array, start: int, width: int, cap: int) -> mx.array:
    """Columns [start, start + width) of `buffer`, zero-padded to `cap` columns."""
    B, H, _, D = buffer.shape
    pad = mx.zeros((B, H, cap - width, D), dtype=buffer.dtype)
    return mx.concatenate([buffer[:, :, start : start + width], pad], axis=2)
