"""The KV ledger: the one object that answers, and changes, where a request's KV is.

From its last prefill chunk to its release a decoding request's KV is in up to three
places, all of them the ledger's to say and to change:

- **pool slots**: its slot list, every slot of its KV oldest first, written here and
  nowhere else (`open`, then `add` for each step's slots it keeps, dropped at release);
- **the decode buffer**: its row, whose newest `pending` columns may hold decode KV that
  is not in the pool yet (the deferred flush). The ledger builds the buffer, seats and
  releases its rows (`rows`, `one_token_rows`, `release`) and flushes it;
- **its recurrent state slot** (models with recurrent layers): its working state.

The deferred-flush rule is kept here alone: before the pool is read (`readable_pool`, a
gather of rows) or the buffer's rows change, the ledger takes back a step computed ahead
(the lookahead's bet) and writes the unflushed columns into the pool, or drops those of
aborted requests. The pool itself refuses a read while this ledger says KV is unflushed
(`MlxKVPool.check_reads`), so a caller that reads around the ledger fails at once
instead of reading zeros.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import mlx.core as mx

from common.messages import ExtendReq, ReleaseReq
from worker_mlx.decode_buffer import DecodeBuffer
from worker_mlx.kv_pool import MlxKVPool
from worker_mlx.lookahead import Lookahead
from worker_mlx.state_pool import NoStates, StatePool


@dataclass
class KVLocation:
    """Where a request's KV is: `pool_slots` in the pool; `buffered_slots` (the newest
    decode tokens, not yet flushed) only in the decode buffer's row `row`, whose
    `columns` hold all of it; `state_slot` its recurrent state's working slot."""

    pool_slots: list[int]
    buffered_slots: list[int]
    row: int | None = None
    columns: range | None = None
    state_slot: int = 0


