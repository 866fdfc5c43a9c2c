"""--max-memory: the admission's arithmetic (scheduler/memory_budget.py) and the decisions
the scheduler takes with it, driven in-process step by step (the test plays the worker);
the size parser; the worker's out-of-memory recognition."""

from __future__ import annotations

import time

import pytest

from common.messages import (
    DecodeBatch,
    ExtendBatch,
    GenerateReq,
    MemoryReport,
    ReqError,
    SamplingParams,
    StepResult,
    TokenOut,
    WorkerError,
    WorkerReady,
)
from common.server_args import ServerArgs
from common.sizes import format_size, parse_size
from scheduler.memory_budget import BUFFER_COPIES, GROW_STEP, MIN_CHUNK, MemoryBudget
from scheduler.scheduler import Scheduler

MiB = 1 << 20
# the small preset's figures, roughly: 4 layers x 2 KV heads x 64 x 2 x float32
FIGURES = dict(
    kv_token_bytes=4096, score_bytes=17, act_token_bytes=18 << 10, row_bytes=8 << 10,
    prefill_step=256,
)  # fmt: skip


def budget(headroom: int, fixed: int = 100 * MiB) -> MemoryBudget:
    return MemoryBudget(MemoryReport(budget=fixed + headroom, fixed=fixed, **FIGURES))


# ------------------------------------------------------------------ sizes


@pytest.mark.parametrize(
    "text, n",
    [("4096", 4096), ("12GiB", 12 << 30), ("800MB", 800 * 10**6), ("1.5g", 3 << 29),
     ("64 KiB", 64 << 10), ("2T", 2 << 40), ("10b", 10)],
)  # fmt: skip
def test_sizes_as_people_write_them(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["", "GiB", "12 parsecs", "-1GiB", "1e9"])
def test_a_size_that_is_none_says_what_is_accepted(text):
    with pytest.raises(ValueError, match="12GiB"):
        parse_size(text)


def test_format_size():
    assert [format_size(n) for n in (10, 12 << 10, 300 * MiB, 3 << 29)] == [
        "10 B", "12 KiB", "300.0 MiB", "1.5 GiB",
    ]  # fmt: skip


def test_max_memory_flag_is_validated_with_its_name():
    ServerArgs(model_path="m", max_memory="12GiB").validate()
    for bad in ("lots", "100"):
        with pytest.raises(ValueError, match="--max-memory"):
            ServerArgs(model_path="m", max_memory=bad).validate()
    assert ServerArgs(model_path="m", max_memory="1MiB").max_memory_bytes == MiB
    assert ServerArgs(model_path="m").max_memory_bytes is None


# ------------------------------------------------------------------ arithmetic


def test_the_bytes_of_a_step_grow_with_what_it_holds():
    m = budget(1 << 30)
    assert m.extend_bytes([]) == 0 and m.decode_bytes([]) == 0 and m.buffer_bytes(0, 9) == 0
    one = m.extend_bytes([(0, 256)])
    assert m.extend_bytes([(4096, 256)]) > one  # a longer context: more scores, more K/V
    assert m.extend_bytes([(0, 256), (0, 256)]) == 2 * one  # rows add up
    # a chunk longer than the worker's pass costs one pass at the longest context
    assert m.extend_bytes([(0, 1024)]) == m.extend_bytes([(768, 256)])
    assert m.decode_bytes([100] * 8) > m.decode_bytes([100])
    assert m.decode_bytes([5000]) > m.decode_bytes([100])
    # the buffer: columns rounded up, three copies at most while it doubles
    assert m.buffer_bytes(2, 300) == 2 * BUFFER_COPIES * 2 * GROW_STEP * FIGURES["kv_token_bytes"]


def test_the_scores_term_is_new_tokens_by_context_by_heads():
    """The CPU's attention materialises (B, H, L, C) float32 scores: the dominant term of a
    long context's prefill pass."""
    m = budget(1 << 30)
    L, C = 256, 16384
    longer = m.extend_bytes([(C + 1000 - L, L)]) - m.extend_bytes([(C - L, L)])
    # each context token adds a column of scores for every new token, and its gathered K/V
    assert longer == 1000 * (L * FIGURES["score_bytes"] + FIGURES["kv_token_bytes"])


