"""Load an mlx-lm model and build the runner and its KV pool from the server args."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import mlx.core as mx

from common.distributed_plan import PlanError
from common.messages import WorkerReady
from common.server_args import ServerArgs
from worker_mlx import memory
from worker_mlx.backends import select
from worker_mlx.distributed import Rank, agree_pool_size
from worker_mlx.distributed_shard import shard_model
from worker_mlx.draft_model import DraftModel
from worker_mlx.grammar import Grammars
from worker_mlx.headless import load_headless
from worker_mlx.kv_codec import GROUP_SIZE, QUANTIZED_BITS
from worker_mlx.kv_pool import KVLayout, MlxKVPool, pool_size
from worker_mlx.lora import LoraBank, NoLora, make_bank
from worker_mlx.model_probe import UnsupportedModel, probe_layout
from worker_mlx.model_runner import ModelRunner, verifies_drafts
from worker_mlx.proposer import SchedulerDrafts
from worker_mlx.self_check import batched_path_works, choose_batching
from worker_mlx.speculation import Verifier
from worker_mlx.state_pool import StateLayout, StatePool, state_slots
from worker_mlx.vision_model import (
    VisionLanguageModel,
    is_vision_model,
    load_vision_model,
    read_config,
)
from worker_mlx.vision_pass import VisionPasses

logger = logging.getLogger("worker")


def load_runner(
    args: ServerArgs, blas: str, rank: Rank | None = None
) -> tuple[ModelRunner | Verifier, WorkerReady]:
    """The worker's engine: the runner, or a Verifier around it for a model that can
    verify drafts (with the draft model of --speculative-algorithm draft as its proposer,
    else the scheduler's n-gram drafts). `rank`: this process's place in a distributed
    worker (None: the worker is one process); the model is cut to its share and the pool
    holds that share."""
    backend = select(cpu_kernels=not args.disable_cpu_kernels)
    logger.info("backend %s; BLAS: %s", backend.describe(), blas)
    processes = args.dp_size * (rank.spec.ranks_on_host if rank is not None else 1)
    total = memory.budget(args.max_memory_bytes, backend, processes)  # before the weights
    on_cpu = backend.name == "cpu"  # the process's own memory is the budget's there
    model, tokenizer, config, (layout, state_layout) = _load_servable(args.model_path, rank)
    layout = _stored_as(args.model_path, layout, args.kv_cache_dtype)
    lora = _adapters(args, model, runtime=rank is None and args.speculative_algorithm == "none")
    context_len = args.context_length or int(config.get("max_position_embeddings") or 4096)
    # for the life of the process: the undo is for tests and benchmarks
    backend.install(model, context_len)
    backend.wire(mx.get_active_memory())
    vocab_size = _vocab_size(model, config)
    model_type = _model_type(model, config)
    _log_model(args.model_path, model_type, layout, vocab_size, context_len)
    draft = None
    if args.speculative_algorithm == "draft":
        _check_vision(args, model, batched=True)  # before the draft model loads
        draft = _load_draft(args, backend, tokenizer, vocab_size, context_len)
    step = args.prefill_step_size or backend.prefill_step
    figures = memory.step_figures(model, layout, state_layout, vocab_size, step)
    share = None
    if args.max_total_tokens is None:
        fraction = args.mem_fraction_static or backend.mem_fraction
        share = memory.pool_bytes(total, figures, fraction, on_cpu)
    pool, states = _make_pools(args, backend, layout, state_layout, share, draft, rank)
    compiled = backend.compile_decode
    stage = rank is not None and rank.spec.pp > 1
    batched, pad = choose_batching(model, layout, vocab_size, compiled, step, state_layout, stage)
    vision = _check_vision(args, model, batched)
    grammars = Grammars(tokenizer._tokenizer, vocab_size, sorted(tokenizer.eos_token_ids))
    proposer = SchedulerDrafts()
    if draft is not None:
        path = args.speculative_draft_model_path
        proposer = _drafter(path, pool, batched, vocab_size, step, compiled, *draft) or proposer
    held = memory.report(total, figures, on_cpu)
    runner = ModelRunner(
        model, pool, vocab_size, args.seed, batched, prefill_step=step, compile_decode=compiled,
        grammars=grammars, states=states, pad_prefill=pad, pipeline_stage=stage, memory=held,
        lora=lora, vision=vision,
    )  # fmt: skip
    engine = Verifier(runner, proposer) if runner.verifies_drafts else runner
    ready = WorkerReady(
        num_slots=pool.num_slots, model_type=model_type, num_layers=layout.num_layers,
        n_kv_heads=layout.n_kv_heads, head_dim=layout.head_dim,
        dtype=str(layout.dtype).rsplit(".", 1)[-1], context_len=context_len,
        vocab_size=vocab_size, eos_token_ids=sorted(tokenizer.eos_token_ids), blas=blas,
        num_state_slots=states.num_slots if states is not None else 0,
        verifies_drafts=runner.verifies_drafts, memory=memory.for_scheduler(held),
    )  # fmt: skip
    return engine, ready


def _check_vision(args: ServerArgs, model, batched: bool) -> VisionPasses | None:
    """A vision model's passes (None: a text model), refused where they cannot run: a text
    draft model cannot embed images, and solo steps know no per-row image offsets."""
    if not isinstance(model, VisionLanguageModel):
        return None
    if args.speculative_algorithm == "draft":
        _refuse(args.model_path, "a vision model takes no draft model (use ngram)")
    if not batched:
        _refuse(args.model_path, "a vision model must run batched with per-row offsets")
    return VisionPasses(model)


def _adapters(args: ServerArgs, model, runtime: bool) -> LoraBank | NoLora:
    """The --lora adapters, the model's adapted layers wrapped (the router checked them
    against the model's files; this is the check against its modules); with `runtime`, a
    bank that may load adapters while the worker serves (/admin/loras/load)."""
    try:
        lora = make_bank(model, args.loras, runtime)
    except (ValueError, KeyError, OSError) as exc:
        _refuse(args.model_path, f"--lora: {exc}")
    for spec in args.loras:
        logger.info("LoRA adapter %s: %s", spec.name, spec.path)
    return lora


def _load_draft(args: ServerArgs, backend, tokenizer, vocab_size: int, positions: int) -> tuple:
    """(model, layout) of --speculative-draft-model-path: refused unless its tokenizer is
    the target's, token for token, and its layers can verify drafts."""
    path = args.speculative_draft_model_path
    model, draft_tokenizer, config, (layout, state_layout) = _load_servable(path)
    ours, theirs = tokenizer._tokenizer.get_vocab(), draft_tokenizer._tokenizer.get_vocab()
    draft_vocab = _vocab_size(model, config)
    if ours != theirs or draft_vocab != vocab_size:
        differ = sum(theirs.get(t) != i for t, i in ours.items())
        _refuse(
            path,
            f"a draft model needs the target's vocabulary: {len(theirs)} tokens and "
            f"{draft_vocab} logits against the target's {len(ours)} and {vocab_size} "
            f"({differ} of the target's tokens have another id or none)",
        )
    if state_layout is not None or any(layout.windows):
        _refuse(path, "a draft model cannot have sliding windows or recurrent layers")
    backend.install(model, positions)  # the target's positions
    logger.info("draft model %s: %s", path, describe_layers(layout))
    return model, _stored_as(path, layout, args.kv_cache_dtype)


def _drafter(
    path: str, target_pool: MlxKVPool, batched: bool, vocab_size: int, step: int,
    compiled: bool, model, layout: KVLayout,
) -> DraftModel | None:  # fmt: skip
    """The draft's runner over its own pool of the target's size (the same slot ids);
    None if the target cannot verify drafts."""
    if not verifies_drafts(batched, target_pool.layout):
        logger.warning("this model cannot verify drafts: decoding without speculation")
        return None
    if not batched_path_works(model, layout, vocab_size, compiled, step):
        _refuse(path, "a draft model must run batched with per-row offsets")
    pool = MlxKVPool(layout, target_pool.num_slots)
    draft = ModelRunner(
        model, pool, vocab_size, batched=True, prefill_step=step, compile_decode=compiled
    )
    return DraftModel(draft)


def _make_pools(
    args: ServerArgs, backend, layout: KVLayout, state_layout: StateLayout | None,
    share: int | None, draft: tuple | None = None, rank: Rank | None = None,
) -> tuple[MlxKVPool, StatePool | None]:  # fmt: skip
    """The KV pool (--max-total-tokens, or `share` bytes: memory.pool_bytes, this process's
    part of --max-memory) and, for a model with recurrent layers, the state pool, whose
    share is taken first. With a draft model a slot costs both models' bytes (its pool has
    the same slots)."""
    extra = draft[1].bytes_per_slot if draft is not None else 0  # the draft's pool
    states = None
    if state_layout is not None:
        n = state_slots(state_layout, share, args.max_running_requests)
        states = StatePool(state_layout, n)
        logger.info(
            "state pool: %d slots x %d bytes = %.1f MiB (%d recurrent layers)",
            n, state_layout.bytes_per_slot, n * state_layout.bytes_per_slot / 2**20,
            state_layout.num_layers,
        )  # fmt: skip
    if share is None:
        num_slots, sizing = args.max_total_tokens, "--max-total-tokens"
    else:
        taken = 0 if states is None else states.num_slots * state_layout.bytes_per_slot
        num_slots = pool_size(layout, 1.0, share - taken, extra)
        fraction = args.mem_fraction_static or backend.mem_fraction
        sizing = f"{fraction:.0%} of what --max-memory leaves on {backend.name}"
    if rank is not None:
        num_slots = agree_pool_size(rank.group, num_slots)
        rank.log(num_slots)
    per_slot = layout.bytes_per_slot + extra
    logger.info(
        "KV pool: %d tokens x %d bytes%s = %.1f MiB, stored as %s (%s)",
        num_slots, per_slot, " (target + draft)" if draft is not None else "",
        num_slots * per_slot / 2**20, layout.codec.describe(), sizing,
    )  # fmt: skip
    return MlxKVPool(layout, num_slots), states


def _stored_as(path: str, layout: KVLayout, kv_cache_dtype: str) -> KVLayout:
    """The layout with the pool's storage (--kv-cache-dtype); a quantized pool needs every
    key and value width to split into groups of 64, as mlx-lm's quantized cache does."""
    if kv_cache_dtype in QUANTIZED_BITS:
        widths = layout.all_widths()
        if any(w % GROUP_SIZE for w in widths):
            shown = "/".join(str(w) for w in sorted(widths))
            _refuse(
                path,
                f"--kv-cache-dtype {kv_cache_dtype} quantizes groups of {GROUP_SIZE} along "
                f"the head dim, and this model's key/value widths are {shown}",
            )
    return dataclasses.replace(layout, kv_cache_dtype=kv_cache_dtype)


def _log_model(path: str, model_type: str, layout: KVLayout, vocab: int, context: int) -> None:
    if layout.layer_widths:
        widths = "key/value widths " + " ".join(f"{k}/{v}" for k, v in layout.layer_widths)
    elif layout.v_head_dim is None:
        widths = f"head dim {layout.head_dim}"
    else:
        widths = f"key width {layout.head_dim}, value width {layout.v_head_dim}"
    logger.info(
        "model %s: %s, dtype %s, %s, %d KV heads, %s, vocab %d, context %d",
        path, model_type, layout.dtype, describe_layers(layout), layout.n_kv_heads, widths,
        vocab, context,
    )  # fmt: skip


def _load_servable(path: str, rank: Rank | None = None):
    """mlx-lm's load (a rank's: lazily, cut to its share, then its weights loaded) and
    the probe of what its layers cache; a model the worker cannot serve ends the process
    with one line that says what was found. A vision-language model (its config has a
    `vision_config`) is mlx-vlm's, as a VisionLanguageModel (vision_model.py)."""
    from mlx_lm import load

    if is_vision_model(path):
        return _load_vision(path, rank)
    try:
        model, tokenizer, config = load(path, return_config=True, lazy=rank is not None)
    except Exception as exc:  # mlx-lm's own message names the model type it lacks
        loaded = load_headless(path, lazy=rank is not None)  # an embedding model's body?
        if loaded is None:
            _refuse(path, f"mlx-lm cannot load it: {exc}")
        model, tokenizer, config = loaded
    if rank is not None:
        try:
            rank.share = shard_model(model, rank.spec, rank.group)
        except PlanError as exc:
            _refuse(path, str(exc))
        mx.eval(model.parameters())
    try:
        return model, tokenizer, config, probe_layout(model)
    except UnsupportedModel as exc:
        _refuse(path, f"model type {_model_type(model, config)}: {exc}")


def _load_vision(path: str, rank: Rank | None):
    """A vision-language model through mlx-vlm, its tokenizer through mlx-lm's loader."""
    from mlx_lm.utils import load_tokenizer

    if rank is not None:
        _refuse(path, "a vision model runs in one worker process (no --tp-size/--pp-size)")
    try:
        model, _ = load_vision_model(path)
        probed = probe_layout(model)
    except UnsupportedModel as exc:
        _refuse(path, f"model type {_model_type(None, read_config(path))}: {exc}")
    except Exception as exc:  # mlx-vlm's own message names the model type it lacks
        _refuse(path, f"mlx-vlm cannot load it: {exc}")
    return model, load_tokenizer(Path(path)), read_config(path), probed


def _refuse(path: str, reason: str):
    logger.error("cannot serve %s: %s", path, reason)
    raise SystemExit(2)


def _model_type(model, config: dict) -> str:
    return config.get("model_type", type(model).__module__.rsplit(".", 1)[-1])


def describe_layers(layout: KVLayout) -> str:
    """What the layers attend, e.g. '4 attention layers (3 with a 16-token sliding window,
    1 global)' or '1 attention layer + 3 recurrent'."""
    n = layout.num_layers
    out = f"{n} attention layer{'s' if n != 1 else ''}"
    windows = sorted({w for w in layout.windows if w is not None})
    if windows:
        local = sum(w is not None for w in layout.windows)
        sizes = "/".join(str(w) for w in windows)
        out += f" ({local} with a {sizes}-token sliding window, {n - local} global)"
    if layout.recurrent:
        out += f" + {len(layout.recurrent)} recurrent"
    return out


def _vocab_size(model, config: dict) -> int:
    if "vocab_size" in config:
        return int(config["vocab_size"])
    logits = model(mx.array([[0]]))
    return int(logits.shape[-1])
