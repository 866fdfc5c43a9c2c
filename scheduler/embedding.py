"""Embedding requests in the scheduler: a queue of rows, cut into EmbedBatch steps.

An EmbedReq's inputs become rows; a batch takes waiting rows in arrival order up to
--chunked-prefill-size tokens (at least one row, which the context bounds), the same
budget a prefill step has, and, under --max-memory, as many as fit beside the running
requests' decode buffer, each row counted as a prefill of its worst pass (a row longer
than a pass runs in passes over a cache of its own: its last pass, which attends to the
whole row). A request with a row that could never fit is refused at entry.

Rows hold no slot and never reach the trie, so an embedding cannot evict anyone's cached
prefix; the worker runs them without its KV pool (worker_mlx/embed_pass.py). A request
is answered (EmbedOut) once all its rows are back.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from common.messages import (
    EmbedBatch,
    EmbedOut,
    EmbedReq,
    EmbedResult,
    EmbedRow,
    ReqError,
    WorkerError,
)
from scheduler.memory_budget import RETRY_AFTER, MemoryBudget

logger = logging.getLogger("scheduler")
MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


@dataclass
class _Job:
    inputs: int
    tokens: int
    embeddings: dict[int, bytes] = field(default_factory=dict)


class EmbedQueue:
    def __init__(self, context_len: int, batch_tokens: int, memory: MemoryBudget | None = None):
        self.context_len, self.batch_tokens, self.memory = context_len, batch_tokens, memory
        self.waiting: deque[EmbedRow] = deque()
        self.jobs: dict[str, _Job] = {}
        self.requests = 0  # answered requests and their tokens, for the log
        self.tokens = 0

    def add(self, req: EmbedReq, rid_in_use: bool) -> ReqError | None:
        """Queue `req`'s rows, or the error it gets (the router checks these first)."""
        why = _reject_reason(req, self.context_len, rid_in_use or req.rid in self.jobs)
        if why is None and self.memory is not None:
            why = self._never_fits(req)
        if why is not None:
            return ReqError(req.rid, why[1], code=why[0])
        tokens = sum(len(ids) for ids in req.inputs)
        self.jobs[req.rid] = _Job(len(req.inputs), tokens)
        self.waiting.extend(EmbedRow(req.rid, i, ids) for i, ids in enumerate(req.inputs))
        return None

    def abort(self, rid: str) -> bool:
        """Forget `rid` (its rows in flight come back to nobody); whether it was here."""
        if self.jobs.pop(rid, None) is None:
            return False
        self.waiting = deque(r for r in self.waiting if r.rid != rid)
        return True

    def next_batch(self, step: int, running: list[int] = ()) -> EmbedBatch | None:
        """The next rows, beside running requests of `running` lengths (None: none fits
        beside them now; they wait for generation to make room)."""
        rows, tokens = [], 0
        while self.waiting and (
            not rows or tokens + len(self.waiting[0].input_ids) <= self.batch_tokens
        ):
            if not self._fits(running, rows + [self.waiting[0]]):
                break
            row = self.waiting.popleft()
            rows.append(row)
            tokens += len(row.input_ids)
        if not rows:
            return None
        logger.info(
            "Embed batch, #row: %d, #token: %d, #queue-row: %d, #running-req: %d",
            len(rows), tokens, len(self.waiting), len(running),
        )  # fmt: skip
        return EmbedBatch(step, rows)

    def _passes(self, rows: list[EmbedRow]) -> list[tuple[int, int]]:
        """Each row's worst pass as a prefill's (tokens before, new tokens)."""
        step = self.memory.report.prefill_step
        return [(max(0, len(r.input_ids) - step), min(step, len(r.input_ids))) for r in rows]

    def _fits(self, running: list[int], rows: list[EmbedRow]) -> bool:
        if self.memory is None:
            return True
        return self.memory.step_bytes(list(running), self._passes(rows)) <= self.memory.headroom

    def _never_fits(self, req: EmbedReq) -> tuple[str, str] | None:
        for i, ids in enumerate(req.inputs):
            if not self._fits([], [EmbedRow(req.rid, i, ids)]):
                return "insufficient_memory", (
                    f"input[{i}] ({len(ids)} tokens) needs more memory than --max-memory "
                    "leaves beside what the worker holds"
                )
        return None

    def answer(
        self, batch: EmbedBatch, result: EmbedResult | WorkerError
    ) -> list[EmbedOut | ReqError]:
        """What the batch's result answers: the requests it completed, or (a failed step)
        an error for each of its requests, 503 when it ran out of memory."""
        if isinstance(result, EmbedResult):
            return self._completed(batch, result)
        logger.error("worker failed an embed step of %d rows: %s", len(batch.rows), result.message)
        if result.out_of_memory:
            return self.fail(batch, result.message, "out_of_memory", 503, RETRY_AFTER)
        return self.fail(batch, result.message)

    def _completed(self, batch: EmbedBatch, result: EmbedResult) -> list[EmbedOut | ReqError]:
        if len(result.embeddings) != len(batch.rows):
            return self.fail(batch, "the worker answered another number of embeddings")
        done = []
        for row, vector in zip(batch.rows, result.embeddings):
            job = self.jobs.get(row.rid)
            if job is None:
                continue  # aborted meanwhile
            job.embeddings[row.index] = vector
            if len(job.embeddings) == job.inputs:
                del self.jobs[row.rid]
                self.requests, self.tokens = self.requests + 1, self.tokens + job.tokens
                vectors = [job.embeddings[i] for i in range(job.inputs)]
                done.append(EmbedOut(row.rid, vectors, job.tokens))
        return done

    def fail(
        self, batch: EmbedBatch, message: str, code: str = "internal_error", status: int = 500,
        retry_after: float = 0.0,
    ) -> list[ReqError]:  # fmt: skip
        """The batch's requests fail (their other rows are dropped from the queue)."""
        errors = []
        for rid in dict.fromkeys(row.rid for row in batch.rows):
            if self.abort(rid):
                errors.append(ReqError(rid, message, code, status, retry_after))
        return errors


def _reject_reason(req: EmbedReq, context_len: int, rid_in_use: bool) -> tuple[str, str] | None:
    if rid_in_use:
        return "duplicate_request_id", f"request id {req.rid!r} is already in use"
    if not 1 <= len(req.inputs) <= MAX_INPUTS:
        return "invalid_request_error", f"input: 1 to {MAX_INPUTS} inputs, not {len(req.inputs)}"
    for i, ids in enumerate(req.inputs):
        if not ids:
            return "invalid_request_error", f"input[{i}] has no tokens"
        if len(ids) > context_len:
            return "context_length_exceeded", (
                f"input[{i}] has {len(ids)} tokens, more than the context length of "
                f"{context_len} tokens"
            )
    return None
