"""Choosing the next prefill batch: policy order, KV budget, chunking, shared prefixes.

A request is admitted while the pool can hold its new tokens plus a share of its future
decode tokens (`new_token_ratio`, as SGLang estimates), the batch stays within
`--chunked-prefill-size` new tokens, and the running set within `--max-running-requests`.
A request that shares a long uncached prefix with one already picked waits a round: the
picked one computes the prefix, inserts it into the trie, and the others then match it
(for a model with recurrent layers, the picked one also snapshots its state there).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from common.messages import ExtendReq, ImagePart
from scheduler.cache import Admission, KVCacheManager
from scheduler.memory_budget import MemoryBudget
from scheduler.request import Req

LPM_MAX_WAITING = 128  # above this, matching every waiting prompt costs more than it saves
IN_BATCH_PREFIX_MIN = 32  # shared uncached tokens that make a request wait for its twin


@dataclass
class PrefillBatch:
    reqs: list[Req]
    extend: list[ExtendReq]
    new_tokens: int
    cached_tokens: int


def order_waiting(waiting: list[Req], kv: KVCacheManager, policy: str) -> list[tuple[Req, int]]:
    """Waiting requests with their cached-prefix length, in policy order."""
    matched = [(r, len(kv.match(r))) for r in waiting]
    if policy == "lpm" and len(waiting) <= LPM_MAX_WAITING:
        matched.sort(key=lambda rm: -rm[1])  # stable: ties keep arrival order
    return matched


def build_prefill(
    waiting: list[Req],
    chunked: Req | None,
    running: list[Req],
    kv: KVCacheManager,
    *,
    policy: str,
    chunk_size: int,
    max_running: int,
    new_token_ratio: float,
    memory: MemoryBudget | None = None,
    max_loras: int = 1 << 30,
) -> PrefillBatch | None:
    """Admit what fits; `chunked` (a prefill in progress) always goes first. With
    `memory`, a request's chunk is shrunk to what the step's peak memory allows beside the
    running requests; one that cannot get even the smallest chunk waits (its
    `memory_blocked` records since when). A request of a LoRA adapter joins only while the
    running set and the batch hold at most `max_loras` distinct adapters with it (so every
    decode step does too); others go past it."""
    token_budget = chunk_size
    kv_budget = kv.budget() - sum(int(r.remaining_new_tokens * new_token_ratio) for r in running)
    seats = max_running - len(running) - (1 if chunked else 0)  # a chunked one holds a seat
    if seats <= 0 and chunked is None:
        return None  # a full running set: skip matching every waiting prompt
    batch = PrefillBatch([], [], 0, 0)
    running_lens = [r.seq_len for r in running]
    decoding = list(running_lens)  # and the requests whose prompt this step completes
    rows: list[tuple[int, int]] = []  # (tokens before, new tokens) of each picked row
    candidates = [(chunked, chunked.cache_len)] if chunked else []
    candidates += order_waiting(waiting, kv, policy)
    adapters = {r.lora for r in running + [chunked] * bool(chunked) if r.lora}
    for req, matched in candidates:
        if token_budget <= 0 or (req is not chunked and seats <= 0):
            break
        if req.lora and req.lora not in adapters and len(adapters) >= max_loras:
            continue  # --max-loras-per-batch: it waits for a running adapter to finish
        new = req.seq_len - (req.num_computed if req is chunked else matched)
        twin = None if req is chunked else _twin(req, matched, batch.reqs)
        if twin is not None:
            i, shared = twin
            kv.snapshot_for_twin(batch.reqs[i], batch.extend[i], shared)
            continue
        future = int(min(req.remaining_new_tokens, 4096) * new_token_ratio)
        if req is not chunked and new + future > kv_budget:
            break
        chunk = token_budget
        if memory is not None:
            before = req.seq_len - new
            chunk = memory.largest_chunk(running_lens, rows, before, min(new, token_budget))
            if req is not chunked and not memory.can_join(decoding, req.seq_len):
                chunk = 0
            if chunk >= new and req.sampling.prompt_logprobs:  # the prompt's pass after it
                if memory.whole_prompt_bytes(running_lens, req.seq_len) > memory.headroom:
                    chunk = 0
            if chunk == 0:
                req.memory_blocked = req.memory_blocked or time.monotonic()
                break
        admitted = kv.admit(req, chunk)
        if admitted is None:
            break
        req.memory_blocked = 0.0
        if req.lora:
            adapters.add(req.lora)
        # the admission's own match decides (an earlier one in this batch may have evicted
        # part of the prefix matched above)
        take, prefix = len(admitted.out_cache_loc), admitted.prefix_slot_ids
        batch.reqs.append(req)
        batch.extend.append(_extend_req(req, admitted))
        if req.cached_tokens < 0:
            req.cached_tokens = len(prefix)
        batch.new_tokens += take
        batch.cached_tokens += len(prefix)
        token_budget -= take
        kv_budget -= take + future
        seats -= 0 if req is chunked else 1
        rows.append((req.num_computed - take, take))
        if req.num_computed < req.seq_len:
            break  # a chunk cut short (by memory): this request is the step's chunked one
        decoding.append(req.seq_len)
    return batch if batch.reqs else None


def _extend_req(req: Req, adm: Admission) -> ExtendReq:
    fill, prefix = req.fill_ids, adm.prefix_slot_ids
    new = fill[len(prefix) : req.num_computed]
    last = req.num_computed == req.seq_len
    ext = ExtendReq(
        req.rid,
        new,
        prefix,
        adm.out_cache_loc,
        req.sampling,
        last_chunk=last,
        state_slot=req.state_slot,
        prefix_state=adm.prefix_state,
        snapshots=adm.snapshots,
        lora=req.lora,
        images=_images(req, len(prefix), req.num_computed),
    )
    # the worker needs the whole history for penalties, and the outputs for a grammar's state
    # (and the tokens before this chunk for its prompt's logprobs)
    if last and (
        req.sampling.penalized or req.sampling.grammar_kind or req.sampling.prompt_logprobs
    ):
        ext.context_ids, ext.output_ids = fill[: len(prefix)], list(req.output_ids)
    return ext


def _images(req: Req, start: int, end: int) -> list[ImagePart]:
    """The prompt's images for a chunk computing tokens [start, end): pixels only for those
    whose run of pad values has tokens there (the others' KV is cached or comes later)."""
    out = []
    for im in req.images:
        needed = im.start < end and im.start + im.length > start
        out.append(im if needed else ImagePart(im.start, im.grid, im.length, im.key))
    return out


def _twin(req: Req, matched: int, picked: list[Req]) -> tuple[int, int] | None:
    """(index in `picked`, shared length) of a picked request about to compute a long
    prefix `req` could then reuse, or None."""
    fill = req.fill_ids
    for i, other in enumerate(picked):
        shared = _common_prefix_len(fill, other.fill_ids)
        if shared - matched >= IN_BATCH_PREFIX_MIN:
            return i, min(shared, len(fill) - 1)  # where `req` can resume
    return None


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on prefix equality: C-speed slices instead of a loop
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
