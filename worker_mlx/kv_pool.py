"""MlxKVPool: the flat per-layer K/V store that slot ids from the scheduler index into."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import mlx.core as mx

logger = logging.getLogger(__name__)

# Past a million cached tokens a single machine gains little and the zero-filled pool
# costs real memory up front; --max-total-tokens lifts the cap.
MAX_AUTO_SLOTS = 1 << 20


@dataclass(frozen=True)
class KVLayout:
    """What one token's KV looks like, probed from the model itself."""

    num_layers: int
    n_kv_heads: int
    head_dim: int  # of keys
    dtype: mx.Dtype
    # of values, where it differs from the keys' (multi-head latent attention caches a
    # latent as "keys" and its RoPE part as "values")
    v_head_dim: int | None = None
    # per layer, the sliding window it attends (None: every token before it); () when all
    # layers attend everything
    windows: tuple[int | None, ...] = ()
    # where the model's recurrent layers sit in its list of caches (mlx-lm's make_cache
    # order); the other positions are the KV layers, in order
    recurrent: tuple[int, ...] = ()

    @property
    def value_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def bytes_per_slot(self) -> int:
        widths = self.head_dim + self.value_dim
        return self.num_layers * self.n_kv_heads * widths * self.dtype.size

    def in_model_order(self, kv: list, states: list) -> list:
        """One list of caches for the model: `kv` (one per KV layer) and `states` (one per
        recurrent layer) interleaved as the model's layers use them."""
        kv_it, state_it = iter(kv), iter(states)
        total = self.num_layers + len(self.recurrent)
        return [next(state_it) if i in self.recurrent else next(kv_it) for i in range(total)]


class MlxKVPool:
    """Per layer, K and V of shape (num_slots + 1, n_kv_heads, width); row 0 is padding.

    Writes are scatters into the arrays MLX donates in place, so a write costs the tokens
    written, not the pool size. Readers gather by slot id inside their compute graph.
    """

    def __init__(self, layout: KVLayout, num_slots: int):
        self.layout = layout
        self.num_slots = num_slots
        k_shape = (num_slots + 1, layout.n_kv_heads, layout.head_dim)
        v_shape = (num_slots + 1, layout.n_kv_heads, layout.value_dim)
        self.k = [mx.zeros(k_shape, layout.dtype) for _ in range(layout.num_layers)]
        self.v = [mx.zeros(v_shape, layout.dtype) for _ in range(layout.num_layers)]
        mx.eval(self.k, self.v)

    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Store (n, H, D) keys/values at `slots` (n,)."""
        self.k[layer][slots] = keys
        self.v[layer][slots] = values

    def gather(self, layer: int, slots: mx.array) -> tuple[mx.array, mx.array]:
        """K and V of `slots` (any shape S) as arrays of shape S + (H, D)."""
        return self.k[layer][slots], self.v[layer][slots]

    def head_index(self, slots: mx.array) -> mx.array:
        """Indices into the (slots x heads, D) view of a layer for `slots` (B, S), heads
        first: gathering with them yields attention's (B, H, S, D) layout in one pass, where
        a gather by slot then a transpose would copy the KV twice."""
        H = self.layout.n_kv_heads
        dtype = mx.int32 if (self.num_slots + 1) * H < 2**31 else mx.int64
        heads = mx.arange(H, dtype=dtype)[None, :, None]
        return slots.astype(dtype)[:, None, :] * H + heads

    def gather_heads(self, layer: int, head_idx: mx.array) -> tuple[mx.array, mx.array]:
        """K and V as (B, H, S, D) for indices from `head_index`."""
        k, v = self.k[layer], self.v[layer]
        return k.reshape(-1, k.shape[-1])[head_idx], v.reshape(-1, v.shape[-1])[head_idx]

    def arrays(self) -> list[mx.array]:
        return self.k + self.v


def pool_size(layout: KVLayout, mem_fraction: float, budget: int) -> int:
    """Slots for an auto-sized pool (no --max-total-tokens): `budget` bytes (the device
    backend's `memory_budget()`) × fraction ÷ bytes per slot."""
    share = int(budget * mem_fraction)
    slots = share // layout.bytes_per_slot
    if slots > MAX_AUTO_SLOTS:
        logger.info("auto-sized pool capped at %d tokens (pass --max-total-tokens)", MAX_AUTO_SLOTS)
        slots = MAX_AUTO_SLOTS
    if slots < 16:
        raise RuntimeError(f"not enough memory for a KV pool: {share} bytes budgeted")
    return slots