def test_largest_chunk_is_the_most_that_fits():
    m = budget(64 * MiB)
    take = m.largest_chunk([], [], 0, 10_000)
    assert MIN_CHUNK <= take < 10_000
    assert m.step_bytes([], [(0, take)]) <= m.headroom
    if take + 1 <= 10_000:
        assert m.step_bytes([], [(0, take + 1)]) > m.headroom or take == 10_000
    # beside running requests less fits, and a full budget gives nothing
    assert m.largest_chunk([4000] * 4, [], 0, 10_000) < take
    assert m.largest_chunk([30_000] * 8, [], 0, 10_000) == 0
    assert budget(100 * MiB).largest_chunk([], [], 0, 40) == 40  # all of a short prompt


def test_never_fits_names_the_numbers():
    m = budget(64 * MiB)
    assert m.never_fits(1000, 16) is None
    why = m.never_fits(200_000, 16)
    assert why is not None and "200000 tokens" in why and "--max-memory" in why
    longest = m.longest_fitting(16)
    assert m.never_fits(longest, 16) is None and m.never_fits(longest + 1, 16) is not None
    assert budget(-MiB).never_fits(1, 1) is not None  # nothing left beside the weights


# ------------------------------------------------------------------ the scheduler


def make_scheduler(headroom: int, prefill_step: int = 256, **kw) -> Scheduler:
    args = ServerArgs(model_path="in-process", debug_invariants=True, **kw)
    figures = dict(FIGURES, prefill_step=prefill_step)
    report = MemoryReport(budget=100 * MiB + headroom, fixed=100 * MiB, **figures)
    ready = WorkerReady(
        50_000, "test", 4, 2, 64, "float32", 300_000, 1000, [0], "none", memory=report
    )
    return Scheduler(args, ready)


def submit(s: Scheduler, rid: str, n: int, max_new: int = 4) -> None:
    sampling = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    shift = sum(map(ord, rid)) * 7  # prompts of different requests differ from the start
    s.on_request(GenerateReq(rid, [2 + (i + shift) % 900 for i in range(n)], sampling))


def answer(s: Scheduler, batch) -> None:
    if isinstance(batch, ExtendBatch):
        rids = [r.rid for r in batch.reqs if r.last_chunk]
    else:
        rids = list(batch.rids)
    s.on_result(StepResult(batch.step, rids, [7] * len(rids)))


def errors(s: Scheduler) -> dict[str, ReqError]:
    return {o.rid: o for o in s.take_outputs() if isinstance(o, ReqError)}


def test_a_request_that_can_never_fit_gets_a_400_saying_why():
    s = make_scheduler(64 * MiB)
    n = s.memory.longest_fitting(4) + 1000  # within the pool's 50,000 slots
    submit(s, "huge", n)
    err = errors(s)["huge"]
    assert (err.status, err.code) == (400, "insufficient_memory")
    assert "--max-memory" in err.message and f"{n} tokens" in err.message
    assert s.next_batch() is None  # nothing was queued


def test_a_long_prompt_is_chunked_to_what_memory_allows():
    """The chunk of each step is the most that fits; every step stays under the budget.
    (A worker whose passes are as long as the chunks, as on a GPU: with the CPU's
    256-token passes a chunk's size changes little.)"""
    s = make_scheduler(256 * MiB, prefill_step=8192, chunked_prefill_size=8192)
    n = s.memory.longest_fitting(4)
    submit(s, "long", n)
    chunks = []
    while True:
        batch = s.next_batch()
        assert isinstance(batch, ExtendBatch)
        (req,) = batch.reqs
        before = len(req.prefix_slot_ids)
        chunks.append(len(req.input_ids))
        assert s.memory.step_bytes([], [(before, len(req.input_ids))]) <= s.memory.headroom
        answer(s, batch)
        if req.last_chunk:
            break
    assert sum(chunks) == n
    assert len(chunks) > n // 8192 + 1  # memory, not --chunked-prefill-size, cut them
    assert chunks[0] > chunks[-2]  # later chunks see a longer context: smaller


