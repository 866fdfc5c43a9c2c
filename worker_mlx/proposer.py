"""Proposers: where a speculative step's drafts come from, behind one small protocol.

The Verifier (speculation.py) asks its proposer for each drafting step's drafts and
tells it what the target did; a proposer never calls the Verifier or the target. Two
plug-ins exist:

- `SchedulerDrafts` (--speculative-algorithm ngram): the scheduler's n-gram proposer
  sends the draft tokens in the descriptor; nothing runs in the worker.
- `DraftModel` (draft_model.py, --speculative-algorithm draft): a small model in the
  worker drafts the rows the descriptor gives draft slots.

A new proposer is one class implementing `Proposer`, chosen in loader.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from common.messages import DecodeBatch, ExtendBatch, ReleaseReq


@dataclass
class Proposal:
    """A drafting step's drafts to verify, per row ([]: the row is sampled as in a plain
    step), and per row that did not draft the proposer's guess of its next token (None:
    no guesses)."""

    drafts: list[list[int]]
    guesses: list[int | None] | None = None


class Proposer(Protocol):
    in_worker: bool  # whether it makes the draft tokens (else the descriptor carries them)

    def propose(self, batch: DecodeBatch, tokens: list[int]) -> Proposal:
        """The drafts of a drafting step, after each row's input token `tokens[i]`."""

    def commit(self, batch: DecodeBatch, accepted: list[int]) -> None:
        """After the verify: row i kept its first `accepted[i]` drafts."""

    def follow(self, batch: DecodeBatch, tokens: list[int]) -> mx.array | None:
        """A step without drafts (its input `tokens`): each row's guess of its next token,
        to be read once the target's step is (None: no guesses)."""

    def extend(self, batch: ExtendBatch) -> None:
        """The target extended `batch` (its releases already given to `release`)."""

    def release(self, release: list[ReleaseReq], keep_buffer: bool) -> None:
        """Requests leave, before the target releases them."""

    def run_ahead(self, last_token: Callable[[str], int]) -> None:
        """After the reply: work for the next step the last descriptor announced."""


class SchedulerDrafts:
    """The n-gram proposer's drafts, made by the scheduler and carried by the descriptor."""

    in_worker = False

    def propose(self, batch: DecodeBatch, tokens: list[int]) -> Proposal:
        return Proposal(batch.drafts)

    def commit(self, batch: DecodeBatch, accepted: list[int]) -> None:
        pass

    def follow(self, batch: DecodeBatch, tokens: list[int]) -> mx.array | None:
        return None

    def extend(self, batch: ExtendBatch) -> None:
        pass

    def release(self, release: list[ReleaseReq], keep_buffer: bool) -> None:
        pass

    def run_ahead(self, last_token: Callable[[str], int]) -> None:
        pass
