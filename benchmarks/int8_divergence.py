"""Where an int8 pool's greedy tokens leave mlx-lm's quantized generation, and why.

    python -m benchmarks.int8_divergence [--model-path P] [--prompts 80] [--prompt-len 9]
        [--tokens 40] [--bits 8]

For each random prompt it runs one request through the worker's ModelRunner on a
quantized pool and mlx-lm's `generate_step` with `QuantizedKVCache(64, bits)` on every
layer. Where the tokens first differ it prints the reference's top-2 logprob margin there,
how many stored K/V codes the two hold differently among the tokens both computed (and
the earliest: layer, token position), and for a prompt key the float values each side
quantized and how far ours sat from the code boundary. The default model is the small
Llama with a BOS (`python -m common.tiny_model --arch llama --bos --preset small`).

docs/numerics.md holds what it found on two OpenBLAS kernel sets.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import random

from worker_mlx.backends.blas import preload_openblas

BLAS = preload_openblas()

import mlx.core as mx  # noqa: E402
import mlx_lm.models.cache as mlx_cache  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

from common.messages import DecodeBatch, ExtendBatch, ExtendReq, ReleaseReq, SamplingParams  # noqa: E402
from common.tiny_model import ensure_tiny_model  # noqa: E402
from worker_mlx import kv_codec  # noqa: E402
from worker_mlx.kv_pool import MlxKVPool  # noqa: E402
from worker_mlx.model_probe import probe_kv_layout  # noqa: E402
from worker_mlx.model_runner import ModelRunner  # noqa: E402

GROUP = kv_codec.GROUP_SIZE


def spy(cls, name: str, record: list, arg: int):
    """Wrap `cls.name` so that every call appends its `arg`-th argument to `record`."""
    orig = getattr(cls, name)

    @functools.wraps(orig)
    def wrapper(*args):
        record.append(np.array(args[arg]))
        return orig(*args)

    setattr(cls, name, wrapper)


def ours(model, layout, vocab: int, prompt: list[int], n: int) -> tuple[list[int], list, list]:
    """Greedy tokens of one request on a pool stored as `layout` says, the float K of
    each layer as the prefill encoded it (per layer: (positions, heads, dim)), and the
    codes the pool holds (per layer: K and V codes, (positions, heads, packed bytes))."""
    record: list = []
    spy(kv_codec.QuantizedCodec, "encode", record, 1)
    try:
        runner = ModelRunner(model, MlxKVPool(layout, len(prompt) + n + 1), vocab)
        params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
        slots = iter(range(1, len(prompt) + n + 2))
        req = ExtendReq("a", prompt, [], [next(slots) for _ in prompt], params)
        tokens = runner.extend(ExtendBatch(0, [req])).next_token_ids
        for step in range(1, n):
            tokens += runner.decode(DecodeBatch(step, ["a"], [next(slots)])).next_token_ids
        runner.release([ReleaseReq("a", flush=True)])
    finally:
        kv_codec.QuantizedCodec.encode = kv_codec.QuantizedCodec.encode.__wrapped__
    stored = mx.arange(1, len(prompt) + n, dtype=mx.int32)
    codes = [
        (np.array(parts[0][stored]).view(np.uint8), np.array(parts[3][stored]).view(np.uint8))
        for parts in runner.pool.parts
    ]
    return tokens, keys_by_layer(record, layout.num_layers, len(prompt)), codes


def keys_by_layer(record: list, layers: int, prompt_len: int) -> list:
    """The prefill's pool writes: per layer, K then V of shape (prompt_len, H, D)."""
    writes = [x for x in record if x.ndim == 3 and x.shape[0] == prompt_len]
    return [writes[2 * layer] for layer in range(layers)]


def reference(model, prompt: list[int], n: int, bits: int) -> tuple[list, list, list, list]:
    """mlx-lm's greedy tokens, each step's top-2 margin, per layer the float K of its
    first prefill pass ((positions, heads, dim): the prompt but its last token), and the
    codes its caches hold, as `ours` returns them."""
    record: list = []
    spy(mlx_cache.QuantizedKVCache, "update_and_fetch", record, 1)
    cache = [mlx_cache.QuantizedKVCache(group_size=GROUP, bits=bits) for _ in model.layers]
    tokens, margins = [], []
    try:
        for tok, logprobs in generate_step(
            mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, -1),
            prompt_cache=cache,
        ):  # fmt: skip
            top2 = mx.sort(logprobs)[-2:].tolist()
            tokens.append(int(tok))
            margins.append(top2[1] - top2[0])
    finally:
        cls = mlx_cache.QuantizedKVCache
        cls.update_and_fetch = cls.update_and_fetch.__wrapped__
    keys = [k[0].transpose(1, 0, 2) for k in record[: len(model.layers)]]
    codes = [
        tuple(np.array(x[0][0, :, : c.offset]).transpose(1, 0, 2).view(np.uint8) for x in kv)
        for c in cache
        for kv in [(c.keys, c.values)]
    ]
    return tokens, margins, keys, codes


