"""The prompt's own logprobs (OpenAI's echo + logprobs, lm-evaluation-harness's
loglikelihood): for each prompt token after the first, its logprob given the tokens
before it, and the best alternatives.

Computed for such requests only, after their last prefill chunk, by running the model
once more over the whole prompt without any cache: a cached prefix's positions were never
projected to the vocabulary (their hidden states are not kept, only their KV), so the
prompt is recomputed rather than read back, which makes every position, cached or not,
exactly what the plain model computes. The projection runs in blocks of positions, so a
long prompt never holds its (length x vocabulary) logits at once.
"""

from __future__ import annotations

import mlx.core as mx

from common.messages import ExtendReq
from worker_mlx.lora import NO_LORA
from worker_mlx.sampler import logprobs

BLOCK = 256  # positions projected to the vocabulary at a time


def prompt_logprobs(
    body, head, reqs: list[ExtendReq], rids: list[str], lora=NO_LORA
) -> list[list | None]:
    """Per sampled row (`rids`, the step's order): None, or the request's prompt logprobs
    as [[logprob, [[token_id, logprob], ...]], ...] for prompt tokens 1..n-1 (with its
    LoRA adapter from `lora`, the runner's bank)."""
    by_rid = {r.rid: r for r in reqs}
    return [_of(body, head, by_rid[rid], lora) if by_rid[rid].sampling.prompt_logprobs else None
            for rid in rids]  # fmt: skip


def _of(body, head, r: ExtendReq, lora) -> list:
    ids = r.context_ids + r.input_ids
    with lora.rows_of([r.lora]):
        hidden = body(mx.array([ids]))[0]
    targets = mx.array(ids[1:])
    top_n = r.sampling.top_logprobs
    out = []
    for start in range(0, len(ids) - 1, BLOCK):
        end = min(start + BLOCK, len(ids) - 1)
        chosen, top_ids, top_vals = logprobs(head(hidden[start:end]), targets[start:end], top_n)
        mx.eval(chosen, top_ids, top_vals)
        for c, row_ids, row_vals in zip(chosen.tolist(), top_ids.tolist(), top_vals.tolist()):
            out.append([c, [[i, v] for i, v in zip(row_ids, row_vals)]])
    return out
