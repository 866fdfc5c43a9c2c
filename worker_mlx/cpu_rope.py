"""RoPE for MLX's CPU backend, with its cosines and sines looked up instead of recomputed.

On the CPU `mx.fast.rope` is MLX's composite fallback: it computes cos and sin of every
(position, frequency) pair on every call, one element at a time (about 20 ns each), and a
model calls it twice a layer. That was 12% of a prefill (a 1,088-token one: 20 of 165
ms). `TableRoPE` computes each position's cosines and sines once, with the same ops on the
same float32 angles, so a lookup returns exactly the values the fallback would compute and
the output is bit-identical (`agrees_exactly` checks it before anything is swapped).

Inside `mx.compile` (the decode step), where the table cannot be sized, and for the tiny
inputs of a decode step anyway, the stock op runs.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

# Positions the table holds at first; it doubles when a call needs more.
INITIAL_POSITIONS = 4096


class TableRoPE(nn.Module):
    """nn.RoPE (non-traditional) with a growing table of cos/sin rows by position."""

    def __init__(self, rope: nn.RoPE):
        super().__init__()
        self.dims, self.base, self.scale = rope.dims, rope.base, rope.scale
        self._cos = self._sin = mx.zeros((0, rope.dims // 2))

    def _stock(self, x: mx.array, offset) -> mx.array:
        return mx.fast.rope(
            x, self.dims, traditional=False, base=self.base, scale=self.scale,
            offset=offset,
        )  # fmt: skip

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        T = x.shape[-2]
        if x.ndim != 4 or T == 1:
            return self._stock(x, offset)
        if isinstance(offset, mx.array):
            try:
                last = int(offset.max().item()) + T
            except ValueError:  # traced by mx.compile: no values to size the table by
                return self._stock(x, offset)
            positions = offset.reshape(-1, 1, 1) + mx.arange(T)  # (B, 1, T)
        else:
            last = offset + T
            positions = mx.arange(offset, offset + T)
        self._grow(last)
        cos, sin = self._cos[positions].astype(x.dtype), self._sin[positions].astype(x.dtype)
        half = self.dims // 2
        x1, x2 = x[..., :half], x[..., half : self.dims]
        parts = [x1 * cos - x2 * sin, x1 * sin + x2 * cos]
        if self.dims < x.shape[-1]:
            parts.append(x[..., self.dims :])
        return mx.concatenate(parts, axis=-1)

    def _grow(self, positions: int) -> None:
        """Rows for positions [0, positions), computed as MLX's fallback computes them:
        position (a float32) times scale, times exp(-i * log(base) / half)."""
        n = len(self._cos)
        if positions <= n:
            return
        n = max(INITIAL_POSITIONS, n)
        while n < positions:
            n *= 2
        half = self.dims // 2
        inv_freqs = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * _log_ratio(self.base, half))
        theta = (mx.arange(n, dtype=mx.float32) * self.scale)[:, None] * inv_freqs
        self._cos, self._sin = mx.cos(theta), mx.sin(theta)
        mx.eval(self._cos, self._sin)


def _log_ratio(base: float, half: int) -> mx.array:
    """log(base) / half rounded to float32 once, as the C++ fallback does."""
    return mx.array(math.log(base) / half, dtype=mx.float32)


def install(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """Swap every plain non-traditional nn.RoPE in `model` for a TableRoPE; returns
    (parent, name, original) for each swap so they can be put back."""
    swaps = []
    for _, parent in model.named_modules():
        for name, child in parent.children().items():
            if type(child) is nn.RoPE and not child.traditional:
                swaps.append((parent, name, child))
    for parent, name, child in swaps:
        setattr(parent, name, TableRoPE(child))
    return swaps


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
