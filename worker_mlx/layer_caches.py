"""The per-layer caches the worker hands to mlx-lm models, all behind one protocol.

mlx-lm attention layers read `cache.offset` (their RoPE position, an int or one per row),
call `cache.update_and_fetch(keys, values)` with the new tokens' K/V and attend over what
it returns; the model asks the first layer's cache for `make_mask(N, ...)`. The worker
implements that protocol three times, for three moments of a request:

- `ProbeCache`: one token at start-up, to learn the KV layout the pool must hold;
- `ExtendCache`: a prefill pass, new K/V scattered into the pool, prefix gathered from it;
- `StepCache`: a decode step on the decode buffer, written functionally so the step can be
  traced by `mx.compile`.

A new layer kind is a change to this file: each class says what its layers see. A
sliding-window layer (mlx-lm's `RotatingKVCache(max_size=W)`) sees the same slots as any
other, and the model asks for its mask with `make_mask(N, window_size=W)`: the window is
applied there, so it attends exactly the W tokens mlx-lm's rotating cache holds. In a
decode step a windowed layer also reads only the columns its window can reach, so the
window, not the context, bounds its work. A recurrent layer (mlx-lm's `ArraysCache`:
conv and SSM / gated-delta state) gets a `StateCache` over the states its rows start
from.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import mlx.core as mx

from worker_mlx.kv_codec import decode_kv, encode_kv


class PassPlan(Protocol):
    """What an extend pass's layer caches read of its plan (extend_pass.ExtendPlan, which
    imports this module: the plan builds the caches, the caches only read it)."""

    pool: Any  # the MlxKVPool the pass writes and reads
    offset: int | mx.array
    write_idx: mx.array
    read_idx: mx.array | None

    def mask(self, window: int | None): ...


@runtime_checkable
class LayerCache(Protocol):
    """What an mlx-lm attention layer needs from its cache."""

    offset: int | mx.array
    # the keys it last returned: mlx-lm's pipeline bodies tie their send to the last
    # layer's cache with `cache[-1].keys = mx.depends(cache[-1].keys, h)`
    keys: mx.array | None

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array | None: ...

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]: ...


class ProbeCache:
    """Records the K/V shape one layer produces, so the pool fits any standard attention."""

    offset = 0

    def __init__(self):
        self.shape: tuple[int, ...] | None = None
        self.v_dim: int | None = None
        self.dtype: mx.Dtype | None = None
        self.keys: mx.array | None = None

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.shape, self.v_dim, self.dtype = keys.shape, values.shape[-1], keys.dtype
        self.keys = keys
        return keys, values


class ExtendCache:
    """One layer of an `ExtendPlan`: rows of new tokens after prefixes held in the pool."""

    def __init__(self, plan: PassPlan, layer: int):
        self.plan = plan
        self.layer = layer
        self.offset = plan.offset
        self.keys: mx.array | None = None

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return self.plan.mask(window_size)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        plan, pool = self.plan, self.plan.pool
        B, H, L, D = keys.shape
        # Write first, then gather from the written array: the pool buffer then has a
        # single user and MLX updates it in place instead of copying the whole pool.
        flat_k = keys.transpose(0, 2, 1, 3).reshape(B * L, H, D)
        flat_v = values.transpose(0, 2, 1, 3).reshape(B * L, H, values.shape[-1])
        pool.write(self.layer, plan.write_idx, flat_k, flat_v)
        if plan.read_idx is None:  # attend the values as stored, as a read would give them
            self.keys, values = pool.round_trip(keys, values)
        else:
            self.keys, values = pool.gather_heads(self.layer, plan.read_idx)  # (B, H, P+L, D)
        return self.keys, values


class StepColumns:
    """Which columns of a decode step's left-padded buffers each layer attends: the
    `queries` columns from `column` (an array, so a compiled step serves many) are
    written, every column before `width` is read under the mask, and `column` is known
    to be at least `lowest` (an int). `holes` (B, capacity) marks columns that hold no
    token (a speculative step's rejected drafts). A layer with window W reads from
    column `start(W)`, the first one any query of this width can reach, or, where that
    is more than the W + queries - 1 columns its queries can see (`moves`), exactly
    those."""

    def __init__(
        self, column: mx.array, left_pad: mx.array, width: int, lowest: int,
        holes: mx.array | None = None, queries: int = 1,
    ):  # fmt: skip
        self.column, self.width, self.lowest = column, width, lowest
        self.queries = queries
        cols = mx.arange(width)
        self.cols = cols
        self.last = column + mx.arange(queries)[:, None]  # (S, 1): each query's own column
        full = (cols[None, None, :] >= left_pad[:, None, None]) & (cols <= self.last)[None]
        if holes is not None:
            full = full & ~holes[:, None, :width]
        self.full = full[:, None]  # (B, 1, S, width)

    def start(self, window: int | None) -> int:
        return 0 if window is None else max(0, self.lowest - window + 1)

    def block(self, window: int) -> int:
        """Columns a windowed layer's queries can see: the window of the first, and one
        more for each later query."""
        return window + self.queries - 1

    def moves(self, window: int | None) -> bool:
        """Whether a windowed layer reads a moving block of exactly `block` columns: the
        columns from `start` on are up to a width step more (a compiled step's width
        grows in steps of an eighth of the buffer: at 4,096 tokens, 512 columns, twice a
        256-token window), and that excess, not the window, then grew with the context."""
        return window is not None and self.width - self.start(window) > self.block(window)

    def window_start(self, window: int) -> mx.array:
        """The first column of the block that ends at the last query's, kept inside
        `width`."""
        return mx.clip(self.column - window + 1, 0, self.width - self.block(window))

    def mask(self, window: int | None) -> mx.array:
        if window is None:
            return self.full
        if self.moves(window):
            start, n = self.window_start(window), self.block(window)
            B, _, S, _ = self.full.shape
            block = mx.slice(self.full, start, (3,), (B, 1, S, n))
            return block & (start + mx.arange(n) > self.last - window)
        start = self.start(window)
        return self.full[..., start:] & (self.cols[start:] > self.last - window)


class StepCache:
    """One layer of a decode step: the columns from `columns.column` of left-padded
    (B, H, cap, D) buffers are written (one per query), and attention reads the columns
    `columns` says. Functional (the buffers are replaced, never assigned into), so
    `mx.compile` can trace it.

    The new tokens' K/V are written as the pool's `codec` hands them back, so they attend
    themselves as every later step will (mlx-lm's QuantizedKVCache quantizes each token on
    update too); for a quantized pool the stored `parts` get the columns as well, for the
    flush to write exactly those (a second quantization of decoded values is not exact)."""

    def __init__(
        self, offset: mx.array, columns: StepColumns, keys: mx.array, values: mx.array,
        window: int | None, codec=None, parts: list[mx.array] = (),
    ):  # fmt: skip
        self.offset, self.columns, self.window = offset, columns, window
        self.keys, self.values = keys, values
        self.codec, self.parts = codec, list(parts)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return self.columns.mask(window_size)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        c = self.columns
        if self.parts:
            new = encode_kv(self.codec, keys, values)
            at = c.column
            self.parts = [mx.slice_update(p, n, at, axes=(2,)) for p, n in zip(self.parts, new)]
            keys, values = decode_kv(self.codec, new)
        elif self.codec is not None:
            keys, values = self.codec.round_trip(keys), self.codec.round_trip(values)
        self.keys = mx.slice_update(self.keys, keys, c.column, axes=(2,))
        self.values = mx.slice_update(self.values, values, c.column, axes=(2,))
        if c.moves(self.window):
            start, n = c.window_start(self.window), c.block(self.window)
            return _columns(self.keys, start, n), _columns(self.values, start, n)
        start = c.start(self.window)
        return self.keys[:, :, start : c.width], self.values[:, :, start : c.width]


def _columns(buffer: mx.array, start: mx.array, n: int) -> mx.array:
    """Columns [start, start + n) of a (B, H, cap, D) buffer, `start` an array."""
    B, H, _, D = buffer.shape
    return mx.slice(buffer, start, (2,), (B, H, n, D))


class StateCache:
    """A recurrent layer's cache (mlx-lm's `ArraysCache` protocol: `cache[i]` read and
    set, `lengths`, `make_mask`, `advance`) over given initial states: the layer reads
    `cache[i]`, runs its tokens and sets the new state. Rows are right-padded to the
    longest; `lengths` tells the layer where each row's tokens end (None: all full), so
    padding neither enters the state nor the conv window."""

    def __init__(self, size: int, initial: list[mx.array] | None, lengths: mx.array | None):
        # None entries: the zero state, which the layer creates itself (as from mlx-lm's
        # own empty cache, so a cold batch computes exactly what mlx-lm does)
        self.state: list[mx.array | None] = list(initial) if initial else [None] * size
        self.lengths = lengths

    def __getitem__(self, i: int) -> mx.array | None:
        return self.state[i]

    def __setitem__(self, i: int, value: mx.array) -> None:
        self.state[i] = value

    def make_mask(self, N: int, **kwargs) -> mx.array | None:
        if self.lengths is None:
            return None
        return mx.arange(N)[None, :] < self.lengths[:, None]

    def advance(self, N: int) -> None:
        """mlx-lm's caches count down their lengths here; ours are per pass."""
