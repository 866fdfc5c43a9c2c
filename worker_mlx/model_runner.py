"""ModelRunner: executes the scheduler's extend and decode descriptors on one mlx-lm model.

It owns the KV pool and the decode buffer, and keeps for each request between its last
prefill chunk and its release the slots that hold its KV (the scheduler's ReqToTokenPool
says the same; descriptors are checked against the pool bounds, not trusted).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from common.messages import DecodeBatch, ExtendBatch, ExtendReq, ReleaseReq, SamplingParams
from worker_mlx.batch_cache import DecodePlan, ExtendPlan
from worker_mlx.compiled_decode import DecodeStep
from worker_mlx.kv_pool import MlxKVPool
from worker_mlx.model_probe import split_lm_head
from worker_mlx.sampler import KeySource, Penalty, apply_penalties, logprobs, sample

# Prefill tokens per forward pass and row. On CPU attention materialises its score matrix,
# so blocks of a few hundred tokens are ~1.6x faster than 2048 at once; Metal prefers big.
DEFAULT_PREFILL_STEP = 2048 if sys.platform == "darwin" else 256


@dataclass
class ReqState:
    rid: str
    slots: list[int]
    sampling: SamplingParams
    last_token: int
    key: mx.array | None
    penalty: Penalty | None = None


@dataclass
class _Lookahead:
    rids: list[str]
    plan: DecodePlan
    tokens: mx.array


@dataclass
class _Kept:
    """The one-row decode buffer of a request that finished and the slots its columns
    hold. Kept until the next descriptor only: nothing writes the pool before then, so
    its columns are still the pool's KV for those slots."""

    plan: DecodePlan
    slots: list[int]


@dataclass
class StepOutput:
    rids: list[str]
    next_token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list] | None = None


