"""What constrained decoding costs: the grammar engines' mask per step, and a constrained
decode step of the worker against an unconstrained one, at the same batch size.

    python -m benchmarks.grammar_mask [--preset small] [--batch-size 8] [--steps 64]

1. Mask cost: a batch of JSON-schema matchers, each step filling every row's token mask
   and advancing each by a token its mask allows, for llguidance (what the worker uses)
   and xgrammar (if installed), on the model's own tokenizer.
2. Decode step: ModelRunner on the model, the whole batch greedy, every row constrained
   by the schema, against the same batch unconstrained (with and without the lookahead
   the server runs for unconstrained greedy batches; constrained rows never look ahead).

Appends one JSON line to --out (bench_results/grammar_mask.jsonl).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from common.tiny_presets import PRESETS
from worker_mlx.backends.blas import preload_openblas

preload_openblas()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from common.messages import DecodeBatch, ExtendBatch, ExtendReq, ReleaseReq, SamplingParams  # noqa: E402

# Never finishes within the steps (no maxItems), so every step is constrained.
SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    },
}


def _allowed(words: np.ndarray, rng: np.random.Generator, vocab: int, eos: list[int]):
    """A random token the mask allows, never EOS (None when EOS is all it allows: the
    walk then starts the grammar again, so every step measured is a constrained one)."""
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab]
    bits[eos] = 0
    ids = np.flatnonzero(bits)
    return int(rng.choice(ids)) if len(ids) else None


def llguidance_mask_ms(hf_tokenizer, vocab: int, eos: list[int], batch: int, steps: int) -> float:
    import llguidance
    import llguidance.numpy as llg_np

    from common.grammar_spec import to_llguidance
    from worker_mlx.grammar import Grammars

    lltok = Grammars(hf_tokenizer, vocab, eos).lltokenizer
    grammar = to_llguidance("json_schema", json.dumps(SCHEMA))
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
    bitmask = llg_np.allocate_token_bitmask(batch, vocab)
    rng, times = np.random.default_rng(0), []
    for _ in range(steps):
        t = time.perf_counter()
        for i, m in enumerate(matchers):
            llg_np.fill_next_token_bitmask(m, bitmask, i)
        times.append(time.perf_counter() - t)
        for i, m in enumerate(matchers):
            token = _allowed(bitmask[i], rng, vocab, eos)
            m.reset() if token is None else m.consume_token(token)
    return 1e3 * statistics.median(times)


def xgrammar_mask_ms(hf_tokenizer, vocab: int, eos: list[int], batch: int, steps: int):
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    bitmask = xgr.allocate_token_bitmask(batch, vocab)
    rng, times = np.random.default_rng(0), []
    for _ in range(steps):
        t = time.perf_counter()
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)
        times.append(time.perf_counter() - t)
        words = bitmask.numpy()
        for i, m in enumerate(matchers):
            token = _allowed(words[i], rng, vocab, eos)
            m.reset() if token is None else m.accept_token(token)
    return 1e3 * statistics.median(times)


def decode_step_ms(runner, batch: int, steps: int, constrained: bool, overlap: bool, tag: str):
    """Median decode step of `batch` greedy requests (60-token prompts)."""
    grammar = {"grammar_kind": "json_schema", "grammar": json.dumps(SCHEMA)} if constrained else {}
    sampling = SamplingParams(max_new_tokens=1 << 20, temperature=0, ignore_eos=True, **grammar)
    slots = iter(range(1, runner.pool.num_slots + 1))
    reqs = [
        ExtendReq(f"{tag}{i}", [(7 * i + k) % 97 + 3 for k in range(60)], [],
                  [next(slots) for _ in range(60)], sampling)
        for i in range(batch)
    ]  # fmt: skip
    rids = [r.rid for r in reqs]
    runner.extend(ExtendBatch(0, reqs))
    times = []
    for step in range(steps):
        t = time.perf_counter()
        locs = [next(slots) for _ in rids]
        runner.decode(DecodeBatch(step + 1, rids, locs, lookahead=overlap and step + 1 < steps))
        runner.run_ahead()
        mx.eval(runner.pool.arrays())
        times.append(time.perf_counter() - t)
    runner.release([ReleaseReq(rid, flush=False) for rid in rids])
    return 1e3 * statistics.median(times[2:])


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from mlx_lm import load

    from common.tiny_model import ensure_tiny_model
    from worker_mlx.backends import select
    from worker_mlx.grammar import Grammars
    from worker_mlx.kv_pool import MlxKVPool
    from worker_mlx.model_probe import probe_kv_layout
    from worker_mlx.model_runner import ModelRunner

    path = args.model_path or str(ensure_tiny_model(preset=args.preset, arch="qwen3"))
    model, tokenizer = load(path)
    vocab = int(model(mx.array([[0]])).shape[-1])
    eos = sorted(tokenizer.eos_token_ids)
    hf = tokenizer._tokenizer
    bs, steps = args.batch_size, args.steps
    row = {"model": path, "vocab": vocab, "batch_size": bs}
    row["llguidance_mask_ms"] = llguidance_mask_ms(hf, vocab, eos, bs, steps)
    row["xgrammar_mask_ms"] = xgrammar_mask_ms(hf, vocab, eos, bs, steps)
    backend = select()
    uninstall = backend.install(model)
    try:
        pool = MlxKVPool(probe_kv_layout(model), bs * (60 + 3 * steps) + 8)
        runner = ModelRunner(
            model, pool, vocab, compile_decode=backend.compile_decode,
            grammars=Grammars(hf, vocab, eos),
        )  # fmt: skip
        decode_step_ms(runner, bs, 8, False, False, "warm")
        for name, constrained, overlap in (
            ("unconstrained_overlap_ms", False, True),
            ("unconstrained_ms", False, False),
            ("constrained_ms", True, False),
        ):
            row[name] = min(
                decode_step_ms(runner, bs, steps, constrained, overlap, name) for _ in range(3)
            )
    finally:
        uninstall()  # stock mlx-lm functions again: the caller's process (a test) goes on
    row["constrained_vs_unconstrained"] = row["constrained_ms"] / row["unconstrained_ms"]
    row["constrained_vs_overlap"] = row["constrained_ms"] / row["unconstrained_overlap_ms"]
    for key, value in row.items():
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="model dir (default: --preset)")
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--out", default="bench_results/grammar_mask.jsonl")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
