"""The KV pool stored as --kv-cache-dtype says: int8 against mlx-lm's quantized generation,
the other dtypes batched-consistent, the quantized bytes-per-slot formula, the refusal.

The reference for int8/int4 is mlx-lm's own `QuantizedKVCache(group_size=64, bits)` and
its quantized attention from the first token on: what `generate_step(kv_bits=8,
kv_group_size=64, quantized_kv_start=0)` runs for every token after its first prefill
chunk. (That first chunk attends its own float K/V there, an artefact of converting the
cache after each call; a prefix cache cannot reproduce it, as a cached prefix is only
held quantized, and the pool must give a prompt the same tokens cached or not.)

Quantizing turns a rounding difference in a K/V value (1e-6, e.g. a different matmul
order in a batch) into a whole quantization step when the value sits at a code boundary,
so greedy tokens must be equal until they first differ, and there the reference's top-2
logprob margin must be under NEAR_TIE: either side's token is right to within that noise
(measured on 30 prompts: every divergence came at a margin under 0.013, most prompts had
none; a flipped code moves the next step's margins by up to 0.02). This holds whatever
OpenBLAS kernel rounds the matmuls (Haswell's on AMD Zen 3, SkylakeX's or Cooperlake's on
AVX-512 machines), where a test of bit-equal tokens to the end would not.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import subprocess

import pytest

from common.messages import ReleaseReq
from tests.conftest import load_model
from tests.test_model_runner import Harness, generate, greedy, random_prompt

NEAR_TIE = 0.05


@pytest.fixture(scope="module")
def small_model(model_cache) -> str:
    """Qwen3 with a head dim of 64, the quantization group size (the tiny preset's is 16)."""
    from common.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model(model_cache, preset="small", arch="qwen3"))


