"""Scheduler: the policy core, free of sockets so tests can drive it step by step.

Each iteration: admit a prefill batch if anything waits and fits, else decode every
running request. Results come back as sampled tokens; finished, aborted and retracted
requests give their slots back (to the trie or the allocator) only after a release for
the worker is queued, and every message to the worker carries the queued releases first.
"""

from __future__ import annotations

import logging
import time

from common.cache_salt import cache_namespace, namespaced_key
from common.kv_store.fingerprint import adapter_identity
from common.messages import (
    AbortReq,
    BlocksLoaded,
    DecodeBatch,
    EmbedBatch,
    EmbedOut,
    EmbedReq,
    EmbedResult,
    ExtendBatch,
    GenerateReq,
    LoadBatch,
    LoraUpdate,
    ReleaseBatch,
    ReleaseReq,
    ReqError,
    SchedulerStats,
    StepResult,
    TokenOut,
    WorkerError,
    WorkerReady,
)
from common.server_args import ServerArgs
from scheduler.cache import KVCacheManager
from scheduler.disk_tier import DiskIndex, PlannedLoad
from scheduler.embedding import EmbedQueue
from scheduler.lora_updates import LoraUpdates
from scheduler.memory_budget import RETRY_AFTER, MemoryBudget, wait_error, waited_too_long
from scheduler.prefill import PrefillBatch, build_prefill
from scheduler.request import Req
from scheduler.speculation import Speculator

logger = logging.getLogger("scheduler")

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001


