"""SwiGLU and attention for MLX's CPU backend, with a vectorised exp.

On x86 Linux, MLX's CPU `exp` (and so `sigmoid`, `silu`, `softmax`) runs one element at a
time through library `fma` calls, about 20 ns an element: with OpenBLAS doing the matmuls,
SiLU and the attention softmax were over half of a prefill. Two replacements:

- Outside `mx.compile` (prefill), the graph is evaluated up to the exp's input and numpy
  finishes in place (big arrays in halves on two threads: cpu_split): its exp is SIMD,
  0.6 ns an element here, and a whole softmax takes 2.3 ns an element instead of 8 (a
  1,088-token prefill 1.3x faster, 64 new tokens over 1,024 cached 1.5x).
- Inside `mx.compile` (the decode step), where nothing can be evaluated, exp is a Cody-Waite
  range reduction and a degree-5 polynomial (Cephes' expf) in plain multiply-adds, which
  MLX fuses into one kernel: 3-4 ns an element, and closer to the true exp (relative error
  < 1e-7) than `mx.exp` itself (< 1e-6).

`install(model)` routes the model's `swiglu`, `precise_swiglu`, `scaled_dot_product_attention`
and `gated_delta_update` (module globals of the mlx-lm files its classes come from) through
these and `cpu_gated_delta`, after checking they agree with the stock functions, and gives
its RoPE modules a table of angles (`cpu_rope`). Only the worker calls
it, so only the worker process is changed.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from worker_mlx.backends import cpu_gated_delta, cpu_rope, cpu_split
from worker_mlx.backends.cpu_linear import SMALL_MNK

logger = logging.getLogger("worker")

LOG2E = 1.4426950408889634
LN2_HI, LN2_LO = 0.693359375, -2.12194440e-4  # ln 2 split so k * LN2_HI is exact
ROUND = 12582912.0  # 1.5 * 2**23: adding it rounds a float32 to the nearest integer
# Inputs are clipped to [EXP_MIN, EXP_MAX]. At EXP_MIN, k = -127 makes the exponent field
# 0, so exp(-inf) (a masked attention score) is exactly 0; a tiny nonzero weight there
# would make denormal products in the attention matmul, 100x slower on x86.
EXP_MIN, EXP_MAX = -88.0, 88.0
# Below this many elements the vectorised exp's extra kernel launches cost more than the
# scalar exp saves (a batch-1 decode step keeps mlx's own ops; batch 8 does not).
MIN_ELEMENTS = 1 << 12
# Row reductions run across blocks of this many columns first (decode widths are multiples).
REDUCE_BLOCK = 32


@partial(mx.compile, shapeless=True)
def _exp_parts(x: mx.array) -> tuple[mx.array, mx.array]:
    """exp(x) = poly * 2**k: returns (poly, k + ROUND) with k = round(x / ln 2). Plain
    multiply-adds, which MLX fuses into one vectorised kernel (a select would not be)."""
    x = mx.clip(x, EXP_MIN, EXP_MAX)
    k_rounded = x * LOG2E + ROUND
    k = k_rounded - ROUND
    r = x - k * LN2_HI - k * LN2_LO
    p = 1.9875691500e-4
    p = p * r + 1.3981999507e-3
    p = p * r + 8.3334519073e-3
    p = p * r + 4.1665795894e-2
    p = p * r + 1.6666665459e-1
    p = p * r + 5.0000001201e-1
    return p * r * r + r + 1.0, k_rounded


def fast_exp(x: mx.array) -> mx.array:
    """exp of a float32 array (other dtypes are computed in float32 and cast back)."""
    dtype = x.dtype
    poly, k_rounded = _exp_parts(x.astype(mx.float32))
    # k + ROUND holds k in its low mantissa bits: shift k + 127 into the exponent field
    two_k = ((k_rounded.view(mx.int32) + (127 - 0x4B400000)) << 23).view(mx.float32)
    out = poly * two_k
    return out if dtype == mx.float32 else out.astype(dtype)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x, as mlx-lm's activations.swiglu."""
    if gate.size < MIN_ELEMENTS:
        return nn.silu(gate) * x
    if gate.dtype == x.dtype == mx.float32 and gate.shape == x.shape:
        out = -gate  # a fresh buffer for numpy to work in
        if _evaluated(out, gate, x):
            arrays = (np.asarray(memoryview(a)) for a in (out, gate, x))
            cpu_split.host_halves(_host_swiglu, *arrays)
            return out
    g = gate.astype(mx.float32)
    return (g / (1.0 + fast_exp(-g)) * x).astype(x.dtype)