@functools.cache
def quantized_reference(path: str, prompt: tuple[int, ...], n: int, bits: int):
    """mlx-lm's greedy tokens with its quantized KV cache, and each step's top-2 margin."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import QuantizedKVCache

    model, _ = load_model(path)
    cache = [QuantizedKVCache(group_size=64, bits=bits) for _ in model.layers]
    tokens, margins = [], []
    for tok, logprobs in generate_step(
        mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, -1),
        prompt_cache=cache,
    ):  # fmt: skip
        top2 = mx.sort(logprobs)[-2:].tolist()
        tokens.append(int(tok))
        margins.append(top2[1] - top2[0])
    return tokens, margins


def assert_matches_quantized(path: str, prompt: list[int], got: list[int], bits: int = 8) -> int:
    """`got` equals mlx-lm's quantized greedy tokens, or first differs at a near tie;
    returns how many tokens were equal."""
    want, margins = quantized_reference(path, tuple(prompt), len(got), bits)
    return same_until_a_near_tie(got, want, margins, f"prompt length {len(prompt)}")


def same_until_a_near_tie(got: list[int], want: list[int], margins: list[float], what="") -> int:
    """The number of leading tokens `got` and `want` share; where they first differ, the
    reference's top-2 margin (`margins`, per step) must be under NEAR_TIE: rounding can
    flip a token only where the two candidates are that close. After the first
    difference the histories differ, so nothing after it is compared."""
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
    assert i == len(want) or margins[i] < NEAR_TIE, (
        f"{what}: tokens differ at step {i}, where the reference's top-2 margin is "
        f"{margins[i]:.3f} (a near tie is under {NEAR_TIE})"
    )
    return i


def int8_harness(path: str, **kw) -> Harness:
    return Harness(path, kv_cache_dtype="int8", **kw)


# ---------------------------------------------------------------- codec and pool size


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_equals_mx_dequantize(bits, dtype):
    import mlx.core as mx

    from worker_mlx.kv_codec import QuantizedCodec

    x = (mx.random.normal((5, 2, 3, 128), key=mx.random.key(bits)) * 4).astype(getattr(mx, dtype))
    codec = QuantizedCodec(x.dtype, bits)
    parts = codec.encode(x)
    want = mx.dequantize(*parts, group_size=64, bits=bits)
    assert mx.array_equal(codec.decode(parts), want).item()
    assert [p.shape[-1] for p in parts] == [n for n, _ in codec.widths(128)]


def test_pool_size_follows_the_quantized_formula(small_model):
    """bytes per slot = layers x KV heads x (K + V widths) x dtype size for a float pool; for
    int8/int4 each width's codes (width x bits / 8) plus a scale and a bias (the model's
    dtype, float32 here) per group of 64. The pool's arrays hold exactly that."""
    from worker_mlx.kv_pool import MlxKVPool, pool_size
    from worker_mlx.model_probe import probe_kv_layout

    base = probe_kv_layout(load_model(small_model)[0])
    L, H, D = base.num_layers, base.n_kv_heads, base.head_dim
    assert (L, H, D, base.dtype.size) == (4, 2, 64, 4)
    formula = {
        "auto": L * H * 2 * D * 4,
        "fp16": L * H * 2 * D * 2,
        "bf16": L * H * 2 * D * 2,
        "int8": L * H * 2 * (D + 2 * (D // 64) * 4),
        "int4": L * H * 2 * (D // 2 + 2 * (D // 64) * 4),
    }
    budget = 1 << 26
    for kv_dtype, per_slot in formula.items():
        layout = dataclasses.replace(base, kv_cache_dtype=kv_dtype)
        assert layout.bytes_per_slot == per_slot, kv_dtype
        pool = MlxKVPool(layout, 100)
        assert sum(a.nbytes for a in pool.arrays()) == 101 * per_slot, kv_dtype
        assert pool_size(layout, 0.5, budget) == budget // 2 // per_slot
    # the same memory holds 3.6x the tokens at int8 (1.9x for a bf16 model: 2 / (1 + 1/16))
    assert pool_size(dataclasses.replace(base, kv_cache_dtype="int8"), 0.5, budget) >= 1.9 * (
        pool_size(base, 0.5, budget)
    )


# ---------------------------------------------------------------- int8 parity with mlx-lm


@pytest.mark.parametrize("compile_decode", [True, False], ids=["compiled", "eager"])
def test_int8_cold_batch_matches_mlx_lm(small_model, compile_decode):
    """Prompts of 1 to 600 tokens in one batch: several prefill rounds, right padding, one
    decode buffer."""
    h = int8_harness(small_model, compile_decode=compile_decode)
    rng = random.Random(3)
    prompts = {f"r{i}": random_prompt(rng, n, h.vocab) for i, n in enumerate([1, 37, 300, 600])}
    got = generate(h, prompts, 16)
    compared = sum(assert_matches_quantized(small_model, prompts[r], got[r]) for r in prompts)
    assert compared >= 32  # most of the 64 tokens were not after a near tie


def test_int8_cached_prefix_and_generated_tokens_match_mlx_lm(small_model):
    """A second turn reuses the first's prompt and generated tokens from the quantized pool
    (decode KV flushed from the buffer's stored codes), then freed slots are reused."""
    h = int8_harness(small_model, num_slots=700)
    rng = random.Random(5)
    first = random_prompt(rng, 200, h.vocab)
    generate(h, {"a": first}, 12)
    prefix = h.prefix("a")  # the prompt and 11 of its generated tokens
    follow = random_prompt(rng, 30, h.vocab)
    h.extend([h.ereq("b", follow, prefix=prefix, sampling=greedy(12))])
    while len(h.out["b"]) < 12:
        h.decode()
    h.release([ReleaseReq("b", flush=True)])
    compared = assert_matches_quantized(small_model, prefix[1] + follow, h.out["b"])
    # eviction: b's slots (a's among them) go back and a new batch takes them over
    h.free("b")
    again = {f"c{i}": random_prompt(rng, n, h.vocab) for i, n in enumerate([250, 120])}
    got = generate(h, again, 10, free_finished=True)
    compared += sum(assert_matches_quantized(small_model, again[r], got[r]) for r in again)
    assert compared >= 16


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "fp16"])
def test_decode_buffer_attends_and_flushes_the_stored_values(small_model, kv_dtype):
    """Every column of the decode buffer, prompt and decode tokens alike, holds the K/V as
    the pool hands them back, and the flush stores exactly what the buffer attended."""
    import mlx.core as mx

    h = Harness(small_model, kv_cache_dtype=kv_dtype)
    rng = random.Random(8)
    prompts = {"x": random_prompt(rng, 70, h.vocab), "y": random_prompt(rng, 20, h.vocab)}
    h.extend([h.ereq(rid, p, sampling=greedy(30)) for rid, p in prompts.items()])
    for _ in range(6):
        h.decode()
    buffer, codec = h.runner.buffer, h.pool.codec
    assert buffer.pending() == 6
    seen = {}
    for rid in prompts:
        row, cols = buffer.columns(rid)
        seen[rid] = [
            (k[row, :, cols.start : cols.stop], v[row, :, cols.start : cols.stop])
            for k, v in zip(buffer.kv.keys, buffer.kv.values)
        ]
        for k, _ in seen[rid]:  # a cast's round trip is exact; a quantized one's is not
            assert codec.quantized or mx.array_equal(codec.round_trip(k), k).item()
        for layer, parts in enumerate(buffer.quantized.parts if buffer.quantized else []):
            stored = [p[row, :, cols.start : cols.stop] for p in parts]
            assert mx.array_equal(h.pool.decode(stored)[0], seen[rid][layer][0]).item()
    h.release([ReleaseReq(rid, flush=True) for rid in prompts])
    for rid in prompts:
        idx = mx.array(h.slots[rid], dtype=mx.int32)
        for layer, (k, v) in enumerate(seen[rid]):
            got_k, got_v = h.pool.gather(layer, idx)
            assert mx.array_equal(got_k.transpose(1, 0, 2), k).item(), (rid, layer)
            assert mx.array_equal(got_v.transpose(1, 0, 2), v).item(), (rid, layer)


# ---------------------------------------------------------------- other dtypes


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "fp16", "bf16"])
def test_batched_equals_alone(small_model, kv_dtype):
    """The same tokens whether a request runs batched with others or alone: every read
    of the pool (prefix, decode buffer, its own new tokens) sees the stored values. Up to
    a near tie: batched and alone the matmuls round differently, and a stored code (or a
    16-bit value) can flip where a value sits on a boundary (docs/numerics.md)."""
    rng = random.Random(11)
    vocab = Harness(small_model, num_slots=16).vocab
    prompts = {f"r{i}": random_prompt(rng, n, vocab) for i, n in enumerate([9, 280, 64])}
    params = dataclasses.replace(greedy(10), logprobs=True, top_logprobs=2)
    sampling = dict.fromkeys(prompts, params)
    batched = generate(Harness(small_model, kv_cache_dtype=kv_dtype), prompts, 10, sampling)
    compared = 0
    for rid, prompt in prompts.items():
        h = Harness(small_model, kv_cache_dtype=kv_dtype)
        alone = generate(h, {rid: prompt}, 10, sampling)
        margins = [top2_margin(top) for top in h.top[rid]]
        compared += same_until_a_near_tie(batched[rid], alone[rid], margins, f"{kv_dtype} {rid}")
    assert compared >= 15  # of 30 tokens