class Scheduler:
    def __init__(self, args: ServerArgs, worker: WorkerReady):
        self.args = args
        self.context_len = args.context_length or worker.context_len
        self.eos_ids = frozenset(worker.eos_token_ids)
        self.generates = worker.generates  # False: an embedding model's body alone
        self.kv = KVCacheManager(
            worker.num_slots,
            args.max_running_requests + 1,
            args.disable_radix_cache,
            debug=args.debug_invariants,
            num_state_slots=worker.num_state_slots,
        )
        self.reqs: dict[str, Req] = {}
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.pending_release: list[ReleaseReq] = []
        self.outputs: list[TokenOut | ReqError | EmbedOut] = []
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.step = 0
        self.in_flight: PrefillBatch | list[Req] | EmbedBatch | None = None
        self.last_was_embed = False
        self.retracted = 0
        self.vision_counts = (0, 0)  # a vision worker's tower runs and tower-cache hits
        self.collective_seconds, self.collective_probes = 0.0, 0  # a distributed worker's
        self.last_was_prefill = False
        self.decode_steps = 0
        self.decode_tokens = 0  # tokens decode steps produced (more than rows with drafts)
        self.decode_rows = 0
        self._decode_log = (time.monotonic(), 0, 0)
        self.spec = Speculator(args, worker, self.kv, self.context_len, self.eos_ids)
        self.lora_updates = LoraUpdates(len(args.loras))  # the adapter ids it serves
        # --max-memory: what each step may hold (None: a worker that reports no figures)
        self.memory = MemoryBudget(worker.memory) if worker.memory is not None else None
        # embeddings: rows of no KV, in steps of their own between the others
        self.embeds = EmbedQueue(self.context_len, args.chunked_prefill_size, self.memory)
        # the disk tier (--kv-disk-dir), when the worker has one for this model
        self.disk = None
        self.loading: dict[int, list[PlannedLoad]] = {}  # LoadBatch step -> its loads
        if worker.disk_blocks is not None and not args.disable_radix_cache:
            states = worker.num_state_slots > 0
            adapters = [adapter_identity(spec.path) for spec in args.loras]
            window = worker.disk_window
            self.disk = DiskIndex(
                worker.disk_blocks, worker.disk_block_tokens, states, adapters, window
            )
            if states:
                self.kv.block_tokens = worker.disk_block_tokens
            self.kv.window = window  # matches end where the window holds KV

    # ------------------------------------------------------------ inputs

    def on_request(self, msg: GenerateReq | AbortReq | EmbedReq | LoraUpdate) -> None:
        if isinstance(msg, AbortReq):
            self.abort(msg.rid)
            return
        if isinstance(msg, EmbedReq):
            error = self.embeds.add(msg, msg.rid in self.reqs)
            if error is not None:
                self.outputs.append(error)
            return
        if isinstance(msg, LoraUpdate):  # run by the process between steps (lora_updates)
            refused = self.lora_updates.add(msg)
            if refused is not None:
                self.outputs.append(refused)
            return
        error = self._reject_reason(msg)
        if error is not None:
            status = 404 if error[0] == "model_not_found" else 400  # an adapter it lacks
            self.outputs.append(ReqError(msg.rid, error[1], code=error[0], status=status))
            return
        req = Req(msg.rid, list(msg.input_ids), msg.sampling)
        req.lora = msg.lora
        req.namespace = cache_namespace(msg.cache_salt, msg.lora)
        if self.disk is not None:
            req.disk_namespace = self.disk.namespace(msg.cache_salt, msg.lora)
        req.priority_len = max(0, min(msg.priority_prefix_len, len(req.input_ids)))
        req.images = msg.images
        self.reqs[req.rid] = req
        self.waiting.append(req)

    def adapters_changed(self, held_delta: int) -> None:
        """The worker's adapters hold `held_delta` bytes more (a load) or fewer (an
        unload): admission counts them with the rest the worker holds for good."""
        if self.memory is not None:
            self.memory.report.fixed += held_delta

    def _reject_reason(self, msg: GenerateReq) -> tuple[str, str] | None:
        n, max_new = len(msg.input_ids), msg.sampling.max_new_tokens
        if msg.rid in self.reqs:
            return "duplicate_request_id", f"request id {msg.rid!r} is already in use"
        if n == 0:
            return "invalid_request_error", "the prompt has no tokens"
        if not self.lora_updates.serves(msg.lora):
            return "model_not_found", f"no LoRA adapter of id {msg.lora} is loaded"
        if not self.generates:
            return "invalid_request_error", (
                "this model is an embedding model without an LM head: it serves /v1/embeddings only"
            )
        try:
            msg.sampling.validate()
        except ValueError as exc:
            return "invalid_request_error", str(exc)
        if n + max_new > self.context_len:
            return "context_length_exceeded", (
                f"prompt ({n} tokens) + max_new_tokens ({max_new}) exceeds the context "
                f"length of {self.context_len} tokens"
            )
        if n + max_new > self.kv.capacity:
            return "kv_pool_too_small", (
                f"prompt ({n} tokens) + max_new_tokens ({max_new}) can never fit in the KV "
                f"pool of {self.kv.capacity} tokens (--max-total-tokens)"
            )
        whole = msg.sampling.prompt_logprobs
        why = self.memory.never_fits(n, max_new, whole) if self.memory is not None else None
        if why is not None:
            return "insufficient_memory", why
        return None

    def abort(self, rid: str) -> None:
        if self.embeds.abort(rid):
            return
        req = self.reqs.get(rid)
        if req is None:
            return
        if req in self.waiting:
            self.waiting.remove(req)
            self._finish(req, "abort")
        else:
            req.to_abort = True  # running or in flight: handled when the step ends
            if self.in_flight is None:
                self._apply_aborts()

    # ------------------------------------------------------------ batches

    def next_batch(
        self,
    ) -> ExtendBatch | DecodeBatch | ReleaseBatch | EmbedBatch | LoadBatch | None:
        """The next message for the worker, or None when idle."""
        if self.disk is not None and (self.disk.saves or self.disk.touches):
            self.step += 1  # before any slot can be reused
            return ReleaseBatch(self.step, self._take_release(), *self.disk.take_saves())
        embed = self._embed_batch()
        if embed is not None:
            return embed
        # Prefetch: a prompt's blocks are read as soon as it waits, also while others
        # decode (a LoadBatch holds up no step), so they are in the pool by its turn.
        load = self._disk_load() if self.waiting and self.chunked is None else None
        if load is not None:
            return load
        prefill = None
        # After a prefill, running requests get one decode step before the next prefill, so
        # a stream of long prompts cannot stall them for several prefill steps in a row.
        decode_turn = self.last_was_prefill and bool(self.running)
        if (self.waiting or self.chunked) and not decode_turn:
            prefill = build_prefill(
                [r for r in self.waiting if not (r.disk_loading or r.disk_deferred)],
                self.chunked,
                self.running,
                self.kv,
                policy=self.args.schedule_policy,
                chunk_size=self.args.chunked_prefill_size,
                max_running=self.args.max_running_requests,
                new_token_ratio=self.new_token_ratio,
                memory=self.memory,
                max_loras=self.args.max_loras_per_batch,
            )
            if prefill is None and self.memory is not None:
                self._expire_memory_waits()
        self.last_was_prefill = prefill is not None
        if prefill is not None:
            return self._extend_batch(prefill)
        if self.running:
            return self._decode_batch()
        if self.pending_release:
            self.step += 1
            return ReleaseBatch(self.step, self._take_release())
        return None

    def _embed_batch(self) -> EmbedBatch | None:
        """Embedding rows take every other step while generation has work, so neither
        stalls the other; the releases wait for the next generation step."""
        others = bool(self.waiting or self.running or self.chunked)
        if not self.embeds.waiting or (self.last_was_embed and others):
            self.last_was_embed = False
            return None
        batch = self.embeds.next_batch(self.step + 1, [r.seq_len for r in self.running])
        if batch is None:  # not beside the running requests: after them
            self.last_was_embed = False
            return None
        self.step += 1
        self.in_flight = batch
        self.last_was_embed = True
        return batch

    def load_during_step(self) -> LoadBatch | None:
        """While a prefill or decode step is in flight: the loads of prompts that came
        meanwhile, to send at once. The worker then starts reading them as soon as that
        step ends, not one scheduling round later (its result back here, this batch
        built and sent), and they no longer wait behind a long prefill's result."""
        if not isinstance(self.in_flight, (PrefillBatch, list)) or self.chunked is not None:
            return None
        if self.disk is not None and self.disk.saves:
            return None  # (their ReleaseBatch goes first: next_batch)
        return self._disk_load() if self.waiting else None

    def _disk_load(self) -> LoadBatch | None:
        """Blocks of waiting prompts to bring back from the disk tier before they are
        admitted (their match then runs through them)."""
        if self.disk is None:
            return None
        # a chunked prefill's next chunks were counted on; each running request (and each
        # one a prefill in flight adds) needs a slot at its next decode step: a load
        # leaves room for them
        joining = len(self.in_flight.reqs) if isinstance(self.in_flight, PrefillBatch) else 0
        planned = self.disk.plan(self.waiting, self.kv, reserve=len(self.running) + joining)
        if not planned:
            return None
        self.step += 1
        self.loading[self.step] = planned
        for plan in planned:
            plan.req.disk_loading = True  # not admitted before its blocks are in the pool
        loads = [x for p in planned for x in p.loads]
        return LoadBatch(self.step, loads, self._take_release())

    def on_loaded(self, answer: BlocksLoaded) -> None:
        """The worker read a LoadBatch's blocks into the pool (any time, also while a
        step is in flight): they join the trie, their prompts may be admitted."""
        planned = self.loading.pop(answer.step, None)
        if planned is None:
            return
        self.disk.on_report(answer.disk)
        self.disk.loaded(self.kv, planned, answer)
        for plan in planned:
            plan.req.disk_loading = False
        # (a step in flight holds slots of requests that join the running set after it:
        # the check after its result covers this load too)
        if self.args.debug_invariants and self.in_flight is None:
            self.check_invariants()

    def _extend_batch(self, batch: PrefillBatch) -> ExtendBatch:
        now = time.monotonic()
        for req in batch.reqs:
            if req in self.waiting:
                self.waiting.remove(req)
            if req.queue_time < 0:
                req.queue_time = now - req.arrival
        last = batch.extend[-1]
        self.chunked = None if last.last_chunk else batch.reqs[-1]
        self.in_flight = batch
        self.step += 1
        logger.info(
            "Prefill batch, #new-seq: %d, #new-token: %d, #cached-token: %d, %s"
            "token usage: %.2f, #running-req: %d, #queue-req: %d",
            len(batch.reqs),
            batch.new_tokens,
            batch.cached_tokens,
            self.disk.log_field(batch.reqs) if self.disk is not None else "",
            self.kv.token_usage(),
            len(self.running),
            len(self.waiting),
        )
        return ExtendBatch(self.step, batch.extend, self._take_release())

    def _decode_batch(self) -> DecodeBatch:
        while len(self.running) > 1 and (
            self.kv.budget() < len(self.running)
            or (self.memory and self.memory.over([r.seq_len for r in self.running]))
        ):
            self._retract_one()
        locs = self.kv.alloc(len(self.running))
        if locs is None:
            raise RuntimeError("no KV slot for a lone running request")  # rejected at entry
        for req, loc in zip(self.running, locs):
            self.kv.append_decode_slot(req, loc)
        drafts, draft_slots = self.spec.draft(self.running)
        self.in_flight = list(self.running)
        self.step += 1
        self.new_token_ratio = max(
            MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
        )
        lookahead = not (
            self.args.disable_overlap_schedule or self.waiting or self.chunked or drafts
        ) and all(
            r.remaining_new_tokens >= 2 for r in self.running
        )  # nothing to prefill next and nobody reaches max_new_tokens at this step
        # (a step with drafts has a variable outcome: nothing can be computed ahead, and
        # rows that may draft next would throw such a step away)
        lookahead = lookahead and not self.spec.active(self.running)
        rids = [r.rid for r in self.running]
        return DecodeBatch(
            self.step, rids, locs, self._take_release(), lookahead, drafts, draft_slots,
            worker_drafts=self.spec.worker_drafts,
        )  # fmt: skip

    def _expire_memory_waits(self) -> None:
        """Waiting requests that found no memory beside the running ones for longer than
        --memory-wait-timeout get a 503 (they fit alone: see `_reject_reason`)."""
        for req in waited_too_long(self.waiting, self.args.memory_wait_timeout):
            self.waiting.remove(req)
            self.reqs.pop(req.rid, None)
            self.spec.forget(req.rid)
            self.outputs.append(wait_error(req, len(self.running)))

    def _retract_one(self) -> None:
        """Send the request with the least progress back to the queue; its KV stays cached."""
        req = min(self.running, key=lambda r: (len(r.output_ids), -r.arrival))
        self.running.remove(req)
        self._release(req, keep=True)
        self.waiting.insert(0, req)
        self.retracted += 1
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        logger.info(
            "Retract request %s (%d generated), #running-req: %d",
            req.rid,
            len(req.output_ids),
            len(self.running),
        )

    def _release(self, req: Req, keep: bool, finished: bool = False) -> None:
        """Give `req`'s slots back and queue the worker's release: flush and keep the KV
        (and a snapshot of the final state) in the trie, or drop it. A finished request's
        blocks go to the disk tier (the ReleaseBatch next_batch sends first)."""
        save = finished and self.disk is not None
        tokens = req.fill_ids[: len(self.kv.req_to_token.get(req.rid))] if save else []
        snapshot = self.kv.release(req, keep)
        self.pending_release.append(ReleaseReq(req.rid, flush=keep, snapshot=snapshot))
        if save:
            self.disk.save_finished(self.kv, req, tokens)

    def _take_release(self) -> list[ReleaseReq]:
        release, self.pending_release = self.pending_release, []
        return release

    # ------------------------------------------------------------ results

    def on_result(self, result: StepResult | WorkerError | EmbedResult) -> None:
        batch, self.in_flight = self.in_flight, None
        if self.disk is not None:
            self.disk.on_report(getattr(result, "disk", None))
        if isinstance(batch, EmbedBatch):
            self.outputs.extend(self.embeds.answer(batch, result))
            self._apply_aborts()  # those that came while it ran
            return
        if getattr(result, "vision_counts", None):
            self.vision_counts = tuple(result.vision_counts)
        if getattr(result, "collective_seconds", 0.0):
            self.collective_seconds = result.collective_seconds
            self.collective_probes += 1
        if isinstance(result, WorkerError):
            self._fail_step(batch, result.message, result.out_of_memory)
        elif isinstance(batch, PrefillBatch):
            self._after_prefill(batch, result)
        else:
            self._after_decode(batch, result)
        self._apply_aborts()
        if self.args.debug_invariants:
            self.check_invariants()

    def _after_prefill(self, batch: PrefillBatch, result: StepResult) -> None:
        row = {rid: i for i, rid in enumerate(result.rids)}
        for req, ext in zip(batch.reqs, batch.extend):
            self.kv.cache_unfinished(req)
            if ext.last_chunk:
                self._append_token(req, result, row[req.rid], joined=True)

    def _after_decode(self, batch: list[Req], result: StepResult) -> None:
        before = [len(r.output_ids) for r in batch]
        spec = self.spec if self.spec.enabled else None  # no per-row calls without it
        for i, req in enumerate(batch):
            if spec is not None and spec.take_drafted(req, result, i):
                self._after_tokens(req, joined=False)
            else:
                self._append_token(req, result, i, joined=False)
            if spec is not None:
                spec.observe(req, result, i, req.output_ids[before[i]])
        self.spec.end_step(result)
        self.decode_tokens += sum(len(r.output_ids) for r in batch) - sum(before)
        self.decode_rows += len(batch)
        self.decode_steps += 1
        if self.decode_steps % self.args.decode_log_interval == 0:
            self._log_decode()

    def _append_token(self, req: Req, result: StepResult, row: int, joined: bool) -> None:
        req.output_ids.append(result.next_token_ids[row])
        if joined and result.prompt_logprobs and req.prompt_logprobs is None:
            # a retracted request's later prefill covers its outputs too: the first counts
            req.prompt_logprobs = result.prompt_logprobs[row]
        if req.sampling.logprobs and result.logprobs is not None:
            req.logprobs.append(result.logprobs[row])
            req.top_logprobs.append(result.top_logprobs[row])
        req.check_finished(self.eos_ids)
        self._after_tokens(req, joined)

    def _after_tokens(self, req: Req, joined: bool) -> None:
        if req.finish_reason is None:
            if joined:
                self.running.append(req)
            self._emit(req)
            return
        if not joined:
            self.running.remove(req)
        self._release(req, keep=True, finished=True)
        self._finish(req, req.finish_reason)

    def _apply_aborts(self) -> None:
        for req in [r for r in self.running + [self.chunked] if r is not None and r.to_abort]:
            if req is self.chunked:
                self.chunked = None
            else:
                self.running.remove(req)
            self._release(req, keep=False)
            self._finish(req, "abort")

    def _fail_step(
        self, batch: PrefillBatch | list[Req] | None, message: str, oom: bool = False
    ) -> None:
        reqs = batch.reqs if isinstance(batch, PrefillBatch) else (batch or [])
        logger.error("worker failed a step of %d requests: %s", len(reqs), message)
        self.spec.end_step()
        for req in reqs:
            if req is self.chunked:
                self.chunked = None
            if req in self.running:
                self.running.remove(req)
            if req.rid in self.kv.req_to_token:
                self._release(req, keep=False)
            self.reqs.pop(req.rid, None)
            if oom:  # the worker goes on: the same request may fit later
                error = ReqError(req.rid, message, "out_of_memory", 503, RETRY_AFTER)
            else:
                error = ReqError(req.rid, message, code="internal_error", status=500)
            self.outputs.append(error)

    def _finish(self, req: Req, reason: str) -> None:
        req.finish_reason = reason
        self.reqs.pop(req.rid, None)
        self.spec.forget(req.rid)
        self._emit(req)

    def _emit(self, req: Req) -> None:
        start = req.sent_len
        with_lp = req.sampling.logprobs and len(req.logprobs) == len(req.output_ids)
        self.outputs.append(
            TokenOut(
                rid=req.rid,
                token_ids=req.output_ids[start:],
                finish_reason=req.finish_reason,
                prompt_tokens=len(req.input_ids),
                completion_tokens=len(req.output_ids),
                cached_tokens=max(req.cached_tokens, 0),
                disk_cached_tokens=min(req.disk_tokens, max(req.cached_tokens, 0)),
                logprobs=req.logprobs[start:] if with_lp else None,
                top_logprobs=req.top_logprobs[start:] if with_lp else None,
                queue_time=max(req.queue_time, 0.0) if start == 0 else 0.0,
                prompt_logprobs=req.prompt_logprobs if start == 0 else None,
            )
        )
        req.sent_len = len(req.output_ids)

    def take_outputs(self) -> list[TokenOut | ReqError | EmbedOut]:
        out, self.outputs = self.outputs, []
        return out

    # ------------------------------------------------------------ observability

    def _log_decode(self) -> None:
        now = time.monotonic()
        then, tokens_then, rows_then = self._decode_log
        tokens = sum(len(r.output_ids) for r in self.running)
        made, rows = self.decode_tokens - tokens_then, self.decode_rows - rows_then
        self._decode_log = (now, self.decode_tokens, self.decode_rows)
        # with speculation, SGLang's "accept len": tokens per request and step
        accept = f", accept len: {made / max(rows, 1):.2f}" if self.spec.enabled else ""
        logger.info(
            "Decode batch, #running-req: %d, #token: %d, token usage: %.2f, "
            "gen throughput (token/s): %.2f, #queue-req: %d%s",
            len(self.running),
            tokens + sum(len(r.input_ids) for r in self.running),
            self.kv.token_usage(),
            made / max(now - then, 1e-9),
            len(self.waiting),
            accept,
        )

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_queued=len(self.waiting),
            token_usage=self.kv.token_usage(),
            capacity=self.kv.capacity,
            evicted_tokens=self.kv.evicted_tokens,
            retracted_requests=self.retracted,
            collective_seconds=self.collective_seconds,
            collective_probes=self.collective_probes,
            vision_tower_runs=self.vision_counts[0],
            vision_cache_hits=self.vision_counts[1],
        )

    def take_evicted(self) -> list[list[int]]:
        """The trie's evicted paths since the last call (see CacheEvicted), less those a
        queued or running request starts with: it caches them again, so the router's
        guess that they are here stays true."""
        paths, self.kv.tree.evicted_paths = self.kv.tree.evicted_paths, []
        if not paths:
            return []
        keys = [namespaced_key(r.input_ids, r.namespace) for r in self.waiting + self.holders()]
        return [p for p in paths if not any(key[: len(p)] == p for key in keys)]

    def holders(self) -> list[Req]:
        """Requests that hold slots in ReqToTokenPool."""
        return self.running + ([self.chunked] if self.chunked else [])

    def check_invariants(self) -> None:
        loads = [x for ps in self.loading.values() for p in ps for x in p.loads]
        states = [x.state_slot for x in loads if x.state_slot]
        self.kv.check_invariants(self.holders(), [s for x in loads for s in x.slots], states)

    @property
    def busy(self) -> bool:
        # others wait for the disk
        waiting = any(not (r.disk_loading or r.disk_deferred) for r in self.waiting)
        saves = self.disk is not None and bool(self.disk.saves or self.disk.touches)
        return bool(
            waiting or self.running or self.chunked or self.pending_release or saves
            or self.embeds.waiting or self.lora_updates.queue
        )  # fmt: skip
