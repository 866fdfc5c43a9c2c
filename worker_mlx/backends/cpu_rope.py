"""RoPE for MLX's CPU backend, with its cosines and sines looked up instead of recomputed.

On the CPU `mx.fast.rope` is MLX's composite fallback: it computes cos and sin of every
(position, frequency) pair on every call, one element at a time (about 20 ns each), and a
model calls it twice a layer. That was 12% of a prefill (a 1,088-token one: 20 of 165
ms). `TableRoPE` computes each position's cosines and sines once, with the same ops on the
same float32 angles, so a lookup returns exactly the values the fallback would compute and
the output is bit-identical (`agrees_exactly` checks it before anything is swapped).

Inside `mx.compile` (the decode step) the table cannot be sized, so there it is looked up
only when it was reserved at install for every position the server can reach (its
context length, `reserve`): the compiled step then gathers two rows per call where the
stock op computed cos and sin of every angle (docs/performance.md has the step's gain).
A table over MAX_RESERVED_BYTES is not reserved (the stock op runs in the compiled step);
one-token calls with an int offset keep the stock op too.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

# Positions a table holds at first; it doubles when a call needs more.
INITIAL_POSITIONS = 4096
# The most a reserved table may hold (cos and sin): 64k positions at head dim 128.
MAX_RESERVED_BYTES = 64 << 20


class AngleTable:
    """cos and sin of every (position, frequency) for one RoPE setting, shared by the
    layers that use it (one table per model, not per layer: at 128k positions and head
    dim 128 it is 64 MiB)."""

    def __init__(self, dims: int, base: float, scale: float):
        self.dims, self.base, self.scale = dims, base, scale
        self.cos = self.sin = mx.zeros((0, dims // 2))
        self.reserved = 0  # every position below it is in the table, for good

    def reserve(self, positions: int) -> bool:
        """Hold every position below `positions` from now on (False: too big to)."""
        if positions * self.dims * 4 > MAX_RESERVED_BYTES:
            return False
        self._grow(positions)
        self.reserved = len(self.cos)
        return True

    def rows(self, positions: mx.array) -> tuple[mx.array, mx.array]:
        """cos and sin rows of `positions` of a reserved table, sized by nothing, so also
        inside mx.compile (clipped into the table: a dead row's position may be any)."""
        positions = mx.clip(positions, 0, self.reserved - 1)
        return self.cos[positions], self.sin[positions]

    def lookup(self, positions: mx.array, last: int) -> tuple[mx.array, mx.array]:
        """cos and sin rows of `positions` (any shape), all below `last`."""
        self._grow(last)
        return self.cos[positions], self.sin[positions]

    def _grow(self, positions: int) -> None:
        """Rows for positions [0, positions), computed as MLX's fallback computes them:
        position (a float32) times scale, times exp(-i * log(base) / half)."""
        n = len(self.cos)
        if positions <= n:
            return
        n = max(INITIAL_POSITIONS, n)
        while n < positions:
            n *= 2
        half = self.dims // 2
        inv_freqs = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * _log_ratio(self.base, half))
        theta = (mx.arange(n, dtype=mx.float32) * self.scale)[:, None] * inv_freqs
        self.cos, self.sin = mx.cos(theta), mx.sin(theta)
        mx.eval(self.cos, self.sin)


class TableRoPE(nn.Module):
    """nn.RoPE (non-traditional) whose angles come from an AngleTable."""

    def __init__(self, rope: nn.RoPE, table: AngleTable | None = None):
        super().__init__()
        self._table = table or AngleTable(rope.dims, rope.base, rope.scale)

    def _stock(self, x: mx.array, offset) -> mx.array:
        t = self._table
        return mx.fast.rope(x, t.dims, traditional=False, base=t.base, scale=t.scale, offset=offset)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        T, table = x.shape[-2], self._table
        if x.ndim != 4:
            return self._stock(x, offset)
        if isinstance(offset, mx.array):
            positions = offset.reshape(-1, 1, 1)
            positions = positions + mx.arange(T) if T > 1 else positions  # (B, 1, T)
            if table.reserved:
                return self._rotate(x, *table.rows(positions))
            if T == 1:
                return self._stock(x, offset)
            try:
                last = int(offset.max().item()) + T
            except ValueError:  # traced by mx.compile: no values to size the table by
                return self._stock(x, offset)
        elif T == 1:
            return self._stock(x, offset)
        else:
            last = offset + T
            positions = mx.arange(offset, offset + T)
        return self._rotate(x, *table.lookup(positions, last))

    def _rotate(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
        dims = self._table.dims
        x1, x2 = x[..., : dims // 2], x[..., dims // 2 : dims]
        parts = [x1 * cos - x2 * sin, x1 * sin + x2 * cos]
        if dims < x.shape[-1]:
            parts.append(x[..., dims:])
        return mx.concatenate(parts, axis=-1)


def _log_ratio(base: float, half: int) -> mx.array:
    """log(base) / half rounded to float32 once, as the C++ fallback does."""
    return mx.array(math.log(base) / half, dtype=mx.float32)


def install(
    model: nn.Module, positions: int | None = None
) -> list[tuple[nn.Module, str, nn.Module]]:
    """Swap every plain non-traditional nn.RoPE in `model` for a TableRoPE; returns
    (parent, name, original) for each swap so they can be put back. `positions`: every
    position a request can reach (the server's context length; None: the model's
    `max_position_embeddings`, if it says), reserved in the tables (see `reserve`)."""
    swaps = []
    for _, parent in model.named_modules():
        for name, child in parent.children().items():
            if type(child) is nn.RoPE and not child.traditional:
                swaps.append((parent, name, child))
    tables: dict[tuple, AngleTable] = {}
    limit = positions or _max_positions(model)
    for parent, name, child in swaps:
        key = (child.dims, child.base, child.scale)
        if key not in tables:
            tables[key] = AngleTable(*key)
            if limit:
                tables[key].reserve(limit)
        setattr(parent, name, TableRoPE(child, tables[key]))
    return swaps


def _max_positions(model: nn.Module) -> int | None:
    args = getattr(model, "args", None)
    return getattr(args, "max_position_embeddings", None)


def uninstall(swaps: list[tuple[nn.Module, str, nn.Module]]) -> None:
    for parent, name, child in swaps:
        setattr(parent, name, child)


def agrees_exactly() -> bool:
    """Bit-identical to mx.fast.rope for scalar and per-row offsets and partial dims."""
    x = mx.random.normal((3, 4, 37, 64), key=mx.random.key(1))
    checks = []
    for dims in (64, 32):
        table = TableRoPE(nn.RoPE(dims, base=10000.0))
        for offset in (0, 1000, mx.array([0, 7, 5000], dtype=mx.int32)):
            checks.append(mx.array_equal(table(x, offset), table._stock(x, offset)).item())
    return all(checks)
