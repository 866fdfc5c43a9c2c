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
the reply, as the target's lookahead is, and taken back if something else comes.

Proposing (a step whose `draft_cache_loc` gives a row K fresh slots and no tokens): K + 1
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
from typing import TYPE_CHECKING

import mlx.core as mx

from common.messages import DecodeBatch, ExtendBatch, ReleaseReq, SamplingParams

if TYPE_CHECKING:
    from worker_mlx.model_runner import ModelRunner
    from worker_mlx.request_state import ReqState

# The draft samples nothing that the output depends on: its own requests are greedy and
# free of penalties, grammars and logprobs whatever the target's row asks for.
DRAFT_SAMPLING = SamplingParams(temperature=0.0)


class DraftModel:
    """The target runner's `drafter` (given at its construction): the target calls it,
    it calls only its own runner (`runner`, the draft model's), never the target."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        # After a step without drafts whose descriptor said the same rows come next, the
        # next follow step is computed while the scheduler works (`run_ahead`): its rids,
        # input tokens and guesses. Anything else takes that column back first.
        self.next_rids: list[str] | None = None
        self.ahead: tuple[list[str], list[int], mx.array] | None = None

    def run_ahead(self, target_reqs: dict[str, ReqState]) -> None:
        rids, self.next_rids = self.next_rids, None
        buffer = self.runner.buffer
        if rids is None or buffer is None or buffer.rows(rids) is None:
            return
        tokens = [target_reqs[rid].last_token for rid in rids]
        self.ahead = (rids, tokens, self._step(buffer, rids, tokens))

    def _take_back(self) -> None:
        if self.ahead is not None:
            buffer = self.runner.buffer
            buffer.take_back(buffer.idx - 1)
            self.ahead = None

    def extend(self, batch: ExtendBatch) -> None:
        """The target's extend (its releases already done by the target's `release`)."""
        self._take_back()
        reqs = [
            dataclasses.replace(
                r, sampling=DRAFT_SAMPLING, context_ids=[], output_ids=[], snapshots=[]
            )
            for r in batch.reqs
        ]
        self.runner.extend(ExtendBatch(batch.step, reqs))

    def release(self, release: list[ReleaseReq], keep_buffer: bool) -> None:
        self._take_back()
        self.runner.release(release, keep_buffer)

    def follow(self, batch: DecodeBatch, tokens: list[int]) -> mx.array:
        """A step without drafts: the draft computes the rows' input `tokens` too, and
        its guess of each row's next token (the rows' shadow proposals) is returned, to
        be read once the target's step is."""
        if self.ahead is not None and self.ahead[:2] == (list(batch.rids), tokens):
            guesses, self.ahead = self.ahead[2], None
        else:
            self._take_back()
            buffer = self.runner.ledger.rows(list(batch.rids))
            guesses = self._step(buffer, batch.rids, tokens)
        for rid, loc in zip(batch.rids, batch.out_cache_loc):
            self.runner.ledger.add(rid, [loc])
        self.next_rids = list(batch.rids) if batch.lookahead else None
        return guesses

    def _step(self, buffer, rids: list[str], tokens: list[int]) -> mx.array:
        """One column of `rids`' input tokens; the draft's guesses of their next tokens."""
        logits = buffer.step(self.runner.decode_step, self._by_row(buffer.rids, rids, tokens))
        guesses = mx.argmax(logits, axis=-1)[mx.array(buffer.rows(rids))]
        mx.async_eval(guesses, buffer.arrays())
        return guesses

    def propose(self, batch: DecodeBatch, tokens: list[int]) -> list[list[int]]:
        """Each row's drafts, as many as its `draft_cache_loc` has slots, after its input
        token `tokens[i]` (a row without slots: the first, its guess); their KV (all
        K + 1 columns) goes to the draft pool."""
        runner = self.runner
        self._take_back()
        # flushed: the step's columns are then the only unflushed ones
        buffer = runner.ledger.rows(list(batch.rids), flushed=True)
        k = max(len(locs) for locs in batch.draft_cache_loc)
        step = self._by_row(buffer.rids, batch.rids, tokens)
        drafted = []
        for _ in range(k + 1):
            step = mx.argmax(buffer.step(runner.decode_step, step), axis=-1)[:, None]
            drafted.append(step)
        rows = buffer.rows(batch.rids)
        table = mx.concatenate(drafted[:k], axis=1)[mx.array(rows)].tolist()
        slots = {
            rid: [loc] + locs + [0] * (k - len(locs))
            for rid, loc, locs in zip(batch.rids, batch.out_cache_loc, batch.draft_cache_loc)
        }
        runner.ledger.write_pending(slots.__getitem__)
        mx.async_eval(buffer.arrays(), runner.pool.arrays())
        for rid, loc in zip(batch.rids, batch.out_cache_loc):
            runner.ledger.add(rid, [loc])
        return [row[: len(locs) or 1] for row, locs in zip(table, batch.draft_cache_loc)]

    def commit(self, batch: DecodeBatch, accepted: list[int]) -> None:
        """After the target's verify: the draft keeps the columns of the accepted drafts."""
        buffer = self.runner.buffer  # propose's: its last k + 1 columns are this step's
        k = max(len(locs) for locs in batch.draft_cache_loc)
        kept = dict(zip(batch.rids, accepted))
        buffer.reject([k - kept[rid] if rid in kept else 0 for rid in buffer.rids])
        for rid, locs, a in zip(batch.rids, batch.draft_cache_loc, accepted):
            self.runner.ledger.add(rid, locs[:a])

    @staticmethod
    def _by_row(buffer_rids: list[str | None], rids: list[str], tokens: list[int]) -> mx.array:
        """(B, 1) tokens in the buffer's row order (0 in dead rows)."""
        of = dict(zip(rids, tokens))
        return mx.array([[of.get(rid, 0) if rid is not None else 0] for rid in buffer_rids])