class ModelRunner:
    """`batched=False` runs every request as its own batch of one with integer offsets: the
    fallback for models whose attention cannot take per-row offset arrays."""

    def __init__(
        self, model: nn.Module, pool: MlxKVPool, vocab_size: int, seed: int = 0,
        batched: bool = True, prefill_step: int = DEFAULT_PREFILL_STEP,
        compile_decode: bool = False,
    ):  # fmt: skip
        self.model = model
        self.pool = pool
        self.vocab_size = vocab_size
        self.batched = batched
        self.prefill_step = prefill_step
        self.keys = KeySource(seed)
        self.reqs: dict[str, ReqState] = {}
        self.decode_plan: DecodePlan | None = None
        self.solo_plans: dict[str, DecodePlan] = {}
        self.body, self.head = split_lm_head(model)
        # batched decode steps replay one traced graph (per-request fallback stays eager)
        self.compiled_step = DecodeStep(model) if compile_decode and batched else None
        self.ahead: _Lookahead | None = None  # a decode step computed before it was asked for
        self.lookahead_rids: list[str] | None = None
        self.kept: _Kept | None = None  # until the next extend or decode

    # ------------------------------------------------------------ extend

    def extend(self, batch: ExtendBatch) -> StepOutput:
        self._take_lookahead(None)
        self.release(batch.release)
        kept, self.kept = self.kept, None
        for r in batch.reqs:
            self._check_extend(r)
        self._flush()
        if self.compiled_step is not None and all(
            len(r.input_ids) == 1 and r.last_chunk for r in batch.reqs
        ):
            return self._extend_one_token(batch.reqs, kept)
        groups = [batch.reqs] if self.batched else [[r] for r in batch.reqs]
        passes = [p for reqs in groups for p in _rounds(reqs, self.prefill_step)]
        last_logits, states, order = [], [], []
        position = {id(r): i for i, r in enumerate(batch.reqs)}
        for n, (pieces, owners) in enumerate(passes):
            hidden = self._extend_forward(pieces)
            sampled = [i for i, p in enumerate(pieces) if p.last_chunk]
            if sampled:
                rows = mx.array(sampled, dtype=mx.int32)
                cols = mx.array([len(pieces[i].input_ids) - 1 for i in sampled], mx.int32)
                last_logits.append(self.head(hidden[rows, cols]))
                states += [self._new_state(owners[i]) for i in sampled]
                order += [position[id(owners[i])] for i in sampled]
            if n + 1 < len(passes):
                mx.eval(self.pool.arrays(), last_logits)  # the next pass reads this KV
        if not states:
            mx.eval(self.pool.arrays())
            return StepOutput([], [])
        # answer in descriptor order, whichever round each request finished in
        perm = sorted(range(len(order)), key=order.__getitem__)
        logits = mx.concatenate(last_logits)[mx.array(perm)]
        states = [states[i] for i in perm]
        return self._start_decoding(logits, states)

    def _extend_one_token(self, reqs: list[ExtendReq], kept: _Kept | None) -> StepOutput:
        """Prompts whose every token but the last is cached (a repeated prompt): the step
        is a decode step, so it runs as one on a decode buffer, which the next decode of
        the same requests then keeps using instead of gathering it again. The buffer of
        the request that just sent the same prompt still holds it, so it needs no gather
        (0.5-1 ms of the 6 ms a 2,048-token repeat spends in the worker)."""
        states = [self._new_state(r) for r in reqs]
        rids, prefixes = [r.rid for r in reqs], [r.prefix_slot_ids for r in reqs]
        if kept is not None and _holds(kept, prefixes):
            plan = kept.plan
            plan.rewind(rids[0], len(prefixes[0]))
        else:
            plan = DecodePlan(self.pool, rids, prefixes, free_columns=2)  # this token, the next
        tokens = mx.array([r.input_ids for r in reqs])
        logits = plan.run(self.compiled_step, tokens)
        plan.flush(list(range(len(reqs))), [r.out_cache_loc for r in reqs])  # in the pool now
        self.decode_plan = plan
        return self._start_decoding(logits, states)

    def _start_decoding(self, logits: mx.array, states: list[ReqState]) -> StepOutput:
        """Sample the extended requests' first tokens; from now on they decode."""
        out = self._sample_and_record(logits, states, self.pool.arrays())
        for s in states:
            self.reqs[s.rid] = s
        return out

    def _extend_forward(self, reqs: list[ExtendReq]) -> mx.array:
        plan = ExtendPlan(
            self.pool,
            [r.prefix_slot_ids for r in reqs],
            [len(r.input_ids) for r in reqs],
            [r.out_cache_loc for r in reqs],
        )
        tokens = mx.array([r.input_ids + [0] * (plan.L - len(r.input_ids)) for r in reqs])
        return self.body(tokens, cache=plan.layer_caches())

    def _check_extend(self, r: ExtendReq) -> None:
        if not r.input_ids:
            raise ValueError(f"{r.rid}: extend with no input tokens")
        if len(r.out_cache_loc) != len(r.input_ids):
            raise ValueError(f"{r.rid}: {len(r.input_ids)} tokens but {len(r.out_cache_loc)} slots")
        if r.rid in self.reqs:
            raise ValueError(f"{r.rid}: extend for a request that is already decoding")
        self._check_slots(r.rid, r.prefix_slot_ids)
        self._check_slots(r.rid, r.out_cache_loc)
        if min(r.input_ids) < 0 or max(r.input_ids) >= self.vocab_size:
            raise ValueError(f"{r.rid}: token id outside the vocabulary [0, {self.vocab_size})")
        r.sampling.validate(self.vocab_size)

    def _check_slots(self, rid: str, slots: list[int]) -> None:
        if slots and (min(slots) < 1 or max(slots) > self.pool.num_slots):
            raise ValueError(f"{rid}: slot id outside the pool [1, {self.pool.num_slots}]")

    def _new_state(self, r: ExtendReq) -> ReqState:
        key = None if r.sampling.greedy else self.keys.request_key(r.sampling.seed)
        penalty = Penalty.for_request(r.sampling, r.context_ids + r.input_ids, r.output_ids)
        return ReqState(r.rid, r.prefix_slot_ids + r.out_cache_loc, r.sampling, -1, key, penalty)

    # ------------------------------------------------------------ decode

    def decode(self, batch: DecodeBatch) -> StepOutput:
        ahead = self._take_lookahead(batch)
        self.release(batch.release)
        self.kept = None
        if len(batch.out_cache_loc) != len(batch.rids):
            raise ValueError(f"{len(batch.rids)} requests but {len(batch.out_cache_loc)} slots")
        unknown = [rid for rid in batch.rids if rid not in self.reqs]
        if unknown:
            raise ValueError(f"decode for unknown requests {unknown[:4]}")
        self._check_slots("decode", batch.out_cache_loc)
        states = [self.reqs[rid] for rid in batch.rids]
        if ahead is not None:
            out = StepOutput(list(batch.rids), ahead.tokens.tolist())
            for s, tok in zip(states, out.next_token_ids):
                s.last_token = tok
        else:
            out = self._decode_step(batch.rids, states)
        for s, loc in zip(states, batch.out_cache_loc):
            s.slots.append(loc)
        can_look = self.batched and all(
            s.sampling.greedy and s.penalty is None and not s.sampling.logprobs for s in states
        )
        self.lookahead_rids = list(batch.rids) if batch.lookahead and can_look else None
        return out

    def _decode_step(self, rids: list[str], states: list[ReqState]) -> StepOutput:
        plans = self._decode_plans(rids, states)
        # each plan's rows in the scheduler's order (a per-request plan has one)
        order = [plan.rows(rids) for plan in plans] if self.batched else [[0]] * len(plans)
        parts = [self._forward_one_step(plan, rows) for plan, rows in zip(plans, order)]
        buffers = [a for plan in plans for a in plan.keys + plan.values]
        logits = parts[0] if len(parts) == 1 else mx.concatenate(parts)
        return self._sample_and_record(logits, states, buffers)

    def run_ahead(self) -> None:
        """Start the next decode step of a lookahead batch (called after the reply went out,
        so it computes while the scheduler works). Greedy rows only: nothing to undo but
        the buffer column if the next descriptor turns out different."""
        rids, self.lookahead_rids = self.lookahead_rids, None
        plan = self.decode_plan
        rows = plan.rows(rids) if rids is not None and plan is not None else None
        if rows is None:
            return
        logits = self._forward_one_step(plan, rows)
        ahead = _Lookahead(rids, plan, mx.argmax(logits, axis=-1))
        mx.async_eval(ahead.tokens, plan.keys, plan.values)
        self.ahead = ahead

    def _forward_one_step(self, plan: DecodePlan, rows: list[int]) -> mx.array:
        """Logits of one decode step of `plan` for its `rows` (the live ones, in the
        scheduler's order); every row's KV is written to its buffer."""
        tokens = mx.array(
            [[self.reqs[rid].last_token if rid is not None else 0] for rid in plan.rids]
        )
        if self.compiled_step is not None:
            logits = plan.run(self.compiled_step, tokens)
        else:
            plan.begin_step()
            logits = self.model(tokens, cache=plan.layer_caches())[:, -1, :]
            plan.end_step()
        return logits if rows == list(range(len(plan.rids))) else logits[mx.array(rows)]

    def _take_lookahead(self, batch: DecodeBatch | None) -> _Lookahead | None:
        """The step computed ahead if `batch` is exactly it; otherwise undo it."""
        ahead, self.ahead = self.ahead, None
        self.lookahead_rids = None
        if ahead is None:
            return None
        same = batch is not None and not batch.release and batch.rids == ahead.rids
        if same and self.decode_plan is ahead.plan:
            return ahead
        ahead.plan.idx -= 1  # forget the column it wrote; the next real step overwrites it
        return None

    def _decode_plans(self, rids: list[str], states: list[ReqState]) -> list[DecodePlan]:
        """The decode buffer(s) for `rids`, rebuilt from the pool when the set changed."""
        if not self.batched:
            for rid, s in zip(rids, states):
                if rid not in self.solo_plans:
                    self.solo_plans[rid] = DecodePlan(self.pool, [rid], [s.slots])
            return [self.solo_plans[rid] for rid in rids]
        plan = self.decode_plan
        if plan is None or not plan.serves(rids):
            self._flush()
            slots = [s.slots for s in states]
            if plan is None or not plan.reseat(rids, slots):
                plan = self.decode_plan = DecodePlan(self.pool, rids, slots)
        return [plan]

    def _sample_and_record(
        self, logits: mx.array, states: list[ReqState], buffers: list[mx.array]
    ) -> StepOutput:
        """Sample one token per row, overlap host work with the step, record the results."""
        logits = apply_penalties(logits, [s.penalty for s in states])
        next_tok = sample(logits, [s.sampling for s in states], self._step_keys(states))
        top_n = max((s.sampling.top_logprobs for s in states if s.sampling.logprobs), default=-1)
        lp = logprobs(logits, next_tok, top_n) if top_n >= 0 else ()
        mx.async_eval(next_tok, *lp, *buffers)
        out = StepOutput([s.rid for s in states], next_tok.tolist())
        for s, tok in zip(states, out.next_token_ids):
            s.last_token = tok
            if s.penalty is not None:
                s.penalty.observe(tok)
        if lp:
            chosen, ids, vals = (x.tolist() for x in lp)
            out.logprobs = [c if s.sampling.logprobs else 0.0 for s, c in zip(states, chosen)]
            out.top_logprobs = [
                [[i, v] for i, v in zip(row_ids, row_vals)][: s.sampling.top_logprobs]
                if s.sampling.logprobs else []
                for s, row_ids, row_vals in zip(states, ids, vals)
            ]  # fmt: skip
        return out

    def _step_keys(self, states: list[ReqState]) -> list[mx.array | None]:
        keys = []
        for s in states:
            use = None
            if s.key is not None:
                s.key, use = KeySource.next(s.key)
            keys.append(use)
        return keys

    # ------------------------------------------------------------ release and flush

    def release(self, release: list[ReleaseReq]) -> None:
        """Flush (finished) or drop (aborted) requests before the scheduler reuses their slots."""
        if not release:
            return
        self._take_lookahead(None)
        dropped = {r.rid for r in release if not r.flush}
        self._flush(skip=dropped)
        plan = self.decode_plan
        if plan is not None:
            finished = {r.rid for r in release if r.flush}
            if plan.rids[0] in finished and len(plan.rids) == 1:
                self.kept = _Kept(plan, self.reqs[plan.rids[0]].slots)
            plan.drop({r.rid for r in release})
        for r in release:
            self.reqs.pop(r.rid, None)
            self.solo_plans.pop(r.rid, None)

    def _flush(self, skip: set[str] = frozenset()) -> None:
        """Write every decode token that is only in a decode buffer into the pool."""
        plans = list(self.solo_plans.values()) + ([self.decode_plan] if self.decode_plan else [])
        for plan in plans:
            n = plan.pending()
            if n == 0:
                continue
            rows = [i for i, rid in enumerate(plan.rids) if rid is not None and rid not in skip]
            plan.flush(rows, [self.reqs[plan.rids[i]].slots[-n:] for i in rows])
        mx.eval(self.pool.arrays())


