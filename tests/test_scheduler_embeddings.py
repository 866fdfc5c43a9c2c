"""Embedding requests in the scheduler (scheduler/embedding.py), driven step by step:
their rows take turns with generation steps, hold no KV slot, are answered whole and in
input order, and are refused, aborted and failed cleanly."""

from __future__ import annotations

import struct

from common.messages import (
    DecodeBatch,
    EmbedBatch,
    EmbedOut,
    EmbedReq,
    EmbedResult,
    ExtendBatch,
    ReqError,
    StepResult,
    WorkerError,
)
from tests.test_scheduler_policy import make_scheduler, submit


def vector(row) -> bytes:
    """A fake embedding that says which input it is."""
    return struct.pack("<2f", float(row.index), float(len(row.input_ids)))


def answer(s, batch) -> None:
    if isinstance(batch, EmbedBatch):
        s.on_result(EmbedResult(batch.step, [vector(r) for r in batch.rows]))
    elif isinstance(batch, ExtendBatch):
        rids = [r.rid for r in batch.reqs if r.last_chunk]
        s.on_result(StepResult(batch.step, rids, [7] * len(rids)))
    elif isinstance(batch, DecodeBatch):
        s.on_result(StepResult(batch.step, batch.rids, [7] * len(batch.rids)))


def embeds(s) -> list:
    return [o for o in s.take_outputs() if isinstance(o, (EmbedOut, ReqError))]


def test_rows_take_turns_with_generation_and_hold_no_slot():
    s = make_scheduler(chunked_prefill_size=16)
    submit(s, "gen", 20, max_new=6)
    inputs = [[3] * 10, [4] * 10, [5] * 3, [6] * 12]
    s.on_request(EmbedReq("emb", inputs))
    kinds, outs = [], []

    def slots():
        return s.kv.allocator.available_size(), s.kv.tree.evictable_size()

    while s.busy:
        batch = s.next_batch()
        if batch is None:
            break
        kinds.append(type(batch).__name__)
        if isinstance(batch, EmbedBatch):
            assert sum(len(r.input_ids) for r in batch.rows) <= 16 or len(batch.rows) == 1
            before = slots()
        answer(s, batch)
        if isinstance(batch, EmbedBatch):
            assert slots() == before  # an embed step takes no slot and evicts nothing
        outs += embeds(s)
    assert kinds[:4] == ["EmbedBatch", "ExtendBatch", "EmbedBatch", "ExtendBatch"], kinds
    assert kinds.count("EmbedBatch") == 3  # 10 | 10 + 3 | 12 within 16 tokens a step
    (out,) = outs
    assert out.rid == "emb" and out.prompt_tokens == 35
    got = [struct.unpack("<2f", v) for v in out.embeddings]
    assert got == [(i, len(ids)) for i, ids in enumerate(inputs)]


def test_refusals_name_the_input():
    s = make_scheduler(context_length=64)
    s.on_request(EmbedReq("a", []))
    s.on_request(EmbedReq("b", [[1], []]))
    s.on_request(EmbedReq("c", [[1] * 65]))
    submit(s, "d", 4)
    s.on_request(EmbedReq("d", [[1]]))
    errors = {e.rid: (e.code, e.message) for e in s.take_outputs()}
    assert errors["a"][0] == "invalid_request_error" and "1 to 2048 inputs" in errors["a"][1]
    assert "input[1] has no tokens" in errors["b"][1]
    assert errors["c"][0] == "context_length_exceeded" and "input[0] has 65" in errors["c"][1]
    assert errors["d"][0] == "duplicate_request_id"
    assert not s.embeds.waiting


def test_an_aborted_request_is_dropped_and_its_rows_in_flight_ignored():
    s = make_scheduler(chunked_prefill_size=8)
    s.on_request(EmbedReq("x", [[3] * 8, [4] * 8]))
    batch = s.next_batch()
    s.abort("x")
    assert not s.embeds.waiting  # its second row never runs
    answer(s, batch)
    assert embeds(s) == [] and s.next_batch() is None


def test_a_failed_step_fails_its_requests_500_or_503_out_of_memory():
    s = make_scheduler(chunked_prefill_size=8)
    s.on_request(EmbedReq("x", [[3] * 4, [4] * 4, [5] * 8]))
    s.on_request(EmbedReq("y", [[6] * 2]))
    batch = s.next_batch()
    s.on_result(WorkerError(batch.step, "boom"))
    (error,) = embeds(s)
    assert (error.rid, error.status) == ("x", 500)
    batch = s.next_batch()
    assert [r.rid for r in batch.rows] == ["y"]  # x's third row went with it
    s.on_result(WorkerError(batch.step, "out of memory", out_of_memory=True))
    (error,) = embeds(s)
    assert (error.rid, error.status, error.code) == ("y", 503, "out_of_memory")
    assert error.retry_after > 0


def test_under_max_memory_rows_fit_beside_the_running_or_are_refused():
    from common.messages import MemoryReport, WorkerReady
    from common.server_args import ServerArgs
    from scheduler.scheduler import Scheduler

    # a 64-token row's pass: 64 x (64 x 100 + 2 x 1000) = 537,600 bytes; two do not fit
    report = MemoryReport(budget=1_000_000, fixed=0, kv_token_bytes=1000, score_bytes=100,
                          act_token_bytes=1000, row_bytes=0, prefill_step=64)  # fmt: skip
    ready = WorkerReady(4096, "test", 2, 2, 8, "float32", 4096, 1000, [0], "none", memory=report)
    s = Scheduler(ServerArgs(model_path="in-process"), ready)
    s.on_request(EmbedReq("big", [[3] * 200]))  # its last pass attends to 200 tokens
    (error,) = embeds(s)
    assert error.code == "insufficient_memory" and "input[0] (200 tokens)" in error.message
    s.on_request(EmbedReq("two", [[3] * 64, [4] * 64]))
    first = s.next_batch()
    assert len(first.rows) == 1
    answer(s, first)
    second = s.next_batch()
    assert len(second.rows) == 1
    answer(s, second)
    (out,) = embeds(s)
    assert out.rid == "two" and len(out.embeddings) == 2


def test_a_generation_aborted_during_an_embed_step_is_released_after_it():
    s = make_scheduler()
    submit(s, "gen", 8, max_new=20)
    answer(s, s.next_batch())  # its prefill: it runs
    s.on_request(EmbedReq("e", [[3] * 4]))
    batch = s.next_batch()
    assert isinstance(batch, EmbedBatch)
    s.abort("gen")  # while the embed step is in flight
    answer(s, batch)
    assert not s.running and s.pending_release and s.pending_release[0].rid == "gen"
    finished = [o for o in s.take_outputs() if getattr(o, "finish_reason", None) == "abort"]
    assert [o.rid for o in finished] == ["gen"]


def test_a_model_without_an_lm_head_refuses_generation():
    from common.messages import GenerateReq, SamplingParams, WorkerReady
    from common.server_args import ServerArgs
    from scheduler.scheduler import Scheduler

    ready = WorkerReady(4096, "test", 2, 2, 8, "float32", 4096, 1000, [0], "none", generates=False)
    s = Scheduler(ServerArgs(model_path="in-process"), ready)
    s.on_request(GenerateReq("g", [3, 4], SamplingParams(max_new_tokens=2)))
    (error,) = s.take_outputs()
    assert error.status == 400 and "serves /v1/embeddings only" in error.message
    s.on_request(EmbedReq("e", [[3, 4]]))
    assert isinstance(s.next_batch(), EmbedBatch)
