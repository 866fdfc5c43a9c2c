"""ModelRunner: executes the scheduler's extend and decode descriptors on one mlx-lm model.

It owns each decoding request's `Decoding` (decoding.py: its sampling state and last
token) and the KV ledger (kv_ledger.py: where each request's KV is, the decode
buffer and its rows, the deferred flush and the lookahead's bets). Where a request's KV
is at any moment is `kv_location`. Descriptors are checked against the pool bounds, not
trusted.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from common.lora_adapters import LoraSpec
from common.messages import DecodeBatch, ExtendBatch, ExtendReq, LoraUpdate, LoraUpdated, ReleaseReq
from worker_mlx.decode_step import DecodeStep
from worker_mlx.decoding import Decoding, StepOutput, sample_and_record
from worker_mlx.descriptor_checks import check_extend, check_slots
from worker_mlx.extend_pass import ExtendPlan, passes
from worker_mlx.grammar import Grammars
from worker_mlx.kv_ledger import KVLedger, KVLocation
from worker_mlx.kv_pool import MlxKVPool
from worker_mlx.lora import NO_LORA, LoraBank, NoLora
from worker_mlx.model_probe import split_lm_head
from worker_mlx.prompt_logprobs import prompt_logprobs
from worker_mlx.sampler import KeySource
from worker_mlx.state_pool import StatePool

NO_DRAFTS = "this model cannot verify drafts (sliding windows or recurrent layers)"


def verifies_drafts(batched: bool, layout) -> bool:
    """Whether a runner can verify drafts. They are verified on the decode buffer, whose
    holes the RoPE positions skip: a sliding window counts columns and a recurrent state
    cannot drop a rejected token, so those models decode without speculation."""
    return batched and not layout.recurrent and not any(layout.windows)


class ModelRunner:
    """`batched=False` runs every request as its own batch of one with integer offsets, each
    decode step an extend of one token on the pool: the fallback for models whose attention
    cannot take per-row offset arrays. `pad_prefill=False` keeps decode batched but runs
    prefill rows of different lengths in separate passes: for recurrent layers that read
    a right-padded row's state at the padding (mlx-lm's Mamba-2).

    Every mode is chosen here, once: nothing assigns a runner's attribute from outside.
    `pipeline_stage` (--pp-size): evaluate every forward pass whole and alone, so its sends
    meet the next stage's receives (docs/architecture.md); `memory`: the loader's
    MemoryReport, what --max-memory allows and holds. Speculation wraps a runner
    (speculation.Verifier); the runner knows nothing of it."""

    def __init__(
        self, model: nn.Module, pool: MlxKVPool, vocab_size: int, seed: int = 0,
        batched: bool = True, prefill_step: int = 256, compile_decode: bool = False,
        grammars: Grammars | None = None, states: StatePool | None = None,
        pad_prefill: bool = True, pipeline_stage: bool = False, memory=None,
        lora: LoraBank | NoLora = NO_LORA, vision=None,
    ):  # fmt: skip
        self.model = model
        self.pool = pool
        self.states = states  # the recurrent layers' states, for models that have them
        self.pad_prefill = pad_prefill  # rows of different lengths share a prefill pass
        self.vocab_size = vocab_size
        self.batched = batched
        self.prefill_step = prefill_step
        self.keys = KeySource(seed)
        self.decodings: dict[str, Decoding] = {}
        self.ledger = KVLedger(pool, states)  # where each decoding request's KV is
        self.body, self.head = split_lm_head(model)
        self.lora = lora  # the LoRA adapters (lora.py), their layers wrapped in `model`
        self.decode_step = DecodeStep(model, compile_decode, pool.layout, lora=lora)
        self.lookahead = self.ledger.lookahead
        self.grammars = grammars
        self.verifies_drafts = verifies_drafts(batched, pool.layout)
        self.memory = memory
        # a vision model's VisionPasses (vision_pass.py): its passes' positions and images
        self.vision = vision
        # the decode step of this batching mode, and when a pass is evaluated
        self._step = self._decode_batched if batched else self._decode_solo
        self._settle = self._settle_stage if pipeline_stage else self._settle_before_read

    def kv_location(self, rid: str) -> KVLocation:
        """Where `rid`'s KV is now (a request between its last prefill chunk and release)."""
        return self.ledger.where(rid)

    @property
    def runner(self) -> ModelRunner:
        """The engine's runner (worker.serve drives a runner or a Verifier around one)."""
        return self

    @property
    def buffer(self):
        """The decode buffer (the ledger's)."""
        return self.ledger.buffer

    # ------------------------------------------------------------ extend

    def extend(self, batch: ExtendBatch) -> StepOutput:
        out = self._extend(batch)
        if any(r.sampling.prompt_logprobs and r.last_chunk for r in batch.reqs):
            out.prompt_logprobs = prompt_logprobs(
                self.body, self.head, batch.reqs, out.rids, self.lora
            )
        return out

    def _extend(self, batch: ExtendBatch) -> StepOutput:
        self.release(batch.release)
        for r in batch.reqs:
            self._check_extend(r)
        if self.batched and all(len(r.input_ids) == 1 and r.last_chunk for r in batch.reqs):
            return self._extend_one_token(batch.reqs)
        pool = self.ledger.readable_pool()
        groups = [batch.reqs] if self.batched else [[r] for r in batch.reqs]
        steps = [p for reqs in groups for p in passes(reqs, self.prefill_step, self.pad_prefill)]
        last_logits, decodings, order = [], [], []
        position = {id(r): i for i, r in enumerate(batch.reqs)}
        for n, (pieces, owners) in enumerate(steps):
            hidden = self._pass(pool, pieces, self.body)
            sampled = [i for i, p in enumerate(pieces) if p.last_chunk]
            if sampled:
                rows = mx.array(sampled, dtype=mx.int32)
                cols = mx.array([len(pieces[i].input_ids) - 1 for i in sampled], mx.int32)
                last_logits.append(self.head(hidden[rows, cols]))
                decodings += [self._new_decoding(owners[i]) for i in sampled]
                order += [position[id(owners[i])] for i in sampled]
            self._settle(hidden, last_logits, last=n + 1 == len(steps))
            # A pass none of whose rows ends here leaves `hidden` unevaluated, its graph
            # holding the pool as that pass's reads saw it: alive into the next pass, the
            # pool would have two users, and the next write would copy all of it (a piece
            # of a token or two, whose attention never evaluates its reads: 1 GiB a layer).
            del hidden
        if not decodings:
            mx.eval(self.ledger.arrays())
            return StepOutput([], [])
        # answer in descriptor order, whichever round each request finished in
        perm = sorted(range(len(order)), key=order.__getitem__)
        logits = mx.concatenate(last_logits)[mx.array(perm)]
        self._open([r for r in batch.reqs if r.last_chunk])
        return self._start_decoding(logits, [decodings[i] for i in perm])

    def _open(self, reqs: list[ExtendReq]) -> None:
        """From now on `reqs` decode, their KV at their prefix and new slots."""
        for r in reqs:
            skip = self.vision.rope_skip(r) if self.vision else 0
            self.ledger.open(r.rid, r.prefix_slot_ids + r.out_cache_loc, r.state_slot, skip)

    def _extend_one_token(self, reqs: list[ExtendReq]) -> StepOutput:
        """Prompts whose every token but the last is cached (a repeated prompt): the step
        is a decode step, so it runs as one on a decode buffer, which the next decode of
        the same requests then keeps using instead of gathering it again. The buffer of
        the request that just sent the same prompt still holds it, so it needs no gather
        (0.5-1 ms of the 6 ms a 2,048-token repeat spends in the worker)."""
        decodings = [self._new_decoding(r) for r in reqs]
        skips = [self.vision.rope_skip(r) for r in reqs] if self.vision else []
        buffer = self.ledger.one_token_rows(reqs, skips)
        with self.lora.rows_of(self._adapters(buffer.rids, decodings)):
            logits = buffer.step(self.decode_step, mx.array([r.input_ids for r in reqs]))
        self._open(reqs)
        self.ledger.write_pending()  # in the pool now: another prompt may share this token
        self._snapshot(reqs)
        return self._start_decoding(logits, decodings)

    def _start_decoding(self, logits: mx.array, decodings: list[Decoding]) -> StepOutput:
        """Sample the extended requests' first tokens (their KV opened in the ledger)."""
        out = sample_and_record(logits, decodings, self.ledger.arrays(), self.grammars)
        for s in decodings:
            self.decodings[s.rid] = s
        return out

    def _pass(self, pool, reqs: list[ExtendReq], forward) -> mx.array:
        """One prefill pass, `forward(tokens, caches)`, over right-padded rows of `pool`
        (the ledger's `readable_pool`); the recurrent states it leaves go to the rows'
        working slots and the snapshots asked for."""
        plan = ExtendPlan.for_reqs(pool, reqs, self.states)
        tokens = mx.array([r.input_ids + [0] * (plan.L - len(r.input_ids)) for r in reqs])
        extra = self.vision.inputs(reqs, plan.L) if self.vision else {}
        with self.lora.rows_of([r.lora for r in reqs]):
            out = forward(tokens, plan.layer_caches(), **extra)
        plan.store_states()
        self._snapshot(reqs)
        return out

    def _settle_before_read(self, hidden: mx.array, logits: list, last: bool) -> None:
        """After a pass: evaluated now only if another pass of the step reads its KV."""
        if not last:
            mx.eval(self.ledger.arrays(), logits)

    def _settle_stage(self, hidden: mx.array, logits: list, last: bool) -> None:
        """A pipeline stage's pass is evaluated whole and alone, `hidden` included, so
        its sends meet the next stage's receives."""
        mx.eval(self.ledger.arrays(), logits, hidden)

    def _snapshot(self, reqs: list[ExtendReq]) -> None:
        """Copy the working states of `reqs` to the snapshot slots they ask for (after the
        whole of their input: `passes` cut pieces where the snapshots are)."""
        pairs = [(r.state_slot, slot) for r in reqs for _, slot in r.snapshots]
        if pairs:
            self.ledger.states.copy(pairs)

    def _check_extend(self, r: ExtendReq) -> None:
        if r.rid in self.decodings:
            raise ValueError(f"{r.rid}: extend for a request that is already decoding")
        check_extend(r, self.pool.num_slots, self.ledger.states.num_slots, self.vocab_size)

    def _new_decoding(self, r: ExtendReq) -> Decoding:
        if self.vision is not None:
            r = self.vision.real_ids(r)  # penalties see an image's placeholders
        return Decoding.for_extend(r, self.keys, self.grammars)

    # ------------------------------------------------------------ decode

    def decode(self, batch: DecodeBatch) -> StepOutput:
        """One step of every row of `batch`: the step computed ahead if the lookahead bet
        on it, else this runner's step (batched or solo, chosen at construction)."""
        self.check_decode(batch)
        ahead = self.lookahead.take_step(batch)
        self.release(batch.release, keep_buffer=False)  # the decode below changes it
        decodings = self.decoding(batch.rids)
        if ahead is not None:
            out = StepOutput(list(batch.rids), ahead.tolist())
            for s, tok in zip(decodings, out.next_token_ids):
                s.last_token = tok
        else:
            out = self._step(decodings, batch.out_cache_loc)
        for rid, slot in zip(batch.rids, batch.out_cache_loc):
            self.ledger.add(rid, [slot])
        can_look = self.batched and all(
            s.sampling.greedy and s.penalty is None and not s.sampling.logprobs and not s.grammar
            for s in decodings
        )
        self.lookahead.expect_step(list(batch.rids) if batch.lookahead and can_look else None)
        return out

    def check_decode(self, batch: DecodeBatch) -> None:
        if len(batch.out_cache_loc) != len(batch.rids):
            raise ValueError(f"{len(batch.rids)} requests but {len(batch.out_cache_loc)} slots")
        check_slots("decode", batch.out_cache_loc, self.pool.num_slots)
        if any(batch.drafts) and not self.verifies_drafts:
            raise ValueError(
                "this model cannot verify drafts (sliding windows or recurrent layers)"
            )

    def decoding(self, rids: list[str]) -> list[Decoding]:
        """The Decoding of each of `rids`, which must all be decoding."""
        unknown = [rid for rid in rids if rid not in self.decodings]
        if unknown:
            raise ValueError(f"decode for unknown requests {unknown[:4]}")
        return [self.decodings[rid] for rid in rids]

    def step_columns(self, rids: list[str], tokens: list[list[int]]) -> mx.array:
        """Logits (len(rids), S, V) of one step of S columns of the decode buffer, row i
        taking `tokens[i]` (a speculative step: the caller writes its columns to the pool
        at its own slots, `KVLedger.write_pending`, the only unflushed ones)."""
        buffer = self.ledger.rows(rids, flushed=True)
        blank = [0] * len(tokens[0])
        of = dict(zip(rids, tokens))
        grid = [of.get(rid, blank) if rid is not None else blank for rid in buffer.rids]
        with self.lora.rows_of(self._adapters(buffer.rids)):
            logits = buffer.step(self.decode_step, mx.array(grid))
        return logits[mx.array(buffer.rows(rids))]

    def _decode_batched(self, decodings: list[Decoding], slots: list[int]) -> StepOutput:
        rids = [s.rid for s in decodings]
        buffer = self.ledger.rows(rids)
        logits = self._buffer_step(buffer.rows(rids))
        return sample_and_record(logits, decodings, buffer.arrays(), self.grammars)

    def _decode_solo(self, decodings: list[Decoding], slots: list[int]) -> StepOutput:
        """The fallback: each request's step is an extend of its last token on the pool."""
        parts = []
        pool = self.ledger.readable_pool()
        for n, (s, slot) in enumerate(zip(decodings, slots)):
            home = self.ledger.state_slot(s.rid)
            step = ExtendReq(
                s.rid, [s.last_token], self.ledger.slots(s.rid), [slot], s.sampling,
                state_slot=home, prefix_state=home, lora=s.lora,
            )  # fmt: skip
            forward = lambda t, c, **kw: self.model(t, cache=c, **kw)  # noqa: E731
            parts.append(self._pass(pool, [step], forward)[:, -1, :])
            # the row's logits evaluated before the next row's pass writes the pool: left
            # lazy, their graph holds the pool and that write copies all of it (as in
            # `_extend`)
            self._settle(parts[-1], parts[-1:], last=n + 1 == len(decodings))
        logits = parts[0] if len(parts) == 1 else mx.concatenate(parts)
        return sample_and_record(logits, decodings, self.ledger.arrays(), self.grammars)

    def _buffer_step(self, rows: list[int]) -> mx.array:
        """Logits of one step of the decode buffer for its `rows` (the live ones, in the
        scheduler's order); every row's KV is written to the buffer."""
        buffer = self.buffer
        tokens = mx.array(
            [[self.decodings[rid].last_token if rid is not None else 0] for rid in buffer.rids]
        )
        with self.lora.rows_of(self._adapters(buffer.rids)):
            logits = buffer.step(self.decode_step, tokens)
        return logits if rows == list(range(len(buffer.rids))) else logits[mx.array(rows)]

    def _adapters(self, rids: list[str | None], joining: list[Decoding] = ()) -> list[int]:
        """The LoRA adapter of each buffer row (0: none, and for a dead row), of decoding
        requests or `joining` ones."""
        of = {s.rid: s.lora for s in joining}
        return [
            0 if rid is None else of[rid] if rid in of else self.decodings[rid].lora for rid in rids
        ]

    def run_ahead(self) -> None:
        """Start the decode step the last descriptor said comes next (called after the reply
        went out, so it computes while the scheduler works)."""
        rids, buffer = self.lookahead.next_step, self.buffer
        self.lookahead.expect_step(None)
        rows = buffer.rows(rids) if rids is not None and buffer is not None else None
        if rows is None:
            return

        def compute() -> mx.array:
            tokens = mx.argmax(self._buffer_step(rows), axis=-1)
            mx.async_eval(tokens, buffer.arrays())
            return tokens

        self.lookahead.step_ahead(buffer, rids, compute)

    def update_lora(self, msg: LoraUpdate) -> LoraUpdated:
        """Load or unload a LoRA adapter between steps (the scheduler sends an unload once
        the adapter's requests are done). The compiled decode step holds the adapters'
        stacks as constants: it is traced afresh."""
        before = self.lora.nbytes
        try:
            if msg.path:
                self.lora.load(msg.lora, LoraSpec(msg.name, msg.path))
            else:
                self.lora.unload(msg.lora)
        except (ValueError, KeyError, OSError) as exc:
            return LoraUpdated(msg.rid, msg.lora, f"LoRA adapter {msg.name}: {exc}", msg.step)
        self.decode_step.retrace()
        return LoraUpdated(msg.rid, msg.lora, "", msg.step, self.lora.nbytes - before)

    # ------------------------------------------------------------ release and flush

    def release(self, release: list[ReleaseReq], keep_buffer: bool = True) -> None:
        """Flush (finished) or drop (aborted) requests before the scheduler reuses their slots.
        With `keep_buffer`, the buffer of a finished request that ran alone is kept for the
        same prompt again (see Lookahead)."""
        if not release:
            return
        self.ledger.release(release, keep_buffer)
        for r in release:
            self.decodings.pop(r.rid, None)

    def recover(self) -> None:
        """After a step ran out of memory: free its temporaries, write what only the
        decode buffer holds into the pool (an extend flushed it first, so this is
        nothing then; a failed decode's rows are released next anyway) and drop the
        buffer, which the next decode rebuilds from the pool."""
        self.ledger.reset()
