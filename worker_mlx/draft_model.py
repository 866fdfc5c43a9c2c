"""The draft model of `--speculative-algorithm draft`: a small model of the target's
tokenizer that proposes the drafting rows' tokens inside the worker.

It is a second ModelRunner over its own pool indexed by the same slot ids: whatever slot
holds a token's KV in the target's pool holds that token's draft KV in the draft's. So
the scheduler's allocator, trie and eviction cover both pools without knowing there are
two, and a prefix that hits in the radix cache is there for the draft too. To keep that
true the draft computes every token the target does: the same extends (chunks, cached
prefixes), and at every decode step the rows' input tokens, on its own decode buffer,
deferred and flushed exactly when the target's is (release, extend). Its guess of each
row's next token comes with that step, the row's shadow proposal (scheduler/speculation.py);
when the descriptor says the same rows come next, the next such step is computed after
the reply by the draft runner's own Lookahead, and taken back if something else comes.

Proposing (a step whose `draft_slots` gives a row K fresh slots and no tokens): K + 1
steps of the draft's decode buffer, batched over the rows: the row's last token, then
each greedy draft in turn; the last step only writes the K-th draft's KV, so a run the
target accepts whole leaves nothing to catch up. Each step's tokens are the argmax of the
one before on the device, so the K drafts cost one read back to the host. After the
target's verify, the draft's columns of rejected drafts become holes, like the target's,
and the request's draft slots are the target's.

The draft is greedy: q is one-hot, which is the case `verify`'s rejection rule handles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import mlx.core as mx

from common.messages import DecodeBatch, ExtendBatch, ReleaseReq, SamplingParams
from worker_mlx.proposer import Proposal

if TYPE_CHECKING:
    from worker_mlx.model_runner import ModelRunner

# The draft samples nothing that the output depends on: its own requests are greedy and
# free of penalties, grammars and logprobs whatever the target's row asks for.
DRAFT_SAMPLING = SamplingParams(temperature=0.0)


class DraftModel:
    """The Proposer (proposer.py) of --speculative-algorithm draft: the Verifier calls it,
    it calls only its own runner (`runner`, the draft model's), never the target. Its
    step computed ahead is its runner's Lookahead bet, as the target's is."""

    in_worker = True

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def run_ahead(self, last_token: Callable[[str], int]) -> None:
        """The next follow step, computed while the scheduler works, if the descriptor
        said the same rows come next."""
        lookahead, buffer = self.runner.lookahead, self.runner.buffer
        rids = lookahead.next_step
        lookahead.expect_step(None)
        if rids is None or buffer is None or buffer.rows(rids) is None:
            return
        tokens = [last_token(rid) for rid in rids]
        lookahead.step_ahead(buffer, rids, lambda: self._step(buffer, rids, tokens))

    def extend(self, batch: ExtendBatch) -> None:
        """The target's extend (its releases already given to `release`)."""
        reqs = [
            dataclasses.replace(
                r, sampling=DRAFT_SAMPLING, context_ids=[], output_ids=[], snapshots=[]
            )
            for r in batch.reqs
        ]
        self.runner.extend(ExtendBatch(batch.step, reqs))

    def release(self, release: list[ReleaseReq], keep_buffer: bool) -> None:
        self.runner.release(release, keep_buffer)

    def follow(self, batch: DecodeBatch, tokens: list[int]) -> mx.array:
        """A step without drafts: the draft computes the rows' input `tokens` too, and
        its guess of each row's next token (the rows' shadow proposals) is returned, to
        be read once the target's step is."""
        runner = self.runner
        guesses = runner.lookahead.take_step(batch)  # (input tokens: the target's last)
        if guesses is None:
            buffer = runner.ledger.rows(list(batch.rids))
            guesses = self._step(buffer, batch.rids, tokens)
        for rid, slot in zip(batch.rids, batch.out_cache_loc):
            runner.ledger.add(rid, [slot])
        runner.lookahead.expect_step(list(batch.rids) if batch.lookahead else None)
        return guesses

    def _step(self, buffer, rids: list[str], tokens: list[int]) -> mx.array:
        """One column of `rids`' input tokens; the draft's guesses of their next tokens."""
        logits = buffer.step(self.runner.decode_step, self._by_row(buffer.rids, rids, tokens))
        guesses = mx.argmax(logits, axis=-1)[mx.array(buffer.rows(rids))]
        mx.async_eval(guesses, buffer.arrays())
        return guesses

    def propose(self, batch: DecodeBatch, tokens: list[int]) -> Proposal:
        """Each row's drafts, as many as its `draft_slots` has slots, after its input
        token `tokens[i]` (a row without slots: none, and the first is its guess); their
        KV (all K + 1 columns) goes to the draft pool."""
        runner = self.runner
        # flushed: the step's columns are then the only unflushed ones
        buffer = runner.ledger.rows(list(batch.rids), flushed=True)
        k = max(len(slots) for slots in batch.draft_slots)
        step = self._by_row(buffer.rids, batch.rids, tokens)
        drafted = []
        for _ in range(k + 1):
            step = mx.argmax(buffer.step(runner.decode_step, step), axis=-1)[:, None]
            drafted.append(step)
        rows = buffer.rows(batch.rids)
        table = mx.concatenate(drafted[:k], axis=1)[mx.array(rows)].tolist()
        slots = {
            rid: [slot] + draft_slots + [0] * (k - len(draft_slots))
            for rid, slot, draft_slots in zip(batch.rids, batch.out_cache_loc, batch.draft_slots)
        }
        runner.ledger.write_pending(slots.__getitem__)
        mx.async_eval(buffer.arrays(), runner.pool.arrays())
        for rid, slot in zip(batch.rids, batch.out_cache_loc):
            runner.ledger.add(rid, [slot])
        drafts = [row[: len(s)] for row, s in zip(table, batch.draft_slots)]
        guesses = [None if s else row[0] for row, s in zip(table, batch.draft_slots)]
        return Proposal(drafts, guesses)

    def commit(self, batch: DecodeBatch, accepted: list[int]) -> None:
        """After the target's verify: the draft keeps the columns of the accepted drafts."""
        buffer = self.runner.buffer  # propose's: its last k + 1 columns are this step's
        k = max(len(slots) for slots in batch.draft_slots)
        kept = dict(zip(batch.rids, accepted))
        buffer.reject([k - kept[rid] if rid in kept else 0 for rid in buffer.rids])
        for rid, slots, a in zip(batch.rids, batch.draft_slots, accepted):
            self.runner.ledger.add(rid, slots[:a])

    @staticmethod
    def _by_row(buffer_rids: list[str | None], rids: list[str], tokens: list[int]) -> mx.array:
        """(B, 1) tokens in the buffer's row order (0 in dead rows)."""
        of = dict(zip(rids, tokens))
        return mx.array([[of.get(rid, 0) if rid is not None else 0] for rid in buffer_rids])
