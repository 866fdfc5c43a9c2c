"""A decoding request's `Decoding` in the worker and the sampling that advances it.

From its last prefill chunk to its release a request has a `Decoding`: its sampling
state (PRNG key, penalties, grammar matcher) and its last token ("state" alone means a
recurrent layer's state, and where a request's KV is belongs to the KVLedger). Each step
samples one token per row from the logits with its Decoding (`sample_and_record`) and
records the token in it; a verify step takes the rows' keys (`step_keys`) for its own
acceptance rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from common.messages import ExtendReq, SamplingParams
from worker_mlx.grammar import Grammars, advance
from worker_mlx.sampler import KeySource, Penalty, apply_penalties, logprobs, sample


@dataclass
class Decoding:
    rid: str  # (where its KV is, slots and recurrent state slot: the runner's KVLedger)
    sampling: SamplingParams
    last_token: int
    key: mx.array | None
    penalty: Penalty | None = None
    grammar: object | None = None  # its llguidance matcher, if the request is constrained
    lora: int = 0  # its LoRA adapter's index in the runner's bank (0: none)

    @classmethod
    def for_extend(cls, r: ExtendReq, keys: KeySource, grammars: Grammars | None) -> Decoding:
        """The Decoding of a request whose last prefill chunk `r` is (its token not sampled)."""
        key = None
        if not r.sampling.greedy:
            key = keys.request_key(r.sampling.seed, len(r.output_ids))
        penalty = Penalty.for_request(r.sampling, r.context_ids + r.input_ids, r.output_ids)
        decoding = cls(r.rid, r.sampling, -1, key, penalty, lora=r.lora)
        if r.sampling.grammar_kind:
            if grammars is None:
                raise ValueError(f"{r.rid}: this worker has no tokenizer for grammars")
            decoding.grammar = grammars.matcher(r.sampling, r.output_ids)
        return decoding


@dataclass
class StepOutput:
    rids: list[str]
    next_token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list] | None = None
    prompt_logprobs: list | None = None
    accepted: list[int] | None = None  # drafts kept per row, after a verify step
    # as StepResult's: the worker's draft model's drafts, and its guesses for rows that
    # did not draft
    proposed: list[list[int]] | None = None
    guesses: list[int | None] | None = None


def sample_and_record(
    logits: mx.array,
    decodings: list[Decoding],
    buffers: list[mx.array],
    grammars: Grammars | None,
) -> StepOutput:
    """Sample one token per row, overlap host work with the step, record the results."""
    logits = apply_penalties(logits, [s.penalty for s in decodings])
    matchers = [s.grammar for s in decodings]
    if any(matchers):
        mx.async_eval(logits)  # the step runs while the masks are computed
        logits = grammars.constrain(logits, matchers)
    next_tok = sample(logits, [s.sampling for s in decodings], step_keys(decodings))
    top_n = max((s.sampling.top_logprobs for s in decodings if s.sampling.logprobs), default=-1)
    lp = logprobs(logits, next_tok, top_n) if top_n >= 0 else ()
    mx.async_eval(next_tok, *lp, *buffers)
    out = StepOutput([s.rid for s in decodings], next_tok.tolist())
    advance(matchers, out.next_token_ids)
    for s, tok in zip(decodings, out.next_token_ids):
        s.last_token = tok
        if s.penalty is not None:
            s.penalty.observe(tok)
    if lp:
        chosen, ids, vals = (x.tolist() for x in lp)
        out.logprobs = [c if s.sampling.logprobs else 0.0 for s, c in zip(decodings, chosen)]
        out.top_logprobs = [
            [[i, v] for i, v in zip(row_ids, row_vals)][: s.sampling.top_logprobs]
            if s.sampling.logprobs else []
            for s, row_ids, row_vals in zip(decodings, ids, vals)
        ]  # fmt: skip
    return out


def step_keys(decodings: list[Decoding]) -> list[mx.array | None]:
    """This step's PRNG key per row (None for greedy rows); each row's key moves on."""
    keys = []
    for s in decodings:
        use = None
        if s.key is not None:
            s.key, use = KeySource.next(s.key)
        keys.append(use)
    return keys
