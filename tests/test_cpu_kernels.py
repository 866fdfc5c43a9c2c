"""The worker's CPU kernels against numpy's exp and mlx's own SiLU and attention."""

from __future__ import annotations

import contextlib
import random
import sys
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from tests.conftest import load_model, mlx_greedy, runner_greedy
from worker_mlx.backends import cpu_kernels, cpu_split
from worker_mlx.backends.cpu_kernels import fast_exp, scaled_dot_product_attention, swiglu


def test_fast_exp_is_accurate_over_the_float32_range():
    x = np.concatenate([np.linspace(-86.9, 88, 200_001), [0.0, 1.0, -1e-8, 1e-8]]).astype(
        np.float32
    )
    got = np.array(fast_exp(mx.array(x))).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    rel = np.abs(got - want) / want
    assert rel.max() < 2e-7
    assert got[-4] == 1.0 and abs(got[-3] - np.e) < 1e-6


def test_fast_exp_edges():
    x = mx.array([-mx.inf, -1e30, -100.0, -88.0, -87.0, 88.0, 1e30, mx.nan])
    got = fast_exp(x).tolist()
    assert got[:4] == [0.0, 0.0, 0.0, 0.0]  # exactly 0: masked attention weights stay 0
    assert abs(got[4] - np.exp(-87.0)) < 1e-7 * np.exp(-87.0)
    assert np.isfinite(got[5]) and abs(got[5] - np.exp(88.0)) < 1e-6 * np.exp(88.0)
    assert np.isfinite(got[6]) and got[6] > 1e38  # clipped, never garbage bits
    assert np.isnan(got[7])


def test_fast_exp_other_dtypes():
    x = mx.linspace(-10, 10, 101).astype(mx.float16)
    got = fast_exp(x)
    assert got.dtype == mx.float16
    assert mx.allclose(got, mx.exp(x), rtol=1e-3).item()


@pytest.mark.parametrize("rows", [3, 300])
@pytest.mark.parametrize("compiled", [False, True])
def test_swiglu_matches_silu(rows, compiled):
    """300 rows take numpy's exp, or the polynomial inside mx.compile; 3 (a small decode
    step) keep mlx's own."""
    x = mx.random.normal((rows, 256), key=mx.random.key(1)) * 10
    g = mx.random.normal((rows, 256), key=mx.random.key(2)) * 10
    want = nn.silu(g) * x
    got = (mx.compile(swiglu) if compiled else swiglu)(g, x)
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item()
    assert mx.array_equal(got, want).item() == (g.size < cpu_kernels.MIN_ELEMENTS)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "additive", "per_head"])
@pytest.mark.parametrize("q_len", [1, 6])
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_attention_matches_mlx(heads, kv_heads, mask_kind, q_len, compiled, with_sinks):
    """Several queries per row take numpy's softmax, or the polynomial inside mx.compile;
    attention sinks (gpt-oss: a logit per query head that takes weight without a value)
    enter the softmax as mlx's own attention does."""
    keys = mx.random.split(mx.random.key(heads * 10 + kv_heads + q_len), 4)
    B, S, D = 4, 2100, 16  # over MIN_ELEMENTS scores even for one query per row
    q = mx.random.normal((B, heads, q_len, D), key=keys[0])
    k = mx.random.normal((B, kv_heads, S, D), key=keys[1]) * 3
    v = mx.random.normal((B, kv_heads, S, D), key=keys[2])
    allowed = mx.random.uniform(shape=(B, 1, q_len, S), key=keys[3]) > 0.4
    allowed[..., 0] = True
    mask = {
        "none": None,
        "causal": "causal",
        "bool": allowed,
        "additive": mx.where(allowed, 0.0, -1e9),
        # a score bias per query head, as latent attention passes its RoPE scores
        "per_head": mx.random.normal((B, heads, q_len, S), key=keys[0]) * mx.where(allowed, 1, 0),
    }[mask_kind]
    # sinks around the scores' scale, so they take a real share of the weight
    sinks = mx.random.normal((heads,), key=keys[3]) * 3 + 2 if with_sinks else None
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask, sinks=sinks)
    sdpa = partial(scaled_dot_product_attention, cache=None, scale=0.3, mask=mask, sinks=sinks)
    got = (mx.compile(sdpa) if compiled else sdpa)(q, k, v)
    assert got.shape == want.shape
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item()


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("compiled", [False, True])
def test_long_one_query_attention_in_spans_matches_mlx(with_sinks, compiled):
    """Past OpenBLAS's small-matrix size the keys and values go in spans: the same
    attention, masks and sinks included."""
    k0, k1, k2, k3 = mx.random.split(mx.random.key(4), 4)
    q = mx.random.normal((2, 8, 1, 128), key=k0)
    k = mx.random.normal((2, 4, 4100, 128), key=k1)
    v = mx.random.normal((2, 4, 4100, 128), key=k2)
    assert len(cpu_kernels._key_spans(4100, 2 * 128)) == 2
    mask = mx.random.uniform(shape=(2, 1, 1, 4100), key=k3) > 0.2
    sinks = mx.linspace(-1, 1, 8) if with_sinks else None
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1, mask=mask, sinks=sinks)
    attend = partial(scaled_dot_product_attention, scale=0.1, mask=mask, sinks=sinks)
    got = (mx.compile(attend) if compiled else attend)(q, k, v)
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item()


