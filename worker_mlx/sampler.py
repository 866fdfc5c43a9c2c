"""Batched sampling: one call per step for every sampled row.

Greedy rows take the argmax. Other rows apply temperature, top-k, top-p and min-p as
masks, then pick by the Gumbel-max trick with noise drawn from a per-request key, so a
seeded request samples the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import mlx.core as mx

from common.messages import SamplingParams

NEG_INF = float("-inf")


def sample(logits: mx.array, params: list[SamplingParams], keys: list[mx.array | None]) -> mx.array:
    """Token id per row of `logits` (B, V). `keys[b]` is row b's PRNG key (None if greedy)."""
    logits = logits.astype(mx.float32)
    if all(p.greedy for p in params):
        return mx.argmax(logits, axis=-1)
    rows = []
    for b, p in enumerate(params):
        row = logits[b]
        if p.greedy:
            rows.append(mx.argmax(row))
            continue
        row = filter_logits(row / p.temperature, p)
        noise = mx.random.gumbel(shape=row.shape, key=keys[b])
        rows.append(mx.argmax(row + noise))
    return mx.stack(rows)


def filter_logits(scaled: mx.array, p: SamplingParams) -> mx.array:
    """Mask tokens that top-k, top-p or min-p exclude (scaled logits in, masked logits out)."""
    if p.top_k > 0 and p.top_k < scaled.shape[-1]:
        kth = mx.sort(scaled)[-p.top_k]
        scaled = mx.where(scaled < kth, NEG_INF, scaled)
    if p.top_p < 1.0 or p.min_p > 0.0:
        probs = mx.softmax(scaled, axis=-1)
        if p.min_p > 0.0:
            scaled = mx.where(probs < p.min_p * probs.max(), NEG_INF, scaled)
        if p.top_p < 1.0:
            sorted_probs = mx.sort(probs)[::-1]
            # keep the smallest prefix of the sorted tokens whose mass reaches top_p
            before = mx.cumsum(sorted_probs) - sorted_probs
            threshold = sorted_probs[mx.sum(before < p.top_p) - 1]
            scaled = mx.where(probs < threshold, NEG_INF, scaled)
    return scaled


@dataclass
class Penalty:
    """What one request changes in its logits before sampling: the logit bias, then
    repetition (HF) and frequency/presence (OpenAI) penalties over its token history, in
    mlx-lm's order."""

    repetition: float
    frequency: float
    presence: float
    seen: set[int] = field(default_factory=set)  # prompt and output tokens
    counts: Counter = field(default_factory=Counter)  # output tokens
    bias: dict[int, float] = field(default_factory=dict)

    @classmethod
    def for_request(cls, p: SamplingParams, fill_ids: list[int], output_ids: list[int]):
        """None when the request changes nothing, so the common case costs nothing."""
        if not p.penalized and not p.logit_bias:
            return None
        return cls(
            p.repetition_penalty,
            p.frequency_penalty,
            p.presence_penalty,
            set(fill_ids),
            Counter(output_ids),
            p.bias_by_token(),
        )

    def observe(self, token: int) -> None:
        self.seen.add(token)
        self.counts[token] += 1

    def apply(self, row: mx.array) -> mx.array:
        if self.bias:
            idx = mx.array(list(self.bias))
            row[idx] = row[idx] + mx.array(list(self.bias.values()), dtype=mx.float32)
        if self.repetition != 1 and self.seen:
            idx = mx.array(sorted(self.seen))
            vals = row[idx]
            row[idx] = mx.where(vals > 0, vals / self.repetition, vals * self.repetition)
        if (self.frequency or self.presence) and self.counts:
            idx = mx.array(list(self.counts))
            n = mx.array(list(self.counts.values()), dtype=mx.float32)
            row[idx] = row[idx] - self.frequency * n - self.presence
        return row


def apply_penalties(logits: mx.array, penalties: list[Penalty | None]) -> mx.array:
    if all(p is None for p in penalties):
        return logits
    logits = logits.astype(mx.float32)
    return mx.stack([p.apply(logits[b]) if p else logits[b] for b, p in enumerate(penalties)])


def logprobs(logits: mx.array, tokens: mx.array, top_n: int) -> tuple[mx.array, mx.array, mx.array]:
    """The model's log-probabilities (before sampling transforms): of `tokens`, and the
    `top_n` best per row as (ids, values) sorted best first."""
    lp = logits.astype(mx.float32)
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    if top_n == 0:
        empty = mx.zeros((lp.shape[0], 0), dtype=mx.int32)
        return chosen, empty, empty.astype(mx.float32)
    top_ids = mx.argsort(-lp, axis=-1)[:, :top_n]
    return chosen, top_ids, mx.take_along_axis(lp, top_ids, axis=-1)


class KeySource:
    """PRNG keys per request: seeded requests are reproducible, others draw from the worker."""

    def __init__(self, seed: int):
        self._key = mx.random.key(seed)

    def request_key(self, seed: int | None, sampled: int = 0) -> mx.array:
        """A request's key; a seeded one past the `sampled` tokens it already has (a
        retracted request resuming), so it goes on as it would have without the pause."""
        if seed is not None:
            key = mx.random.key(seed)
            for _ in range(sampled):
                key, _ = self.next(key)
            return key
        self._key, key = mx.random.split(self._key)
        return key

    @staticmethod
    def next(key: mx.array) -> tuple[mx.array, mx.array]:
        """(key to keep, key to use now)."""
        new, use = mx.random.split(key)
        return new, use
