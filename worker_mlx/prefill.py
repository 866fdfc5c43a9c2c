"""Planning a prefill (extend) step: its forward passes and each pass's pool indices.

A pass computes right-padded rows of new tokens, each after a prefix whose KV is in the
pool: `ExtendPlan` holds the slot indices the pass writes and reads and its mask, and
`ExtendCache` (layer_caches) applies them per layer. `passes` cuts an extend into rounds
of at most `--prefill-step-size` tokens a row.
"""

from __future__ import annotations

import mlx.core as mx

from common.messages import ExtendReq
from worker_mlx.kv_pool import MlxKVPool
from worker_mlx.layer_caches import ExtendCache


class ExtendPlan:
    """Row b has `len(prefix_slots[b])` tokens in the pool and `new_lens[b]` to compute,
    right-padded to L. Prefix KV is gathered from the pool by slot id inside the graph;
    new KV is scattered into the pool at `out_locs` (padding positions write to slot 0)."""

    def __init__(
        self,
        pool: MlxKVPool,
        prefix_slots: list[list[int]],
        new_lens: list[int],
        out_locs: list[list[int]],
    ):
        self.pool = pool
        B = len(new_lens)
        self.L = L = max(new_lens)
        P = max(len(p) for p in prefix_slots)
        prefix_lens = mx.array([len(p) for p in prefix_slots], dtype=mx.int32)
        # A batch of one gets a plain int: the fallback path for models whose RoPE cannot
        # take per-row offsets.
        self.offset = len(prefix_slots[0]) if B == 1 else prefix_lens
        new_idx = [loc + [0] * (L - len(loc)) for loc in out_locs]
        self.write_idx = mx.array(new_idx, dtype=mx.int32).reshape(B * L)
        # with a prefix, attention reads every column back from the pool after the write:
        # prefix slots right-padded to P, then the new tokens' slots
        self.read_idx = (
            pool.head_index(
                mx.array([p + [0] * (P - len(p)) + n for p, n in zip(prefix_slots, new_idx)])
            )
            if P
            else None
        )
        cols = mx.arange(P + L)
        prefix_ok = cols[None, :] < prefix_lens[:, None]  # (B, P+L)
        causal = (cols[None, :] >= P) & (cols[None, :] - P <= mx.arange(L)[:, None])  # (L, P+L)
        self._full = (prefix_ok[:, None, :] | causal[None, :, :])[:, None, :, :]
        # positions: row b's query i is token prefix_len + i; column j < P is prefix token
        # j, column P + i new token i
        self._query_pos = prefix_lens[:, None] + mx.arange(L)[None, :]  # (B, L)
        new_pos = self._query_pos[:, :1] + cols - P
        self._key_pos = mx.where(cols[None, :] < P, cols[None, :], new_pos)  # (B, P+L)
        self._masks: dict[int, mx.array] = {}

    def mask(self, window: int | None = None) -> mx.array:
        """(B, 1, L, P+L): causal over each row's prefix and new tokens; with a window W,
        a query sees only the W tokens ending at itself (mlx-lm's RotatingKVCache)."""
        if window is None:
            return self._full
        if window not in self._masks:
            distance = self._query_pos[:, :, None] - self._key_pos[:, None, :]  # (B, L, P+L)
            self._masks[window] = self._full & (distance < window)[:, None, :, :]
        return self._masks[window]

    @classmethod
    def for_reqs(cls, pool: MlxKVPool, reqs: list[ExtendReq]) -> ExtendPlan:
        return cls(
            pool,
            [r.prefix_slot_ids for r in reqs],
            [len(r.input_ids) for r in reqs],
            [r.out_cache_loc for r in reqs],
        )

    def layer_caches(self) -> list[ExtendCache]:
        return [ExtendCache(self, i) for i in range(self.pool.layout.num_layers)]


def passes(reqs: list[ExtendReq], step: int) -> list[tuple[list[ExtendReq], list[ExtendReq]]]:
    """Forward passes for one extend, in order, as (pieces, the requests they belong to).

    Each request's new tokens are cut into pieces of at most `step`; round k runs every
    request's k-th piece after round k-1 wrote its KV, so attention stays in cache-sized
    blocks. Within a round, pieces of very different lengths go in separate passes, so a
    64-token question is never padded to a 256-token piece of a long prompt."""
    out = []
    for start in range(0, max(len(r.input_ids) for r in reqs), step):
        pieces = [(_piece(r, start, step), r) for r in reqs if start < len(r.input_ids)]
        pieces.sort(key=lambda pr: -len(pr[0].input_ids))
        group: list[tuple[ExtendReq, ExtendReq]] = []
        for piece, owner in pieces:
            if group and 2 * len(piece.input_ids) <= len(group[0][0].input_ids):
                out.append(([p for p, _ in group], [o for _, o in group]))
                group = []
            group.append((piece, owner))
        out.append(([p for p, _ in group], [o for _, o in group]))
    return out


def _piece(r: ExtendReq, start: int, step: int) -> ExtendReq:
    end = min(start + step, len(r.input_ids))
    return ExtendReq(
        r.rid,
        r.input_ids[start:end],
        r.prefix_slot_ids + r.out_cache_loc[:start],
        r.out_cache_loc[start:end],
        r.sampling,
        last_chunk=r.last_chunk and end == len(r.input_ids),
    )