def test_extend_mask_with_visible_prefix_columns():
    """An extend's mask: rows see their own prefix (one row's is shorter, so its padding
    columns are hidden), then the new tokens causally. Masking starts at the first column
    any row cannot see, and the columns before it must still be right for every row."""
    keys = mx.random.split(mx.random.key(11), 3)
    B, H, L, P, D = 3, 4, 40, 600, 16
    q = mx.random.normal((B, H, L, D), key=keys[0])
    k = mx.random.normal((B, 2, P + L, D), key=keys[1]) * 3
    v = mx.random.normal((B, 2, P + L, D), key=keys[2])
    cols = mx.arange(P + L)
    prefix_ok = cols[None, :] < mx.array([P, P, 450])[:, None]
    causal = (cols[None, :] >= P) & (cols[None, :] - P <= mx.arange(L)[:, None])
    mask = (prefix_ok[:, None, :] | causal[None])[:, None]
    for m in (mask, mask[:2]):  # with the short row (hidden from 450 on) and without it
        want = mx.fast.scaled_dot_product_attention(
            q[: len(m)], k[: len(m)], v[: len(m)], scale=0.3, mask=m
        )
        got = scaled_dot_product_attention(q[: len(m)], k[: len(m)], v[: len(m)], None, 0.3, m)
        assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item()
    assert cpu_kernels._first_hidden_column(np.array(mask)) == 450
    assert cpu_kernels._first_hidden_column(np.array(mask[:2])) == P + 1


@pytest.mark.parametrize("width", [600, 608, 2112])
def test_softmax_matches_mlx(width):
    """Widths that split into blocks (608, 2112: every decode width) reduce block-wise."""
    x = mx.random.normal((3, 2, width), key=mx.random.key(width)) * 20
    x[..., : width // 3] = -mx.inf
    assert mx.allclose(cpu_kernels.softmax(x), mx.softmax(x, axis=-1), atol=1e-6).item()


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_attention_in_half_precision(dtype):
    """Half-precision scores and additive masks go to numpy as float32."""
    keys = mx.random.split(mx.random.key(3), 3)
    q, k, v = (mx.random.normal((2, 4, 40, 32), key=kk).astype(dtype) for kk in keys)
    causal = mx.arange(40)[None] <= mx.arange(40)[:, None]
    additive = mx.where(causal, 0.0, -1e4).astype(dtype)
    for mask in ("causal", additive):
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mask)
        got = scaled_dot_product_attention(q, k, v, None, 0.2, mask)
        assert got.dtype == dtype
        assert mx.allclose(got, want, rtol=2e-2, atol=2e-2).item()


@contextlib.contextmanager
def kernels_on(model: nn.Module):
    uninstall = cpu_kernels.install(model)
    assert uninstall is not None
    try:
        yield sys.modules[type(model).__module__]
    finally:
        uninstall()


@pytest.fixture(scope="module")
def small_model(model_cache) -> str:
    from common.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model(model_cache, preset="small"))