def test_a_request_that_fits_only_alone_waits_then_gets_503_with_retry_after():
    s = make_scheduler(200 * MiB, memory_wait_timeout=0.3)
    n = s.memory.longest_fitting(2000)
    submit(s, "a", n, max_new=2000)
    submit(s, "b", n, max_new=2000)
    assert s.memory.never_fits(n, 2000) is None  # each fits alone
    deadline, got = time.monotonic() + 10, {}
    while "b" not in got and time.monotonic() < deadline:
        batch = s.next_batch()
        if isinstance(batch, ExtendBatch):
            assert "b" not in [r.rid for r in batch.reqs]  # never beside a
        if isinstance(batch, (ExtendBatch, DecodeBatch)):
            answer(s, batch)
        got.update(errors(s))
        time.sleep(0.01)
    assert "a" in s.reqs  # a still runs: b timed out waiting beside it
    err = got["b"]
    assert (err.status, err.code) == (503, "insufficient_memory")
    assert err.retry_after > 0 and "--max-memory" in err.message


def test_a_decode_batch_over_the_budget_retracts_the_least_advanced():
    """Requests admitted one by one may together outgrow the budget as they decode: the
    decode step retracts one (it resumes later from the trie), as for KV slots."""
    s = make_scheduler(40 * MiB, memory_wait_timeout=60)
    n = s.memory.longest_fitting(400) // 3
    for rid in "abcd":
        submit(s, rid, n, max_new=400)
    retracted_before = s.retracted
    for _ in range(200):
        batch = s.next_batch()
        if batch is None:
            break
        if isinstance(batch, DecodeBatch):
            lens = [s.reqs[rid].seq_len for rid in batch.rids]
            assert s.memory.decode_bytes(lens) <= s.memory.headroom or len(lens) == 1
        answer(s, batch)
        s.take_outputs()
    assert s.retracted > retracted_before  # the running set outgrew the budget and shrank


def test_an_out_of_memory_step_fails_its_requests_with_503_and_frees_their_slots():
    s = make_scheduler(200 * MiB)
    free = s.kv.budget()
    submit(s, "a", 100)
    submit(s, "b", 100)
    batch = s.next_batch()
    s.on_result(WorkerError(batch.step, "out of memory computing this step", out_of_memory=True))
    out = s.take_outputs()
    errs = {o.rid: o for o in out if isinstance(o, ReqError)}
    assert set(errs) == {"a", "b"}
    assert all(e.status == 503 and e.retry_after > 0 for e in errs.values())
    assert "out of memory" in errs["a"].message
    assert not s.running and not s.waiting
    # the slots come back once the worker's release goes out
    assert s.next_batch() is not None
    assert s.kv.budget() == free
    submit(s, "c", 50)
    answer(s, s.next_batch())
    assert any(isinstance(o, TokenOut) and o.rid == "c" for o in s.take_outputs())


def test_a_worker_without_figures_is_admitted_by_kv_slots_only():
    args = ServerArgs(model_path="in-process")
    ready = WorkerReady(4096, "test", 2, 2, 8, "float32", 4096, 1000, [0], "none")
    assert Scheduler(args, ready).memory is None


# ------------------------------------------------------------------ the worker's side


def test_out_of_memory_is_recognised_from_mlx_messages():
    from worker_mlx.memory import StepOutOfMemory, is_out_of_memory

    assert is_out_of_memory(RuntimeError("[malloc] Unable to allocate 1073741824 bytes."))
    assert is_out_of_memory(RuntimeError("[metal::malloc] Resource limit (499000) exceeded."))
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(StepOutOfMemory("out of memory computing this step"))
    assert not is_out_of_memory(ValueError("slot 9 out of range"))
    assert not is_out_of_memory(RuntimeError("[matmul] shapes do not match"))


def test_prompt_logprobs_count_the_whole_prompt_in_one_pass():
    """The prompt's logprobs recompute the whole prompt without a cache, in one pass: its
    scores grow with the square of the prompt, so a prompt that runs fine in chunks may
    not be asked for them."""
    m = budget(256 * MiB)
    n = 5000
    assert m.never_fits(n, 4) is None
    why = m.never_fits(n, 4, whole_prompt=True)
    assert why is not None and "prompt logprobs" in why
    assert m.whole_prompt_bytes([], 2 * n) > 3 * m.whole_prompt_bytes([], n)  # quadratic
    s = make_scheduler(256 * MiB)
    sampling = SamplingParams(max_new_tokens=4, temperature=0.0, prompt_logprobs=True)
    s.on_request(GenerateReq("echo", [5] * n, sampling))
    err = errors(s)["echo"]
    assert (err.status, err.code) == (400, "insufficient_memory") and "logprobs" in err.message
    submit(s, "plain", n)  # the same prompt without them runs
    assert isinstance(s.next_batch(), ExtendBatch)