class KVLedger:
    def __init__(self, pool: MlxKVPool, states: StatePool | None = None):
        self.pool = pool
        # the recurrent layers' states (NoStates for a model without any); the buffer's
        # rows keep theirs unless there are none
        self.states: StatePool | NoStates = states if states is not None else NoStates()
        self._buffer_states = states
        # a finished request's buffer can be kept for the same prompt again unless a
        # recurrent state would have to be rewound to it
        self._rewindable = states is None
        self._slots: dict[str, list[int]] = {}
        self._state_slot: dict[str, int] = {}
        self._rope_skip: dict[str, int] = {}  # a vision prompt's skipped positions (holes.py)
        self._buffer: DecodeBuffer | None = None
        # bets on the next descriptor, which hold buffer columns the flush rule covers
        self.lookahead = Lookahead()
        pool.check_reads(self.unflushed)

    # ------------------------------------------------------------ slot lists

    def open(self, rid: str, slots: list[int], state_slot: int = 0, rope_skip: int = 0) -> None:
        """`rid` decodes from now on; its KV is at `slots` (prefix and new tokens), its
        recurrent state in `state_slot`; its RoPE positions skip `rope_skip`."""
        self._slots[rid] = list(slots)
        self._state_slot[rid] = state_slot
        if rope_skip:
            self._rope_skip[rid] = rope_skip

    def add(self, rid: str, slots: list[int]) -> None:
        """A step's tokens of `rid` went (or go, at the next flush) to `slots`."""
        self._slots[rid].extend(slots)

    def slots(self, rid: str) -> list[int]:
        """Every slot of `rid`'s KV, oldest first (the caller must not change it)."""
        return self._slots[rid]

    def state_slot(self, rid: str) -> int:
        return self._state_slot[rid]

    def __contains__(self, rid: str) -> bool:
        return rid in self._slots

    def where(self, rid: str) -> KVLocation:
        """Where `rid`'s KV is now."""
        slots, home = self._slots[rid], self._state_slot[rid]
        buffer = self._buffer
        place = buffer.columns(rid) if buffer is not None else None
        if place is None:
            return KVLocation(list(slots), [], state_slot=home)
        n = buffer.pending()
        return KVLocation(slots[: len(slots) - n], slots[len(slots) - n :], *place, home)

    # ------------------------------------------------------------ the decode buffer

    @property
    def buffer(self) -> DecodeBuffer | None:
        """The decode buffer (None: none yet, or dropped); its rows are the ledger's."""
        return self._buffer

    def unflushed(self) -> int:
        """Decode tokens per row that are only in the buffer, not in the pool."""
        return self._buffer.pending() if self._buffer is not None else 0

    def rows(self, rids: list[str], flushed: bool = False) -> DecodeBuffer:
        """The decode buffer with exactly `rids` live: this one, or with rows seated
        (everything flushed first), or rebuilt from the pool. `flushed`: nothing left
        unflushed either (a speculative step's columns are then the only ones)."""
        buffer = self._buffer
        if buffer is None or not buffer.serves(rids):
            self.flush()
            slots = [self._slots[rid] for rid in rids]
            homes = [self._state_slot[rid] for rid in rids]
            skips = [self._rope_skip.get(rid, 0) for rid in rids]
            if buffer is None or not buffer.seat(rids, slots, homes, skips):
                buffer = self._buffer = DecodeBuffer(
                    self.pool, rids, slots, states=self._buffer_states, state_slots=homes,
                    skips=skips,
                )  # fmt: skip
        elif flushed:
            self.flush()
        return buffer

    def one_token_rows(self, reqs: list[ExtendReq], skips: list[int] = ()) -> DecodeBuffer:
        """A buffer seating `reqs`, prompts whose every token but the last is cached: the
        finished request's kept buffer when it holds the one prefix (Lookahead), else
        one gathered from the pool with room for this step and the next."""
        prefixes = [r.prefix_slot_ids for r in reqs]
        buffer = self.lookahead.take_buffer([r.rid for r in reqs], prefixes)
        if buffer is None:
            self.flush()
            buffer = DecodeBuffer(
                self.pool, [r.rid for r in reqs], prefixes, free_columns=2,
                states=self._buffer_states, state_slots=[r.state_slot for r in reqs],
                state_from=[r.prefix_state for r in reqs], skips=skips,
            )  # fmt: skip
        self._buffer = buffer
        return buffer

    def readable_pool(self) -> MlxKVPool:
        """The pool, once every decode token is in it and no bet on the next descriptor
        holds a column (an extend reads prefixes and writes slots a bet may hold)."""
        self.lookahead.invalidate()
        if self._buffer is not None:
            self.flush()
        return self.pool

    def write_pending(self, slots_of: Callable[[str], list[int]] | None = None) -> None:
        """The unflushed columns go to the pool (lazily), at the last slots of
        `slots_of(rid)`: by default the ledger's; a speculative step passes its own, the
        rejected drafts' slots included (the scheduler frees those)."""
        self._buffer.flush(slots_of or self.slots)

    def flush(self, skip: Collection[str] = ()) -> None:
        """Take back a step computed ahead, write every decode token that is only in the
        buffer into the pool (those of `skip`, aborted requests, are dropped) and wait
        for the pool."""
        self.lookahead.invalidate()
        if self._buffer is not None:
            self._buffer.flush(self.slots, skip)
        mx.eval(self.arrays())

    def arrays(self) -> list[mx.array]:
        """The pool's arrays and the recurrent states'."""
        return self.pool.arrays() + self.states.all()

    # ------------------------------------------------------------ release

    def release(self, release: list[ReleaseReq], keep_buffer: bool = True) -> None:
        """Flush (finished) or drop (aborted) requests, whose slots the scheduler then
        owns again. With `keep_buffer`, the buffer of a finished request that ran alone
        is kept for the same prompt again (see Lookahead)."""
        self.flush(skip={r.rid for r in release if not r.flush})
        self._final_snapshots(release)
        buffer = self._buffer
        if buffer is not None:
            finished = {r.rid for r in release if r.flush}
            alone = len(buffer.rids) == 1 and buffer.rids[0] in finished
            if keep_buffer and alone and self._rewindable and not buffer.holes.columns:
                self.lookahead.keep(buffer, self.slots(buffer.rids[0]))
            buffer.drop({r.rid for r in release})
        for r in release:
            self._slots.pop(r.rid, None)
            self._state_slot.pop(r.rid, None)
            self._rope_skip.pop(r.rid, None)

    def _final_snapshots(self, release: list[ReleaseReq]) -> None:
        """Finished requests' states (flushed just now) into the snapshots asked for."""
        n = self.states.num_slots
        snaps = [
            (self._state_slot[r.rid], r.snapshot)
            for r in release
            if r.flush and 1 <= r.snapshot <= n and r.rid in self._slots
        ]
        if snaps:
            self.states.copy(snaps)
            mx.eval(self.states.all())

    def reset(self) -> None:
        """After a step ran out of memory: free its temporaries, write what only the
        buffer holds into the pool and drop the buffer (the next decode rebuilds it)."""
        self.lookahead.invalidate()
        mx.clear_cache()
        try:
            self.flush()
        finally:
            self._buffer = None
            mx.clear_cache()