def _host_swiglu(o: np.ndarray, gate: np.ndarray, x: np.ndarray) -> None:
    """silu(gate) * x into `o`, which holds -gate."""
    np.exp(o, out=o)
    o += 1.0
    np.divide(gate, o, out=o)
    o *= x


def precise_swiglu(h: mx.array, gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x in float32, cast to h's dtype, as mlx-lm's activations.precise_swiglu
    (the gated RMSNorm of Qwen3-Next / Qwen3.5)."""
    return swiglu(gate.astype(mx.float32), x.astype(mx.float32)).astype(h.dtype)


def softmax(scores: mx.array, sinks: mx.array | None = None) -> mx.array:
    """Softmax over the last axis, in float32; `sinks` (broadcastable to the rows) are
    logits of one more column that takes weight but has no value (gpt-oss)."""
    exps, sums = _exps_and_sums(scores.astype(mx.float32), sinks)
    return exps / sums


def _exps_and_sums(s: mx.array, sinks: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """exp(s - row max) and its row sums (the sink's share included), on the graph."""
    top = _row_reduce(s, mx.max)
    if sinks is None:
        exps = fast_exp(s - top)
        return exps, _row_reduce(exps, mx.sum)
    top = mx.maximum(top, sinks)
    exps = fast_exp(s - top)
    return exps, _row_reduce(exps, mx.sum) + fast_exp(sinks - top)


def _row_reduce(x: mx.array, op: Callable) -> mx.array:
    """op (max or sum) over the last axis, keeping it. MLX's CPU reduces along a row 3x
    slower than across rows, so a row that splits into blocks is first reduced across them."""
    n = x.shape[-1]
    if n % REDUCE_BLOCK or n == REDUCE_BLOCK:
        return op(x, axis=-1, keepdims=True)
    blocks = x.reshape(*x.shape[:-1], n // REDUCE_BLOCK, REDUCE_BLOCK)
    return op(op(blocks, axis=-2), axis=-1, keepdims=True)


def host_exp(
    scores: mx.array, mask: mx.array | None, sinks: mx.array | None = None
) -> tuple[mx.array, mx.array]:
    """The softmax of the last axis without its division: exp(scores - row max), masked
    entries 0, and 1 / each row's sum. The caller scales the attention output instead,
    which is D columns wide rather than S: one pass over the scores fewer (a prefill's
    attention 6-9% faster).

    Computed by numpy in place: float32 scores are overwritten (the attention's own score
    matrix, which nothing else reads). Inside `mx.compile`, where nothing can be evaluated,
    it runs on the graph. Rows must keep at least one unmasked key, as every plan's do.
    `sinks` as in `softmax`."""
    scores = scores.astype(mx.float32)
    if mask is not None and mask.dtype != mx.bool_:
        mask = mask.astype(mx.float32)  # numpy has no bfloat16
    if sinks is not None:
        sinks = sinks.astype(mx.float32)
    given = [a for a in (mask, sinks) if a is not None]
    if not _evaluated(scores, *given):
        exps, sums = _exps_and_sums(_masked(scores, mask), sinks)
        return exps, 1.0 / sums
    s = np.asarray(memoryview(scores))  # a writable view of the buffer, no copy
    m, sink = (None if a is None else np.asarray(memoryview(a)) for a in (mask, sinks))
    sums = np.empty((*s.shape[:-1], 1), np.float32)
    cpu_split.host_halves(_host_exp_rows, s, m, sink, sums)
    return scores, mx.array(np.reciprocal(sums))


def _host_exp_rows(s: np.ndarray, m: np.ndarray | None, sink: np.ndarray | None, sums) -> None:
    """host_exp's work on some of the rows, in place: `s` becomes the exps, `sums` (the
    rows' share) their sums."""
    if m is not None:
        if m.dtype == np.bool_:
            first = _first_hidden_column(m)  # the columns before it are visible to all rows
            np.copyto(s[..., first:], -np.inf, where=~m[..., first:])
        else:
            s += m
    top = s.max(axis=-1, keepdims=True)
    if sink is not None:
        top = np.maximum(top, sink)
    np.subtract(s, top, out=s)
    np.exp(s, out=s)
    np.sum(s, axis=-1, keepdims=True, out=sums)
    if sink is not None:
        sums += np.exp(sink - top)


def _first_hidden_column(mask: np.ndarray) -> int:
    """The first column some row cannot see: an extend's prefix columns are usually visible
    to every row, so masking starts there (a pass over bytes instead of floats)."""
    visible = mask.all(axis=tuple(range(mask.ndim - 1)))
    return int(np.argmin(visible)) if not visible.all() else mask.shape[-1]


def _masked(scores: mx.array, mask: mx.array | None) -> mx.array:
    if mask is None:
        return scores
    return mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_ else scores + mask


def _evaluated(*arrays: mx.array) -> bool:
    """Evaluate now, for numpy to take over; False while `mx.compile` traces (the decode
    step), where evaluating is not allowed and the graph must carry on."""
    try:
        mx.eval(*arrays)
    except ValueError:
        return False
    return True


def scaled_dot_product_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache=None,
    scale: float = 1.0,
    mask: mx.array | str | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """mlx-lm's base.scaled_dot_product_attention for float K/V, with or without attention
    sinks (one learned logit per query head).

    Grouped-query heads share their K/V without copies: the query heads of one KV head
    are stacked along the sequence axis, so each KV head is one matmul."""
    B, H, L, D = queries.shape
    Hk, S = keys.shape[1], keys.shape[2]
    if B * H * L * S < MIN_ELEMENTS:
        return mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=mask, sinks=sinks
        )
    rep = H // Hk
    # per row of the (B, Hk, rep, L) scores
    sink = None if sinks is None else sinks.reshape(1, Hk, rep, 1, 1)
    q = (queries * scale).reshape(B, Hk, rep * L, D)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unsupported attention mask {mask!r}")
        mask = mx.arange(S)[None] <= mx.arange(S - L, S)[:, None] if L > 1 else None
    if mask is not None and mask.ndim == 4:
        mask = _grouped(mask, Hk, rep)
    if L == 1:
        sink = None if sink is None else sink[..., 0, :]
        mask = None if mask is None else mask[..., 0, :]
        return _one_query_attention(q, keys, values, mask, sink).reshape(B, H, 1, -1)
    scores = (q @ keys.swapaxes(-1, -2)).reshape(B, Hk, rep, L, S)
    exps, inv_sums = host_exp(scores, mask, sink)
    out = exps.astype(values.dtype).reshape(B, Hk, rep * L, S) @ values
    out = out * inv_sums.reshape(B, Hk, rep * L, 1)
    return out.astype(values.dtype).reshape(B, H, L, values.shape[-1])


def _grouped(mask: mx.array, Hk: int, rep: int) -> mx.array:
    """A (B, H or 1, L, S) mask as (B, Hk, rep or 1, L, S), the grouped scores' layout: a
    mask per query head (latent attention's score bias) follows its head into its group."""
    if mask.shape[1] == 1:
        return mask[:, :, None]
    return mask.reshape(mask.shape[0], Hk, rep, *mask.shape[2:])


def _one_query_attention(
    q: mx.array, keys: mx.array, values: mx.array, mask, sinks: mx.array | None
) -> mx.array:
    """Decode: one query per row, half of the rows on each of two threads where their K/V
    is big (cpu_split)."""

    def rows(part: slice) -> mx.array:
        m = mask[part] if mask is not None and mask.shape[0] > 1 else mask
        return _rows_attention(q[part], keys[part], values[part], m, sinks)

    nbytes = keys.nbytes + values.nbytes
    return cpu_split.halves(rows, q.shape[0], nbytes, cpu_split.MIN_ATTENTION_BYTES)


def _rows_attention(
    q: mx.array, keys: mx.array, values: mx.array, mask, sinks: mx.array | None
) -> mx.array:
    """One query per row. Scores as keys @ q^T, (S, D) x (D, rep), run 2-3x faster
    in OpenBLAS than q @ keys^T on a strided key buffer; they are turned back to (rep, S)
    rows, a small copy, because MLX's softmax runs 20% slower down columns. Long float32
    contexts go in spans of keys (`_key_spans`)."""
    q_t = mx.contiguous(q.swapaxes(-1, -2))
    spans = _key_spans(keys.shape[2], q.shape[-2] * max(q.shape[-1], values.shape[-1]))
    if values.dtype != mx.float32 or keys.dtype != mx.float32 or len(spans) == 1:
        scores = mx.contiguous((keys @ q_t).swapaxes(-1, -2))
        weights = softmax(_masked(scores, mask), sinks).astype(values.dtype)
        return weights @ values  # (B, Hk, rep, D)
    scores = mx.concatenate([keys[:, :, a:b] @ q_t for a, b in spans], axis=2)
    weights = softmax(_masked(mx.contiguous(scores.swapaxes(-1, -2)), mask), sinks)
    out = None
    for a, b in spans:  # the spans' shares of each row's weighted sum
        part = weights[..., a:b] @ values[:, :, a:b]
        out = part if out is None else out + part
    return out


def _key_spans(keys: int, per_key: int) -> list[tuple[int, int]]:
    """Spans of the key axis whose products with the queries are each small enough for
    OpenBLAS's small-matrix kernel (cpu_linear.SMALL_MNK multiply-adds: `per_key` each).
    Past it OpenBLAS packs each head's keys and values into a buffer before reading them,
    on two threads that wait on each other: at 8k tokens of context, batch 8 on the medium
    preset, the step's attention took 1.6-1.7x as long in one piece as in spans."""
    n = -(-keys * per_key // SMALL_MNK)
    size = -(-keys // n)
    return [(a, min(a + size, keys)) for a in range(0, keys, size)]


def install(model: nn.Module, positions: int | None = None) -> Callable[[], None] | None:
    """Use these kernels for `model` wherever its mlx-lm modules use the stock functions
    (a model's classes may come from several: Qwen3.5's MLP, attention and gated norm are
    Qwen3-Next's); returns a function that puts the stock ones back, or None. The CPU
    backend calls it: the device was chosen there (`backends.select`). `positions`: the
    RoPE tables' reservation (`cpu_rope.install`)."""
    stock = _stock_functions()
    fast = {
        "swiglu": swiglu,
        "precise_swiglu": precise_swiglu,
        "scaled_dot_product_attention": _sdpa_or_stock(stock["scaled_dot_product_attention"]),
        "gated_delta_update": cpu_gated_delta.gated_delta_update,
    }
    swaps = [
        (module, name)
        for module in _model_modules(model)
        for name in fast
        if getattr(module, name, None) is stock[name]
    ]
    if not swaps or not agrees_with_stock():
        return None
    names = {name for _, name in swaps}
    if "gated_delta_update" in names and not cpu_gated_delta.agrees_with_stock():
        logger.warning("the CPU gated-delta step disagrees with mlx-lm's; keeping mlx-lm's")
        swaps = [(m, name) for m, name in swaps if name != "gated_delta_update"]
    for module, name in swaps:
        setattr(module, name, fast[name])
    ropes = cpu_rope.install(model, positions) if cpu_rope.agrees_exactly() else []
    logger.info(
        "CPU kernels in place of mlx-lm's %s; %d RoPE modules look up their angles",
        ", ".join(sorted({name for _, name in swaps})), len(ropes),
    )  # fmt: skip

    def uninstall() -> None:
        for module, name in swaps:
            setattr(module, name, stock[name])
        cpu_rope.uninstall(ropes)

    return uninstall


def _model_modules(model: nn.Module) -> list:
    """The mlx-lm modules (Python files) that define `model`'s classes, the model's first."""
    names = [type(model).__module__] + [type(m).__module__ for m in model.modules()]
    return [sys.modules[n] for n in dict.fromkeys(names) if n.startswith("mlx_lm.")]


def _stock_functions() -> dict[str, Callable]:
    from mlx_lm.models import activations, base

    return {
        "swiglu": activations.swiglu,
        "precise_swiglu": activations.precise_swiglu,
        "scaled_dot_product_attention": base.scaled_dot_product_attention,
        "gated_delta_update": cpu_gated_delta.stock_update(),
    }


def _sdpa_or_stock(stock: Callable) -> Callable:
    """Quantized KV caches keep mlx-lm's own path."""

    def sdpa(queries, keys, values, cache, scale, mask, sinks=None):
        if hasattr(cache, "bits"):
            return stock(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        return scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks)

    return sdpa


def agrees_with_stock(atol: float = 1e-5) -> bool:
    """A start-up check on random inputs big enough for the vectorised paths: SwiGLU, and
    attention with and without masks and sinks, grouped-query, one query per row and many."""
    k0, k1, k2, k3 = mx.random.split(mx.random.key(0), 4)
    k = mx.random.normal((2, 2, 600, 16), key=k1)
    v = mx.random.normal((2, 2, 600, 16), key=k2)
    x = mx.random.normal((64, 128), key=k3) * 8
    checks = [(swiglu(x, x), nn.silu(x) * x)]
    for L in (1, 8):
        q = mx.random.normal((2, 4, L, 16), key=k0)
        mask = mx.random.uniform(shape=(2, 1, L, 600), key=k3) > 0.3
        mask[..., -1] = True  # every query sees at least one key
        for m, sinks in ((None, None), ("causal", None), (mask, None), (mask, x[0, :4])):
            ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=m, sinks=sinks)
            checks.append((scaled_dot_product_attention(q, k, v, None, 0.25, m, sinks), ref))
    ok = all(mx.allclose(a, b, rtol=1e-5, atol=atol).item() for a, b in checks)
    if not ok:
        logger.warning("CPU kernels disagree with mlx's own; keeping mlx's")
    return ok
