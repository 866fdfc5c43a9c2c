"""MlxKVPool: the flat per-layer K/V store that slot ids from the scheduler index into."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import CacheList

from worker_mlx.kv_codec import FloatCodec, QuantizedCodec, decode_kv, encode_kv, make_codec

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
    # how the pool stores K/V (--kv-cache-dtype); `dtype` stays the model's, which
    # attention computes in
    kv_cache_dtype: str = "auto"
    # per KV layer, (key width, value width) where the layers differ (Gemma 4's global
    # layers are twice as wide per head as its local ones); () when all are the above
    layer_widths: tuple[tuple[int, int], ...] = ()
    # per model layer, how many of the caches above it takes as one CacheList (Falcon-H1's
    # layers run a Mamba mixer and attention side by side); () when each takes one
    groups: tuple[int, ...] = ()

    @property
    def value_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def widths(self, layer: int) -> tuple[int, int]:
        """The key and value widths of KV layer `layer`."""
        return self.layer_widths[layer] if self.layer_widths else (self.head_dim, self.value_dim)

    def all_widths(self) -> set[int]:
        return {w for i in range(self.num_layers) for w in self.widths(i)}

    @property
    def codec(self) -> FloatCodec | QuantizedCodec:
        return make_codec(self.kv_cache_dtype, self.dtype)

    @property
    def bytes_per_slot(self) -> int:
        """layers x KV heads x (the bytes of one head's key + its value, as stored): for a
        float pool width x dtype size; quantized, width x bits / 8 plus a scale and a bias
        (the model's dtype) per group of 64."""
        codec = self.codec
        per_head = sum(
            n * dtype.size
            for i in range(self.num_layers)
            for w in self.widths(i)
            for n, dtype in codec.widths(w)
        )
        return self.n_kv_heads * per_head

    def in_model_order(self, kv: list, states: list) -> list:
        """One list of caches for the model: `kv` (one per KV layer) and `states` (one per
        recurrent layer) interleaved as the model's layers use them."""
        kv_it, state_it = iter(kv), iter(states)
        total = self.num_layers + len(self.recurrent)
        flat = [next(state_it) if i in self.recurrent else next(kv_it) for i in range(total)]
        return grouped(flat, self.groups)


def grouped(caches: list, groups: tuple[int, ...]) -> list:
    """`caches` as CacheLists of the `groups` sizes, in order (as they are when ())."""
    if not groups:
        return caches
    out, start = [], 0
    for n in groups:
        out.append(CacheList(*caches[start : start + n]))
        start += n
    return out


class StaleRead(RuntimeError):
    """The pool was read before the decode KV the KVLedger holds back was flushed."""


class MlxKVPool:
    """Per layer, K and V of shape (num_slots + 1, n_kv_heads, width); row 0 is padding.
    Stored as the layout's codec says (`kv_codec`: the model's dtype, a cast, or mlx-lm's
    quantized parts); read back decoded, in the model's dtype.

    Writes are scatters into the arrays MLX donates in place, so a write costs the tokens
    written, not the pool size. Readers gather by slot id inside their compute graph.
    """

    def __init__(self, layout: KVLayout, num_slots: int):
        self.layout = layout
        self.codec = layout.codec
        self.num_slots = num_slots
        H = layout.n_kv_heads
        # per layer, the parts of K then the parts of V
        self.parts = [
            [
                mx.zeros((num_slots + 1, H, n), dtype)
                for w in layout.widths(layer)
                for n, dtype in self.codec.widths(w)
            ]
            for layer in range(layout.num_layers)
        ]
        mx.eval(self.parts)
        self._unflushed: Callable[[], int] = lambda: 0

    def check_reads(self, unflushed: Callable[[], int]) -> None:
        """From now on a read raises StaleRead while `unflushed()` (the KVLedger's count
        of decode tokens not written here yet) is not 0: it would read slots that hold
        nothing yet (the deferred flush's failure mode, zeros read as KV)."""
        self._unflushed = unflushed

    def encode(self, keys: mx.array, values: mx.array) -> list[mx.array]:
        """The parts the pool stores for K/V of any leading shape."""
        return encode_kv(self.codec, keys, values)

    def decode(self, parts: list[mx.array]) -> tuple[mx.array, mx.array]:
        return decode_kv(self.codec, parts)

    def round_trip(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """K/V as a write then a read would give them back."""
        return self.codec.round_trip(keys), self.codec.round_trip(values)

    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Store (n, H, D) keys/values at `slots` (n,)."""
        self.write_parts(layer, slots, self.encode(keys, values))

    def write_parts(self, layer: int, slots: mx.array, parts: list[mx.array]) -> None:
        for stored, part in zip(self.parts[layer], parts):
            stored[slots] = part

    def gather(self, layer: int, slots: mx.array) -> tuple[mx.array, mx.array]:
        """K and V of `slots` (any shape S) as arrays of shape S + (H, D), as they are
        now: an inspection (tests), which the flush rule does not check."""
        return self.decode([p[slots] for p in self.parts[layer]])

    def head_index(self, slots: mx.array) -> mx.array:
        """Indices into the (slots x heads, D) view of a layer for `slots` (B, S), heads
        first: gathering with them yields attention's (B, H, S, D) layout in one pass, where
        a gather by slot then a transpose would copy the KV twice."""
        H = self.layout.n_kv_heads
        dtype = mx.int32 if (self.num_slots + 1) * H < 2**31 else mx.int64
        heads = mx.arange(H, dtype=dtype)[None, :, None]
        return slots.astype(dtype)[:, None, :] * H + heads

    def gather_parts(self, layer: int, head_idx: mx.array) -> list[mx.array]:
        """The stored parts as (B, H, S, width) for indices from `head_index`."""
        self._check_read()
        return [p.reshape(-1, p.shape[-1])[head_idx] for p in self.parts[layer]]

    def gather_heads(self, layer: int, head_idx: mx.array) -> tuple[mx.array, mx.array]:
        """K and V as (B, H, S, D) for indices from `head_index`."""
        return self.decode(self.gather_parts(layer, head_idx))

    def arrays(self) -> list[mx.array]:
        return [p for layer in self.parts for p in layer]

    def _check_read(self) -> None:
        if n := self._unflushed():
            raise StaleRead(f"the pool read while {n} decode tokens a row are not flushed")


def pool_size(layout: KVLayout, mem_fraction: float, budget: int, extra_per_slot: int = 0) -> int:
    """Slots for an auto-sized pool (no --max-total-tokens): `budget` bytes (the device
    backend's `memory_budget()`) × fraction ÷ bytes per slot (plus `extra_per_slot`, a
    draft model's pool of the same slots)."""
    share = int(budget * mem_fraction)
    slots = share // (layout.bytes_per_slot + extra_per_slot)
    if slots > MAX_AUTO_SLOTS:
        logger.info("auto-sized pool capped at %d tokens (pass --max-total-tokens)", MAX_AUTO_SLOTS)
        slots = MAX_AUTO_SLOTS
    if slots < 16:
        raise RuntimeError(f"not enough memory for a KV pool: {share} bytes budgeted")
    return slots
