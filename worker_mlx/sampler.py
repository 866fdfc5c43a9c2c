"""Batched sampling: one call per step for every sampled row.

Greedy rows take the argmax. Other rows apply temperature, top-k, top-p and min-p as
masks, then pick by the Gumbel-max trick with noise drawn from a per-request key, so a
seeded request samples the same tokens whatever else shares its batch.
"""

from __future__ import annotations

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
        row = _filter(row / p.temperature, p)
        noise = mx.random.gumbel(shape=row.shape, key=keys[b])
        rows.append(mx.argmax(row + noise))
    return mx.stack(rows)


def _filter(scaled: mx.array, p: SamplingParams) -> mx.array:
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


class KeySource:
    """PRNG keys per request: seeded requests are reproducible, others draw from the worker."""

    def __init__(self, seed: int):
        self._key = mx.random.key(seed)

    def request_key(self, seed: int | None) -> mx.array:
        if seed is not None:
            return mx.random.key(seed)
        self._key, key = mx.random.split(self._key)
        return key

    @staticmethod
    def next(key: mx.array) -> tuple[mx.array, mx.array]:
        """(key to keep, key to use now)."""
        new, use = mx.random.split(key)
        return new, use
