"""The start-up self-check: may requests of this model run together in one batch?

Two prompts (one right-padded by 18 tokens in the shared prefill pass) run batched and
one by one; the batched path is used only when they agree, tokens and logprobs. What this
checks is a property of the model's attention code (right-padded rows, per-row offsets,
masks), not of how the pool stores K/V, so it compares on a pool in the model's own dtype.

Why not on the pool as configured: a quantized (or fp16/bf16) pool's codec is applied per
token, the same computation batched or not, but quantizing turns a batched matmul's
last-bit rounding into a whole code step wherever a value sits on a rounding boundary.
With OpenBLAS's Haswell kernels (AMD Zen 3) the tiny mistral_swa model's batched and solo
K differ by 1e-5 in layer 1, one of its int8 codes flips (a value 1e-6 either side of a
half step), and layers 2 and 3 then differ in 17 and 73 codes: 7e-3 in logprobs, over the
check's 1e-3, where the float pool agrees to 2e-6. The configured pool still runs its
batched path once, so that a codec path that raises is caught and its compiled decode
step is traced before the first request.
"""

from __future__ import annotations

import dataclasses
import logging

from common.messages import DecodeBatch, ExtendBatch, ExtendReq, SamplingParams
from worker_mlx.kv_pool import KVLayout, MlxKVPool
from worker_mlx.model_runner import ModelRunner
from worker_mlx.state_pool import StateLayout, StatePool

logger = logging.getLogger("worker")

LOGPROB_TOLERANCE = 1e-3


def choose_batching(
    model, layout, vocab_size, compiled, step, state_layout, stage
) -> tuple[bool, bool]:
    """(batched, pad_prefill): the fastest way of running requests together that the
    self-check finds exact."""
    check = dict(prefill_step=step, state_layout=state_layout, pipeline_stage=stage)
    if batched_path_works(model, layout, vocab_size, compiled, **check):
        return True, True
    if batched_path_works(model, layout, vocab_size, compiled, pad_prefill=False, **check):
        logger.info(
            "prefill rows of different lengths run in separate passes: this model's "
            "recurrent layers cannot take right-padded rows (decode stays batched)"
        )
        return True, False
    logger.warning(
        "this model's attention cannot run batched with per-row offsets: every request "
        "runs as its own batch (correct, but slower)"
    )
    return False, True


def batched_path_works(
    model, layout: KVLayout, vocab_size: int, compile_decode: bool = False,
    prefill_step: int = 256, state_layout: StateLayout | None = None,
    pad_prefill: bool = True, pipeline_stage: bool = False,
) -> bool:  # fmt: skip
    """Whether `model` runs two requests batched as it runs them one by one (see the
    module's docstring); this also traces and JIT-builds the compiled decode step."""
    run = dict(
        compile_decode=compile_decode, prefill_step=prefill_step, state_layout=state_layout,
        pad_prefill=pad_prefill, pipeline_stage=pipeline_stage,
    )  # fmt: skip
    exact = dataclasses.replace(layout, kv_cache_dtype="auto")
    batched = run_pair(model, exact, vocab_size, batched=True, **run)
    alone = run_pair(model, exact, vocab_size, batched=False, **run)
    if batched is None or alone is None or not _agree(batched, alone):
        return False
    if exact != layout:
        return run_pair(model, layout, vocab_size, batched=True, **run) is not None
    return True


def _agree(batched: list, alone: list) -> bool:
    for b, s in zip(batched, alone):
        if b.next_token_ids != s.next_token_ids:
            return False
        if any(abs(x - y) > LOGPROB_TOLERANCE for x, y in zip(b.logprobs, s.logprobs)):
            return False
    return True


def run_pair(
    model, layout: KVLayout, vocab_size: int, batched: bool, compile_decode: bool,
    prefill_step: int, state_layout: StateLayout | None, pad_prefill: bool,
    pipeline_stage: bool, decode_steps: int = 2,
) -> list | None:  # fmt: skip
    """The check's two requests, a prefill and `decode_steps` decode steps (each step's
    StepResult, with logprobs and the top 2); None if it raised."""
    params = SamplingParams(
        max_new_tokens=decode_steps + 2, temperature=0, logprobs=True, top_logprobs=2
    )
    prompts = [[(7 * i + 3) % vocab_size for i in range(n)] for n in (39, 21)]
    states = StatePool(state_layout, 2) if state_layout is not None else None
    num_slots = sum(map(len, prompts)) + len(prompts) * decode_steps
    runner = ModelRunner(
        model, MlxKVPool(layout, num_slots), vocab_size, batched=batched, prefill_step=prefill_step,
        compile_decode=compile_decode, states=states, pad_prefill=pad_prefill,
        pipeline_stage=pipeline_stage,
    )  # fmt: skip
    slots = iter(range(1, num_slots + 1))
    reqs = []
    for i, p in enumerate(prompts):
        state_slot = i + 1 if states is not None else 0
        fresh = [next(slots) for _ in p]
        reqs.append(ExtendReq(f"r{i}", p, [], fresh, params, state_slot=state_slot))
    try:
        steps = [runner.extend(ExtendBatch(0, reqs))]
        for step in range(1, decode_steps + 1):
            fresh = [next(slots) for _ in reqs]
            steps.append(runner.decode(DecodeBatch(step, ["r0", "r1"], fresh)))
    except Exception as exc:
        logger.info("batched self-check raised: %s", exc)
        return None
    return steps