# ---------------------------------------------------------------- serving


def test_a_head_dim_not_divisible_by_64_is_refused_with_one_line(tiny_model):
    from tests.server import RADIX_MLX

    out = subprocess.run(
        [RADIX_MLX, "serve", "--model-path", tiny_model, "--port", "1", "--kv-cache-dtype", "int4"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    refusals = [line for line in out.stderr.splitlines() if f"cannot serve {tiny_model}" in line]
    assert len(refusals) == 1, out.stderr
    assert "int4 quantizes groups of 64" in refusals[0] and "widths are 16" in refusals[0]


@pytest.mark.slow
def test_int8_server_reuses_a_quantized_prefix(small_model, tmp_path):
    """A real server with an int8 pool: the start-up log states the quantized pool, a
    repeated prompt is served from it and both answers match mlx-lm's quantized tokens."""
    from openai import OpenAI

    from tests.server import ServerProcess

    server = ServerProcess(small_model, tmp_path / "server.log", extra=["--kv-cache-dtype", "int8"])
    server.start()
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="none")
        prompt = random_prompt(random.Random(2), 300, 400)
        answers = []
        for _ in range(2):
            r = client.completions.create(
                model=server.model, prompt=prompt, max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            answers.append(r)
        assert answers[1].usage.prompt_tokens_details.cached_tokens == 299
        # the cached answer recomputes the last prompt token alone, the cold one in a pass
        # of 44: their rounding differs, and a code can flip (docs/numerics.md), so each
        # is held to mlx-lm's quantized tokens by the near-tie rule, not to the other
        for a in answers:
            assert_matches_quantized(small_model, prompt, a.choices[0].model_extra["token_ids"])
        log = server.log()
        per_slot = 4 * 2 * 2 * (64 + 2 * 4)
        assert f"x {per_slot} bytes" in log and "stored as int8 (group 64)" in log, log[-2000:]
    finally:
        server.stop()


@pytest.mark.parametrize("arch", ["mistral_swa", "qwen3_5"])
def test_windows_and_recurrent_layers_run_batched_on_an_int8_pool(model_cache, arch):
    """Sliding-window layers (mlx-lm has no quantized rotating cache to compare with) and
    a hybrid's attention layers store int8 KV, the recurrent states stay as they are: the
    start-up self-check runs them batched, and batched they give the tokens they give one
    by one, up to the first near tie (this test's rounding differs between OpenBLAS's
    kernels: with Haswell's, mistral_swa's batched and solo logprobs differ by 7e-3 after
    one int8 code flips; worker_mlx/self_check.py says why)."""
    from common.tiny_model import ensure_tiny_model
    from worker_mlx.model_probe import probe_layout
    from worker_mlx.self_check import choose_batching, run_pair

    path = str(ensure_tiny_model(model_cache, preset="small", arch=arch))
    model, _ = load_model(path)
    kv, states = probe_layout(model)
    assert (kv.head_dim, bool(kv.windows), states is not None) == (
        64,
        arch == "mistral_swa",
        arch == "qwen3_5",
    )
    int8 = dataclasses.replace(kv, kv_cache_dtype="int8")
    assert choose_batching(model, int8, 512, True, 256, states, False) == (True, True)
    run = dict(
        compile_decode=True, prefill_step=256, state_layout=states, pad_prefill=True,
        pipeline_stage=False, decode_steps=14,
    )  # fmt: skip
    batched = run_pair(model, int8, 512, batched=True, **run)
    alone = run_pair(model, int8, 512, batched=False, **run)
    compared = 0
    for row in range(2):
        got = [step.next_token_ids[row] for step in batched]
        want = [step.next_token_ids[row] for step in alone]
        margins = [top2_margin(step.top_logprobs[row]) for step in alone]
        compared += same_until_a_near_tie(got, want, margins, f"{arch} row {row}")
    assert compared >= 12  # of 30 tokens


def top2_margin(top: list) -> float:
    """The logprob margin between a step's top two tokens ([token, logprob] pairs)."""
    first, second = sorted((lp for _, lp in top), reverse=True)[:2]
    return first - second


SELF_CHECK = """
import dataclasses, sys
from worker_mlx.backends.blas import preload_openblas
print(preload_openblas())
from mlx_lm import load
from worker_mlx.model_probe import probe_layout
from worker_mlx.self_check import choose_batching
model, _ = load(sys.argv[1])
kv, states = probe_layout(model)
int8 = dataclasses.replace(kv, kv_cache_dtype="int8")
print(choose_batching(model, int8, 512, True, 256, states, False))
"""


def kernel_sets() -> list[str]:
    """The OpenBLAS x86 kernel sets this CPU can run (Haswell's need AVX2 and FMA)."""
    from worker_mlx.backends.blas import x86_coretype

    own = x86_coretype()
    return sorted({own, "Haswell"} - {None}) if own else []


@pytest.mark.parametrize("coretype", kernel_sets() or ["none"])
def test_the_int8_self_check_holds_on_every_kernel_set(model_cache, coretype):
    """The start-up self-check on an int8 pool picks the batched path under each OpenBLAS
    kernel set this CPU runs: Haswell's is what an AMD Zen 3 EPYC runs, where it had
    picked requests one by one (a flipped code, docs/numerics.md). The kernel set is
    chosen when OpenBLAS loads, hence a process per kernel set."""
    import os
    import sys

    from common.tiny_model import ensure_tiny_model

    if coretype == "none":
        pytest.skip("not an x86-64 CPU with AVX2: OpenBLAS picks its own kernels")
    path = str(ensure_tiny_model(model_cache, preset="small", arch="mistral_swa"))
    env = dict(os.environ, OPENBLAS_CORETYPE=coretype)
    out = subprocess.run(
        [sys.executable, "-c", SELF_CHECK, path], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    blas, choice = out.stdout.strip().splitlines()[-2:]
    assert coretype in blas and choice == "(True, True)", out.stdout
