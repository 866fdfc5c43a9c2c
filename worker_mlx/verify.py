"""Speculative decoding's acceptance rule: which of a row's draft tokens the model keeps.

A verify step computes the logits after a row's last token and after each of its k
drafts (S = k + 1 positions, right-padded to the batch's longest). Greedy rows keep the
longest prefix of drafts equal to the model's argmax and then take the argmax after it,
so the tokens are exactly those of plain greedy decoding. Sampled rows use the standard
rejection rule for a point-mass draft (Leviathan et al. 2023, with q = the draft's
one-hot): draft t at a position is kept with probability p(t) under the row's filtered
distribution p there; the first one rejected is replaced by a sample from p with t
removed and renormalised; if all are kept, the next token is sampled from p after the
last. The output distribution is then p's, as without speculation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from common.messages import DecodeBatch, SamplingParams
from worker_mlx.decoding import Decoding, StepOutput, sample_and_record, step_keys
from worker_mlx.sampler import NEG_INF, filter_logits

MAX_DRAFTS = 16  # per row and step, as --speculative-num-draft-tokens allows

if TYPE_CHECKING:
    from worker_mlx.grammar import Grammars


def verify(
    logits: mx.array,
    drafts: list[list[int]],
    params: list[SamplingParams],
    keys: list[mx.array | None],
) -> tuple[list[int], list[int]]:
    """(accepted draft count, next token) per row of `logits` (B, S, V), whose row b
    holds the logits after its last token and its `drafts[b]`; `keys[b]` is row b's PRNG
    key for this step (None if greedy)."""
    greedy = mx.argmax(logits, axis=-1).tolist()  # (B, S)
    accepted, nxt = [], []
    for b, (draft, p) in enumerate(zip(drafts, params)):
        if p.greedy:
            a = _matching(greedy[b], draft)
            accepted.append(a)
            nxt.append(greedy[b][a])
        else:
            a, tok = _rejection_sample(logits[b, : len(draft) + 1], draft, p, keys[b])
            accepted.append(a)
            nxt.append(tok)
    return accepted, nxt


def _matching(argmax: list[int], draft: list[int]) -> int:
    """How many leading drafts equal the model's own choice at their position."""
    a = 0
    while a < len(draft) and argmax[a] == draft[a]:
        a += 1
    return a


def _rejection_sample(
    logits: mx.array, draft: list[int], p: SamplingParams, key: mx.array
) -> tuple[int, int]:
    """Accepted count and next token of one sampled row, logits (k + 1, V)."""
    scaled = mx.stack([filter_logits(row / p.temperature, p) for row in logits.astype(mx.float32)])
    k_accept, k_noise = mx.random.split(key)
    k = len(draft)
    noise = mx.random.gumbel(shape=scaled.shape, key=k_noise)
    # the candidate at each position, as if its draft were rejected there (the draft
    # removed; the last position has none) ...
    ids = mx.array(draft + [-1], dtype=mx.int32)
    removed = mx.where(mx.arange(scaled.shape[1])[None, :] == ids[:, None], NEG_INF, scaled)
    residual = mx.argmax(removed + noise, axis=-1)
    # ... and whether each draft is kept: u < p(draft)
    probs = mx.softmax(scaled, axis=-1)
    keep = []
    if k:
        p_draft = mx.take_along_axis(probs[:k], ids[:k, None], axis=-1)[:, 0]
        keep = (mx.random.uniform(shape=(k,), key=k_accept) < p_draft).tolist()
    residual = residual.tolist()
    a = 0
    while a < k and keep[a]:
        a += 1
    return a, residual[a]


def accept(
    logits: mx.array, drafts: list[list[int]], decodings: list[Decoding], grammars: Grammars | None
) -> StepOutput:
    """The output of a verify step's logits (B, S, V): drafted rows by `verify`, the
    others sampled from their first position as in a plain step."""
    drafted = [i for i, d in enumerate(drafts) if d]
    plain = [i for i, d in enumerate(drafts) if not d]
    n = len(decodings)
    out = StepOutput([s.rid for s in decodings], [0] * n, accepted=[0] * n)
    if plain:
        rows = [decodings[i] for i in plain]
        sampled = sample_and_record(logits[mx.array(plain), 0], rows, [], grammars)
        if sampled.logprobs is not None:
            out.logprobs, out.top_logprobs = [0.0] * n, [[] for _ in decodings]
        for j, i in enumerate(plain):
            out.next_token_ids[i] = sampled.next_token_ids[j]
            if sampled.logprobs is not None:
                out.logprobs[i] = sampled.logprobs[j]
                out.top_logprobs[i] = sampled.top_logprobs[j]
    if drafted:
        rows = [decodings[i] for i in drafted]
        accepted, nxt = verify(
            logits[mx.array(drafted)], [drafts[i] for i in drafted],
            [s.sampling for s in rows], step_keys(rows),
        )  # fmt: skip
        for i, a, tok, s in zip(drafted, accepted, nxt, rows):
            out.accepted[i], out.next_token_ids[i], s.last_token = a, tok, tok
    return out


def check_drafts(batch: DecodeBatch, vocab_size: int, num_slots: int, has_drafter: bool) -> None:
    """A descriptor's drafts must fit its rows, the vocabulary and the pool; a worker
    with a draft model (`has_drafter`) is asked for drafts (`worker_drafts`) with slots
    alone, and makes as many tokens; one without is sent the tokens."""
    worker_drafts = batch.worker_drafts
    if has_drafter and not worker_drafts:
        raise ValueError("this worker drafts with its draft model: send slots, no tokens")
    if worker_drafts and not has_drafter:
        raise ValueError("this worker has no draft model: send the draft tokens")
    n = len(batch.rids)
    if len(batch.drafts) != n or len(batch.draft_slots) != n:
        raise ValueError(f"{n} requests but {len(batch.drafts)} draft lists")
    for d, slots in zip(batch.drafts, batch.draft_slots):
        if len(slots) > MAX_DRAFTS:
            raise ValueError(f"{len(slots)} draft slots in a row: at most {MAX_DRAFTS}")
        if worker_drafts and d:
            raise ValueError("worker_drafts: send slots, no tokens")
        if not worker_drafts and len(d) != len(slots):
            raise ValueError(f"{len(d)} draft tokens but {len(slots)} slots")
        if d and (min(d) < 0 or max(d) >= vocab_size):
            raise ValueError(f"draft token id outside the vocabulary [0, {vocab_size})")
        if slots and (min(slots) < 1 or max(slots) > num_slots):
            raise ValueError(f"draft slot id outside the pool [1, {num_slots}]")
