"""How the KV pool stores a token's keys and values (`--kv-cache-dtype`).

A codec turns the model's K/V (its own dtype) into the arrays the pool keeps ("parts",
each of shape (..., width) along the last axis) and back. Everything that computes with
KV gets the decoded values, in the model's dtype, so attention is the model's own float
attention and the pool's format is invisible to it.

- `FloatCodec`: one part each for K and V, in the store dtype (auto: the model's, the
  codec is the identity; fp16/bf16: a cast, whose round trip re-encodes exactly).
- `QuantizedCodec`: mlx-lm's `QuantizedKVCache` format: `mx.quantize` per group of 64
  along the head dim, three parts each for K and V (packed uint32, scales, biases; scales
  and biases in the model's dtype, as mlx-lm's). Dequantized by hand: the same values as
  `mx.dequantize` (bit-equal, checked in tests), 2.3x (int8) to 3.7x (int4) faster on
  the CPU, where the stock kernel runs element by element.

Why decode rather than attend with `mx.quantized_matmul` (mlx-lm's quantized SDPA): on
this CPU a batch-8 decode attention over 2,048 quantized columns took 5.4 ms a layer
through `quantized_matmul` against 2.8 ms as float matmuls (docs/performance.md). The
decode buffer keeps each running request's K/V decoded, so a decode step attends floats;
an extend decodes what it gathers.
"""

from __future__ import annotations

import mlx.core as mx

GROUP_SIZE = 64  # along the head dim, as mlx-lm's QuantizedKVCache and kv_group_size
FLOAT_DTYPES = {"bf16": mx.bfloat16, "fp16": mx.float16}
QUANTIZED_BITS = {"int8": 8, "int4": 4}
KV_CACHE_DTYPES = ("auto", *FLOAT_DTYPES, *QUANTIZED_BITS)


class FloatCodec:
    """K and V as one array each, in `store` (a cast from and to the model's `compute`)."""

    quantized = False

    def __init__(self, compute: mx.Dtype, store: mx.Dtype | None = None):
        self.compute, self.store = compute, store or compute

    def widths(self, width: int) -> list[tuple[int, mx.Dtype]]:
        """(last-axis size, dtype) of each part of one head's `width`-wide vector."""
        return [(width, self.store)]

    def encode(self, x: mx.array) -> list[mx.array]:
        return [x if x.dtype == self.store else x.astype(self.store)]

    def decode(self, parts: list[mx.array]) -> mx.array:
        (x,) = parts
        return x if x.dtype == self.compute else x.astype(self.compute)

    def round_trip(self, x: mx.array) -> mx.array:
        """`x` as the pool will hand it back."""
        return x if self.store == x.dtype else self.decode(self.encode(x))

    def describe(self) -> str:
        return str(self.store).rsplit(".", 1)[-1]


class QuantizedCodec:
    """K and V as mlx-lm's QuantizedKVCache keeps them: (packed, scales, biases)."""

    quantized = True

    def __init__(self, compute: mx.Dtype, bits: int, group_size: int = GROUP_SIZE):
        self.compute, self.bits, self.group_size = compute, bits, group_size

    def widths(self, width: int) -> list[tuple[int, mx.Dtype]]:
        groups = width // self.group_size
        packed = width * self.bits // 32
        return [(packed, mx.uint32), (groups, self.compute), (groups, self.compute)]

    def encode(self, x: mx.array) -> list[mx.array]:
        return list(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def decode(self, parts: list[mx.array]) -> mx.array:
        """`mx.dequantize` as elementwise ops: codes x scale + bias per group."""
        packed, scales, biases = parts
        codes = packed.view(mx.uint8)
        if self.bits == 4:  # two codes a byte, the low nibble first
            codes = mx.stack([codes & 15, codes >> 4], axis=-1)
        codes = codes.reshape(*scales.shape, self.group_size).astype(scales.dtype)
        out = codes * scales[..., None] + biases[..., None]
        return out.reshape(*packed.shape[:-1], -1)

    def round_trip(self, x: mx.array) -> mx.array:
        return self.decode(self.encode(x))

    def describe(self) -> str:
        return f"int{self.bits} (group {self.group_size})"


def make_codec(kv_cache_dtype: str, compute: mx.Dtype) -> FloatCodec | QuantizedCodec:
    if kv_cache_dtype in QUANTIZED_BITS:
        return QuantizedCodec(compute, QUANTIZED_BITS[kv_cache_dtype])
    if kv_cache_dtype == "auto":
        return FloatCodec(compute)
    if kv_cache_dtype in FLOAT_DTYPES:
        return FloatCodec(compute, FLOAT_DTYPES[kv_cache_dtype])
    raise ValueError(f"unknown KV cache dtype {kv_cache_dtype!r}; one of {KV_CACHE_DTYPES}")


def encode_kv(codec, keys: mx.array, values: mx.array) -> list[mx.array]:
    """The parts of K then the parts of V, as the pool stores them."""
    return codec.encode(keys) + codec.encode(values)


def decode_kv(codec, parts: list[mx.array]) -> tuple[mx.array, mx.array]:
    half = len(parts) // 2
    return codec.decode(parts[:half]), codec.decode(parts[half:])