def code_differences(mine: list, ref: list, positions: int) -> str:
    """How many stored codes of the first `positions` tokens differ, and the earliest."""
    count, first = 0, None
    for layer, pair in enumerate(zip(mine, ref)):
        for name, a, b in zip("KV", *pair):
            where = np.argwhere(a[:positions] != b[:positions])
            count += len(where)
            if len(where) and (first is None or where[0][0] < first[1]):
                first = (layer, int(where[0][0]), name)
    if first is None:
        return "every stored code is equal (attention's rounding alone moved the logits)"
    layer, position, name = first
    return f"{count} stored codes differ, the earliest layer {layer} {name} at position {position}"


def code(group: np.ndarray, dim: int, bits: int) -> int:
    q, _, _ = mx.quantize(mx.array(group[None]), group_size=GROUP, bits=bits)
    codes = np.array(q).view(np.uint8)[0]
    return int(codes[dim] if bits == 8 else (codes[dim // 2] >> (4 * (dim % 2))) & 15)


def first_code_difference(mine: list, ref: list, bits: int) -> str:
    """The first (layer, position, head, dim) whose prompt K code differs, and why."""
    for layer, (a, b) in enumerate(zip(mine, ref)):
        for pos in range(min(len(a), len(b))):
            for head in range(a.shape[1]):
                for g in range(a.shape[2] // GROUP):
                    x, y = a[pos, head, g * GROUP :][:GROUP], b[pos, head, g * GROUP :][:GROUP]
                    for d in range(GROUP):
                        cx, cy = code(x, d, bits), code(y, d, bits)
                        if cx != cy:
                            return describe_flip(layer, pos, head, g * GROUP + d, x, y, d, bits)
    return "no prompt key's code differs"


def describe_flip(layer, pos, head, dim, x, y, d, bits) -> str:
    """How far our value sat from the boundary the reference's crossed."""
    ts = np.linspace(0.0, 1.0, 1001)
    start = code(x, d, bits)
    t = next((t for t in ts if code(x + t * (y - x), d, bits) != start), 1.0)
    return (
        f"layer {layer} K, position {pos}, head {head}, dim {dim}: code {start} (ours) vs "
        f"{code(y, d, bits)}; floats {x[d]:.9f} vs {y[d]:.9f} (group max diff "
        f"{np.abs(x - y).max():.1e}); the boundary lies {t * abs(y[d] - x[d]):.1e} from ours"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path")
    ap.add_argument("--prompts", type=int, default=80)
    ap.add_argument("--prompt-len", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--bits", type=int, default=8, choices=[8, 4])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    path = args.model_path or str(ensure_tiny_model(preset="small", arch="llama", bos=True))
    model, _ = load(path)
    layout = dataclasses.replace(probe_kv_layout(model), kv_cache_dtype=f"int{args.bits}")
    vocab = int(model(mx.array([[0]])).shape[-1])
    print(f"BLAS: {BLAS}; model {path}; int{args.bits}, {args.prompts} prompts")
    rng, diverged, margins_at = random.Random(args.seed), 0, []
    for i in range(args.prompts):
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
        got, mine, my_codes = ours(model, layout, vocab, prompt, args.tokens)
        want, margins, ref, ref_codes = reference(model, prompt, args.tokens, args.bits)
        if got == want:
            continue
        step = next(s for s, (a, b) in enumerate(zip(got, want)) if a != b)
        diverged += 1
        margins_at.append(margins[step])
        print(
            f"prompt {i}: first differs at token {step}, reference top-2 margin there "
            f"{margins[step]:.4f} (smallest before it {min(margins[: step + 1]):.4f}); "
            + code_differences(my_codes, ref_codes, len(prompt) + step)
            + "; "
            + first_code_difference(mine, ref, args.bits)
        )
    worst = f", largest margin at a divergence {max(margins_at):.4f}" if margins_at else ""
    print(f"{diverged} of {args.prompts} prompts diverged{worst}")


if __name__ == "__main__":
    main()
