"""Load an mlx-lm model and build the runner and its KV pool from the server args."""

from __future__ import annotations

import logging

import mlx.core as mx

from common.messages import WorkerReady
from common.server_args import ServerArgs
from worker_mlx.kv_pool import MlxKVPool, pool_size
from worker_mlx.model_runner import ModelRunner, probe_kv_layout

logger = logging.getLogger("worker")


def load_runner(args: ServerArgs, blas: str) -> tuple[ModelRunner, WorkerReady]:
    from mlx_lm import load

    model, tokenizer, config = load(args.model_path, return_config=True)
    layout = probe_kv_layout(model)
    num_slots = pool_size(layout, args.max_total_tokens, args.mem_fraction_static)
    pool = MlxKVPool(layout, num_slots)
    vocab_size = _vocab_size(model, config)
    context_len = args.context_length or int(config.get("max_position_embeddings") or 4096)
    model_type = config.get("model_type", type(model).__module__.rsplit(".", 1)[-1])
    logger.info(
        "model %s: %s, dtype %s, %d layers, %d KV heads, head dim %d, vocab %d, context %d",
        args.model_path,
        model_type,
        layout.dtype,
        layout.num_layers,
        layout.n_kv_heads,
        layout.head_dim,
        vocab_size,
        context_len,
    )
    logger.info(
        "KV pool: %d tokens x %d bytes = %.1f MiB; BLAS: %s",
        num_slots,
        layout.bytes_per_slot,
        num_slots * layout.bytes_per_slot / 2**20,
        blas,
    )
    runner = ModelRunner(model, pool, vocab_size, seed=args.seed)
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


def _vocab_size(model, config: dict) -> int:
    if "vocab_size" in config:
        return int(config["vocab_size"])
    logits = model(mx.array([[0]]))
    return int(logits.shape[-1])
