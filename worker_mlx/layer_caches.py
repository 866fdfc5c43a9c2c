"""The per-layer caches the worker hands to mlx-lm models, all behind one protocol.

mlx-lm attention layers read `cache.offset` (their RoPE position, an int or one per row),
call `cache.update_and_fetch(keys, values)` with the new tokens' K/V and attend over what
it returns; the model asks the first layer's cache for `make_mask(N, ...)`. The worker
implements that protocol three times, for three moments of a request:

- `ProbeCache`: one token at start-up, to learn the KV layout the pool must hold;
- `ExtendCache`: a prefill pass, new K/V scattered into the pool, prefix gathered from it;
- `StepCache`: a decode step on the decode buffer, written functionally so the step can be
  traced by `mx.compile`.

A new layer kind (a sliding window, a recurrent state) is a change to this file: each
class says what its layers see, and `make_mask` is where a window would be honoured.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import mlx.core as mx

if TYPE_CHECKING:
    from worker_mlx.prefill import ExtendPlan


@runtime_checkable
class LayerCache(Protocol):
    """What an mlx-lm attention layer needs from its cache."""

    offset: int | mx.array

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array | None: ...

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]: ...


def _no_window(window_size: int | None) -> None:
    if window_size is not None:
        raise NotImplementedError("sliding-window attention is not supported")


class ProbeCache:
    """Records the K/V shape one layer produces, so the pool fits any standard attention."""

    offset = 0

    def __init__(self):
        self.shape: tuple[int, ...] | None = None
        self.dtype: mx.Dtype | None = None

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if keys.shape[-1] != values.shape[-1]:
            raise ValueError("keys and values with different head dims are not supported")
        self.shape, self.dtype = keys.shape, keys.dtype
        return keys, values


class ExtendCache:
    """One layer of an `ExtendPlan`: rows of new tokens after prefixes held in the pool."""

    def __init__(self, plan: ExtendPlan, layer: int):
        self.plan = plan
        self.layer = layer
        self.offset = plan.offset

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        _no_window(window_size)
        return self.plan.mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        plan, pool = self.plan, self.plan.pool
        B, H, L, D = keys.shape
        # Write first, then gather from the written array: the pool buffer then has a
        # single user and MLX updates it in place instead of copying the whole pool.
        flat_k = keys.transpose(0, 2, 1, 3).reshape(B * L, H, D)
        flat_v = values.transpose(0, 2, 1, 3).reshape(B * L, H, values.shape[-1])
        pool.write(self.layer, plan.write_idx, flat_k, flat_v)
        if plan.read_idx is None:
            return keys, values
        return pool.gather_heads(self.layer, plan.read_idx)  # (B, H, P+L, D)


class StepCache:
    """One layer of a decode step: column `column` of left-padded (B, H, cap, D) buffers
    is written, and attention reads the first `width` columns under `mask`. Functional
    (the buffers are replaced, never assigned into), so `mx.compile` can trace it."""

    def __init__(
        self, offset: mx.array, mask: mx.array, column: mx.array, keys: mx.array,
        values: mx.array, width: int,
    ):  # fmt: skip
        self.offset, self.mask, self.column, self.width = offset, mask, column, width
        self.keys, self.values = keys, values

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        _no_window(window_size)
        return self.mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = mx.slice_update(self.keys, keys, self.column, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.column, axes=(2,))
        return self.keys[:, :, : self.width], self.values[:, :, : self.width]
