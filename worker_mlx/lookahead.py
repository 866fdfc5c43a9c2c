"""Lookahead: work the worker does on a bet about the next descriptor.

Two bets, at most one at a time:

- **A decode step computed ahead.** A decode descriptor with `lookahead` set says the
  scheduler expects the same requests next. After answering, the worker computes that
  step (`mx.async_eval`) while the scheduler and router handle this one. Greedy rows
  without penalties or logprobs only: the step then changes nothing but one buffer column.
- **A finished request's one-row buffer.** Right after the only running request finishes,
  its buffer still holds the pool's KV for its slots (nothing has written the pool since),
  so the same prompt sent again runs its one-token step there without a gather.

The descriptor that was bet on takes the bet (`take_step`, `take_buffer`); every other
descriptor calls `invalidate()` (the KVLedger does, before any flush), which takes the
step's column back and forgets the buffer. Undoing a step and rewinding a kept buffer
to the prompt are this file's: the buffer only moves its columns as told.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from common.messages import DecodeBatch
from worker_mlx.decode_buffer import DecodeBuffer


@dataclass
class _Step:
    buffer: DecodeBuffer
    rids: list[str]
    tokens: mx.array
    column: int  # the column the step wrote
    state: list[list[mx.array]]  # the recurrent states before it


@dataclass
class _Kept:
    buffer: DecodeBuffer
    slots: list[int]  # the finished request's slots, which the buffer's columns hold


class Lookahead:
    def __init__(self):
        self.bet: _Step | _Kept | None = None
        self.next_step: list[str] | None = None  # the rids of the step to compute ahead

    def expect_step(self, rids: list[str] | None) -> None:
        """After a decode: the next step of `rids` is to be computed ahead (None: not)."""
        self.next_step = rids

    def step_ahead(self, buffer: DecodeBuffer, rids: list[str], compute) -> None:
        """Compute the step of `rids` ahead on `buffer`: `compute()` writes its column and
        returns its tokens."""
        column, state = buffer.idx, buffer.recurrent.state  # before `compute` replaces it
        self.bet = _Step(buffer, rids, compute(), column, state)

    def keep(self, buffer: DecodeBuffer, slots: list[int]) -> None:
        """Keep the finished single row's buffer for the next descriptor."""
        self.invalidate()
        self.bet = _Kept(buffer, list(slots))

    @property
    def has_step(self) -> bool:
        return isinstance(self.bet, _Step)

    def take_step(self, batch: DecodeBatch) -> mx.array | None:
        """The tokens computed ahead if `batch` is exactly that step; otherwise invalidate."""
        bet = self.bet
        if (
            isinstance(bet, _Step)
            and not batch.release
            and not any(batch.draft_slots)
            and batch.rids == bet.rids
        ):
            self.bet = self.next_step = None
            return bet.tokens
        self.invalidate()
        return None

    def take_buffer(self, rids: list[str], prefixes: list[list[int]]) -> DecodeBuffer | None:
        """The kept buffer, rewound to the end of the one prefix in `prefixes` and seating
        `rids`' one request, if it holds that prefix; otherwise invalidate."""
        bet = self.bet
        if isinstance(bet, _Kept) and len(prefixes) == 1:
            prefix = prefixes[0]
            if 0 < len(prefix) <= len(bet.slots) and bet.slots[: len(prefix)] == prefix:
                self.bet = self.next_step = None
                bet.buffer.reseat(rids[0], len(prefix))
                return bet.buffer
        self.invalidate()
        return None

    def invalidate(self) -> None:
        if isinstance(self.bet, _Step):
            self.bet.buffer.take_back(self.bet.column, self.bet.state)
        self.bet = self.next_step = None
