"""Speculative decoding as a wrapper around the runner: `Verifier(runner, proposer)`.

The worker runs a Verifier instead of the bare ModelRunner when the model can verify
drafts. A step without drafts is the runner's own decode (the proposer follows it: a
draft model computes the same tokens and guesses the next). A drafting step asks the
proposer (proposer.py) for drafts, runs one step of S = 1 + the most drafts columns per
row on the runner's decode buffer, keeps what the acceptance rule (verify.py) accepts,
and writes all S columns to the pool at once: the rejected ones into slots the
scheduler frees, and they become holes of the buffer (holes.py). Calls go one way:
Verifier -> runner and proposer, never back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from common.messages import DecodeBatch, ExtendBatch, ReleaseReq
from worker_mlx.decoding import StepOutput
from worker_mlx.proposer import Proposer
from worker_mlx.verify import accept, check_drafts

if TYPE_CHECKING:
    from worker_mlx.model_runner import ModelRunner


class Verifier:
    """The worker's engine (what worker.serve drives) for a runner that verifies drafts."""

    def __init__(self, runner: ModelRunner, proposer: Proposer):
        self.runner = runner
        self.proposer = proposer

    def extend(self, batch: ExtendBatch) -> StepOutput:
        self.proposer.release(batch.release, keep_buffer=True)
        out = self.runner.extend(batch)
        self.proposer.extend(batch)
        return out

    def decode(self, batch: DecodeBatch) -> StepOutput:
        runner, proposer = self.runner, self.proposer
        runner.check_decode(batch)
        drafting = any(batch.draft_slots)
        if drafting:
            check_drafts(batch, runner.vocab_size, runner.pool.num_slots, proposer.in_worker)
        proposer.release(batch.release, keep_buffer=False)
        if drafting:
            return self._verify(batch)
        guesses = proposer.follow(batch, [s.last_token for s in runner.decoding(batch.rids)])
        out = runner.decode(batch)
        if guesses is not None:
            out.guesses = guesses.tolist()
        return out

    def _verify(self, batch: DecodeBatch) -> StepOutput:
        """A step with drafts. Rows with drafts keep what `accept` accepts; rows without
        are sampled from their first position as in a plain step (penalties, grammars
        and logprobs included). Each row keeps the slots of its input token and of the
        drafts it accepts."""
        runner = self.runner
        runner.release(batch.release, keep_buffer=False)
        decodings = runner.decoding(batch.rids)
        proposal = self.proposer.propose(batch, [s.last_token for s in decodings])
        drafts = proposal.drafts
        S = 1 + max(len(d) for d in drafts)
        rows, slots = [], {}
        for rid, s, d, slot, draft_slots in zip(
            batch.rids, decodings, drafts, batch.out_cache_loc, batch.draft_slots
        ):
            pad = [0] * (S - 1 - len(d))
            rows.append([s.last_token] + d + pad)
            slots[rid] = [slot] + draft_slots + pad
        logits = runner.step_columns(list(batch.rids), rows)
        out = accept(logits, drafts, decodings, runner.grammars)
        ledger = runner.ledger
        ledger.write_pending(slots.__getitem__)  # all S columns, the rejected ones too
        kept, buffer = dict(zip(batch.rids, out.accepted)), ledger.buffer
        buffer.reject([S - 1 - kept[rid] if rid in kept else 0 for rid in buffer.rids])
        mx.async_eval(buffer.arrays(), runner.pool.arrays())
        for rid, slot, draft_slots, a in zip(
            batch.rids, batch.out_cache_loc, batch.draft_slots, out.accepted
        ):
            ledger.add(rid, [slot] + draft_slots[:a])
        self.proposer.commit(batch, out.accepted)
        out.proposed = drafts if batch.worker_drafts else None
        out.guesses = proposal.guesses
        return out

    def release(self, release: list[ReleaseReq], keep_buffer: bool = True) -> None:
        if release:
            self.proposer.release(release, keep_buffer)
        self.runner.release(release, keep_buffer)

    def run_ahead(self) -> None:
        decodings = self.runner.decodings
        self.proposer.run_ahead(lambda rid: decodings[rid].last_token)
        self.runner.run_ahead()

    def recover(self) -> None:
        self.runner.recover()
