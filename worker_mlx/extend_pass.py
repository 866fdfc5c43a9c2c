"""Extend passes: an extend (prefill) step's forward passes and each pass's pool indices.

A pass computes right-padded rows of new tokens, each after a prefix whose KV is in the
pool: `ExtendPlan` holds the slot indices the pass writes and reads and its mask, and
`ExtendCache` (layer_caches) applies them per layer. `passes` cuts an extend into rounds
of at most `--prefill-step-size` tokens a row.
"""

from __future__ import annotations

import mlx.core as mx

from common.messages import ExtendReq
from worker_mlx.kv_pool import MlxKVPool
from worker_mlx.layer_caches import ExtendCache, StateCache
from worker_mlx.state_pool import StatePool


class ExtendPlan:
    """Row b has `len(prefix_slots[b])` tokens in the pool and `new_lens[b]` to compute,
    right-padded to L. Prefix KV is gathered from the pool by slot id inside the graph;
    new KV is scattered into the pool at `out_slots` (padding positions write to slot 0)."""

    def __init__(
        self,
        pool: MlxKVPool,
        prefix_slots: list[list[int]],
        new_lens: list[int],
        out_slots: list[list[int]],
        states: StatePool | None = None,
        state_slots: list[int] = (),
        prefix_states: list[int] = (),
    ):
        self.pool = pool
        self.states = states
        self.state_slots = list(state_slots)
        self.prefix_states = list(prefix_states)
        self.new_lens = new_lens
        B = len(new_lens)
        self.L = L = max(new_lens)
        P = max(len(p) for p in prefix_slots)
        prefix_lens = mx.array([len(p) for p in prefix_slots], dtype=mx.int32)
        # A batch of one gets a plain int: the fallback path for models whose RoPE cannot
        # take per-row offsets.
        self.offset = len(prefix_slots[0]) if B == 1 else prefix_lens
        new_idx = [slots + [0] * (L - len(slots)) for slots in out_slots]
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
    def for_reqs(
        cls, pool: MlxKVPool, reqs: list[ExtendReq], states: StatePool | None = None
    ) -> ExtendPlan:
        return cls(
            pool,
            [r.prefix_slot_ids for r in reqs],
            [len(r.input_ids) for r in reqs],
            [r.out_cache_loc for r in reqs],
            states,
            [r.state_slot for r in reqs],
            [r.prefix_state for r in reqs],
        )

    def layer_caches(self) -> list:
        """The caches of one pass, in the model's order: KV layers read and write the pool,
        recurrent layers start from their rows' prefix states."""
        layout = self.pool.layout
        kv = [ExtendCache(self, i) for i in range(layout.num_layers)]
        self._state_caches = [self._state_cache(i) for i in range(len(layout.recurrent))]
        return layout.in_model_order(kv, self._state_caches)

    def _state_cache(self, layer: int) -> StateCache:
        size = len(self.states.layout.entries[layer])
        initial = None
        if any(self.prefix_states):  # else all start from zero, made by the layer itself
            initial = self.states.gather(layer, mx.array(self.prefix_states, dtype=mx.int32))
        padded = any(n < self.L for n in self.new_lens)
        return StateCache(size, initial, mx.array(self.new_lens) if padded else None)

    def store_states(self) -> None:
        """The recurrent layers' states after this pass, into the rows' working slots."""
        if not self.pool.layout.recurrent:
            return
        slots = mx.array(self.state_slots, dtype=mx.int32)
        for layer, cache in enumerate(self._state_caches):
            self.states.write(layer, slots, cache.state)


def passes(
    reqs: list[ExtendReq], step: int, pad: bool = True
) -> list[tuple[list[ExtendReq], list[ExtendReq]]]:
    """Forward passes for one extend, in order, as (pieces, the requests they belong to).

    Each request's new tokens are cut into pieces of at most `step`, and where a snapshot
    of its recurrent state is asked for; round k runs every request's k-th piece after
    round k-1 wrote its KV, so attention stays in cache-sized blocks. Within a round,
    pieces of very different lengths go in separate passes, so a 64-token question is
    never padded to a 256-token piece of a long prompt; without `pad`, pieces of any
    different lengths do (models whose recurrent layers cannot take right padding)."""
    cuts = {id(r): _cuts(r, step) for r in reqs}
    out = []
    for k in range(max(len(c) - 1 for c in cuts.values())):
        pieces = [
            (_piece(r, cuts[id(r)][k], cuts[id(r)][k + 1]), r)
            for r in reqs
            if k + 1 < len(cuts[id(r)])
        ]
        pieces.sort(key=lambda pr: -len(pr[0].input_ids))
        group: list[tuple[ExtendReq, ExtendReq]] = []
        for piece, owner in pieces:
            longest, n = len(group[0][0].input_ids) if group else 0, len(piece.input_ids)
            if group and (2 * n <= longest if pad else n != longest):
                out.append(([p for p, _ in group], [o for _, o in group]))
                group = []
            group.append((piece, owner))
        out.append(([p for p, _ in group], [o for _, o in group]))
    return out


def _cuts(r: ExtendReq, step: int) -> list[int]:
    """Where `r`'s pieces start and end: every `step` tokens and at each snapshot."""
    n = len(r.input_ids)
    return sorted({*range(0, n, step), n, *(at for at, _ in r.snapshots if 0 < at < n)})


def _piece(r: ExtendReq, start: int, end: int) -> ExtendReq:
    return ExtendReq(
        r.rid,
        r.input_ids[start:end],
        r.prefix_slot_ids + r.out_cache_loc[:start],
        r.out_cache_loc[start:end],
        r.sampling,
        last_chunk=r.last_chunk and end == len(r.input_ids),
        state_slot=r.state_slot,
        prefix_state=r.state_slot if start else r.prefix_state,
        snapshots=[[at - start, slot] for at, slot in r.snapshots if at == end],
        lora=r.lora,
        images=r.images,
    )