@pytest.mark.parametrize("arch", ["tiny_model", "tiny_llama", "small_model"])
def test_greedy_generation_unchanged_by_kernels(arch, request):
    """Prompts of 300 and 1,100 tokens put prefill through both vectorised kernels, and decode
    steps past 1,024 tokens through the one-query attention."""
    path = request.getfixturevalue(arch)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (1, 17, 300, 1100)]
    stock = [mlx_greedy(path, prompt, 48) for prompt in prompts]
    model, _ = load_model(path)
    with kernels_on(model) as module:
        assert module.swiglu is cpu_kernels.swiglu
        fast = [mlx_greedy(path, prompt, 48) for prompt in prompts]
    assert fast == stock


def test_uninstall_restores_stock_functions(tiny_model):
    from mlx_lm.models import activations, base

    model, _ = load_model(tiny_model)
    with kernels_on(model) as module:
        assert module.swiglu is not activations.swiglu
    assert module.swiglu is activations.swiglu
    assert module.scaled_dot_product_attention is base.scaled_dot_product_attention


def test_install_skips_models_not_using_the_stock_functions():
    class Custom(nn.Module):
        def __call__(self, x):
            return x

    assert cpu_kernels.install(Custom()) is None


def test_quantized_kv_keeps_the_stock_path(tiny_model):
    """Quantized KV caches go to mlx-lm's own path; sinks take the kernels'."""
    from mlx_lm.models import base
    from mlx_lm.models.cache import QuantizedKVCache

    model, _ = load_model(tiny_model)
    with kernels_on(model) as module:
        cache = QuantizedKVCache(group_size=32, bits=8)
        q = mx.random.normal((1, 4, 1, 32), key=mx.random.key(0))
        kv = mx.random.normal((1, 2, 3, 32), key=mx.random.key(1))
        qk, qv = cache.update_and_fetch(kv, kv)
        # (mlx-lm's quantized attention scales its queries in place: each call a copy)
        got = module.scaled_dot_product_attention(q + 0, qk, qv, cache, scale=0.25, mask=None)
        want = base.scaled_dot_product_attention(q + 0, qk, qv, cache, scale=0.25, mask=None)
        assert mx.array_equal(got, want).item()
        sinks = mx.ones((4,))
        q = mx.random.normal((2, 4, 1, 32), key=mx.random.key(2))
        kv = mx.random.normal((2, 2, 700, 32), key=mx.random.key(3))
        got = module.scaled_dot_product_attention(q, kv, kv, None, 0.25, None, sinks=sinks)
        want = mx.fast.scaled_dot_product_attention(q, kv, kv, scale=0.25, sinks=sinks)
        assert mx.allclose(got, want, atol=1e-5).item()


@pytest.mark.parametrize("form", ["whole", "spans", "halves"])
def test_batched_runner_with_kernels_matches_stock_generation(small_model, form, monkeypatch):
    """Eight requests batched through the ModelRunner with the kernels on (decode rows at
    batch 8 take the vectorised SwiGLU and one-query attention) against stock mlx-lm;
    `spans`: with the small-matrix size lowered so that these contexts' decode attention
    goes in spans of keys, as 4k tokens and more of the medium preset's do; `halves`: every
    decode attention split between two streams (cpu_split), as long contexts' are."""
    if form == "spans":
        monkeypatch.setattr(cpu_kernels, "SMALL_MNK", 64 * 2 * 64)
    if form == "halves":
        monkeypatch.setattr(cpu_split, "MIN_BYTES", 0)
        monkeypatch.setattr(cpu_split, "MIN_ATTENTION_BYTES", 0)
        monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
        monkeypatch.setattr(cpu_split, "_second", None)  # put back after the test
        cpu_split.install()
    rng = random.Random(11)
    prompts = [
        [rng.randrange(3, 500) for _ in range(n)] for n in (5, 40, 90, 160, 250, 330, 410, 520)
    ]
    steps = 24
    want = [mlx_greedy(small_model, p, steps) for p in prompts]
    model, _ = load_model(small_model)
    with kernels_on(model):
        got = runner_greedy(model, prompts, steps, 4096)
    assert got == want


def test_install_refuses_kernels_that_disagree(tiny_model, monkeypatch):
    from mlx_lm.models import activations

    model, _ = load_model(tiny_model)
    module = sys.modules[type(model).__module__]
    monkeypatch.setattr(cpu_kernels, "swiglu", lambda g, x: nn.silu(g * 1.001) * x)
    assert not cpu_kernels.agrees_with_stock()
    assert cpu_kernels.install(model) is None
    assert module.swiglu is activations.swiglu