def _holds(kept: _Kept, prefixes: list[list[int]]) -> bool:
    """Whether `kept` holds the one prefix in `prefixes`."""
    if len(prefixes) != 1:
        return False
    prefix = prefixes[0]
    return 0 < len(prefix) <= len(kept.slots) and kept.slots[: len(prefix)] == prefix


def _rounds(reqs: list[ExtendReq], step: int) -> list[tuple[list[ExtendReq], list[ExtendReq]]]:
    """Forward passes for one extend, in order, as (pieces, the requests they belong to).

    Each request's new tokens are cut into pieces of at most `step`; round k runs every
    request's k-th piece after round k-1 wrote its KV, so attention stays in cache-sized
    blocks. Within a round, pieces of very different lengths go in separate passes, so a
    64-token question is never padded to a 256-token piece of a long prompt."""
    passes = []
    for start in range(0, max(len(r.input_ids) for r in reqs), step):
        pieces = [(_piece(r, start, step), r) for r in reqs if start < len(r.input_ids)]
        pieces.sort(key=lambda pr: -len(pr[0].input_ids))
        group: list[tuple[ExtendReq, ExtendReq]] = []
        for piece, owner in pieces:
            if group and 2 * len(piece.input_ids) <= len(group[0][0].input_ids):
                passes.append(([p for p, _ in group], [o for _, o in group]))
                group = []
            group.append((piece, owner))
        passes.append(([p for p, _ in group], [o for _, o in group]))
    return passes


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
