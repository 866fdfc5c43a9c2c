"""Load an mlx-lm model and build the runner and its KV pool from the server args."""

from __future__ import annotations

import logging

import mlx.core as mx

from common.messages import DecodeBatch, ExtendBatch, ExtendReq, SamplingParams, WorkerReady
from common.server_args import ServerArgs
from worker_mlx.backends import select
from worker_mlx.grammar import Grammars
from worker_mlx.kv_pool import KVLayout, MlxKVPool, pool_size
from worker_mlx.model_probe import UnsupportedModel, probe_kv_layout
from worker_mlx.model_runner import ModelRunner

logger = logging.getLogger("worker")


def load_runner(args: ServerArgs, blas: str) -> tuple[ModelRunner, WorkerReady]:
    backend = select(cpu_kernels=not args.disable_cpu_kernels)
    logger.info("backend %s; BLAS: %s", backend.describe(), blas)
    model, tokenizer, config, layout = _load_servable(args.model_path)
    backend.install(model)  # for the life of the process: the undo is for tests and benchmarks
    fraction = args.mem_fraction_static or backend.mem_fraction
    if args.max_total_tokens is not None:
        num_slots, sizing = args.max_total_tokens, "--max-total-tokens"
    else:
        budget = backend.memory_budget()
        num_slots = pool_size(layout, fraction, budget)
        sizing = f"{fraction:.0%} of {budget / 2**30:.1f} GiB, the {backend.name} budget"
    pool = MlxKVPool(layout, num_slots)
    vocab_size = _vocab_size(model, config)
    context_len = args.context_length or int(config.get("max_position_embeddings") or 4096)
    model_type = _model_type(model, config)
    logger.info(
        "model %s: %s, dtype %s, %s, %d KV heads, %s, vocab %d, context %d",
        args.model_path,
        model_type,
        layout.dtype,
        describe_layers(layout),
        layout.n_kv_heads,
        f"head dim {layout.head_dim}"
        if layout.v_head_dim is None
        else f"key width {layout.head_dim}, value width {layout.v_head_dim}",
        vocab_size,
        context_len,
    )
    logger.info(
        "KV pool: %d tokens x %d bytes = %.1f MiB (%s)",
        num_slots,
        layout.bytes_per_slot,
        num_slots * layout.bytes_per_slot / 2**20,
        sizing,
    )
    step = args.prefill_step_size or backend.prefill_step
    compiled = backend.compile_decode
    batched = batched_path_works(model, layout, vocab_size, compiled, prefill_step=step)
    if not batched:
        logger.warning(
            "this model's attention cannot run batched with per-row offsets: every request "
            "runs as its own batch (correct, but slower)"
        )
    grammars = Grammars(tokenizer._tokenizer, vocab_size, sorted(tokenizer.eos_token_ids))
    runner = ModelRunner(
        model, pool, vocab_size, args.seed, batched, prefill_step=step, compile_decode=compiled,
        grammars=grammars,
    )  # fmt: skip
    ready = WorkerReady(
        num_slots=num_slots,
        model_type=model_type,
        num_layers=layout.num_layers,
        n_kv_heads=layout.n_kv_heads,
        head_dim=layout.head_dim,
        dtype=str(layout.dtype).rsplit(".", 1)[-1],
        context_len=context_len,
        vocab_size=vocab_size,
        eos_token_ids=sorted(tokenizer.eos_token_ids),
        blas=blas,
    )
    return runner, ready


def _load_servable(path: str):
    """mlx-lm's load and the probe of what its layers cache; a model the worker cannot
    serve ends the process with one line that says what was found."""
    from mlx_lm import load

    try:
        model, tokenizer, config = load(path, return_config=True)
    except Exception as exc:  # mlx-lm's own message names the model type it lacks
        _refuse(path, f"mlx-lm cannot load it: {exc}")
    try:
        return model, tokenizer, config, probe_kv_layout(model)
    except UnsupportedModel as exc:
        _refuse(path, f"model type {_model_type(model, config)}: {exc}")


def _refuse(path: str, reason: str):
    logger.error("cannot serve %s: %s", path, reason)
    raise SystemExit(2)


def _model_type(model, config: dict) -> str:
    return config.get("model_type", type(model).__module__.rsplit(".", 1)[-1])


def describe_layers(layout: KVLayout) -> str:
    """'4 layers' or '4 layers (3 with a 16-token window, 1 global)'."""
    n = layout.num_layers
    windows = sorted({w for w in layout.windows if w is not None})
    if not windows:
        return f"{n} layers"
    local = sum(w is not None for w in layout.windows)
    sizes = "/".join(str(w) for w in windows)
    return f"{n} layers ({local} with a {sizes}-token sliding window, {n - local} global)"


def batched_path_works(
    model, layout, vocab_size: int, compile_decode: bool = False, prefill_step: int = 256
) -> bool:
    """Run two requests batched and one by one; the batched path must agree to be used.
    (It also traces and JIT-builds the compiled decode step before the first request.)"""
    params = SamplingParams(max_new_tokens=4, temperature=0, logprobs=True, top_logprobs=4)
    prompts = [[(7 * i + 3) % vocab_size for i in range(9)], [5 % vocab_size, 11 % vocab_size]]
    outputs = []
    for batched in (True, False):
        runner = ModelRunner(
            model, MlxKVPool(layout, 64), vocab_size, batched=batched,
            prefill_step=prefill_step, compile_decode=compile_decode,
        )  # fmt: skip
        slots = iter(range(1, 65))
        reqs = [
            ExtendReq(f"r{i}", p, [], [next(slots) for _ in p], params)
            for i, p in enumerate(prompts)
        ]
        try:
            steps = [runner.extend(ExtendBatch(0, reqs))]
            for step in range(1, 3):
                locs = [next(slots) for _ in reqs]
                steps.append(runner.decode(DecodeBatch(step, ["r0", "r1"], locs)))
        except Exception as exc:
            logger.info("batched self-check raised: %s", exc)
            return False
        outputs.append(steps)
    for b, s in zip(*outputs):
        if b.next_token_ids != s.next_token_ids:
            return False
        if any(abs(x - y) > 1e-3 for x, y in zip(b.logprobs, s.logprobs)):
            return False
    return True


def _vocab_size(model, config: dict) -> int:
    if "vocab_size" in config:
        return int(config["vocab_size"])
    logits = model(mx.array([[0]]))
    return int(logits.shape[-1])
