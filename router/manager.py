"""RouterManager: tokenized requests down to the scheduler, token outputs back to callers.

Runs on the router's asyncio loop. Each request gets a queue; one receive task routes
the scheduler's TokenOutBatch / ReqError messages into those queues. The HTTP server and
the SDK front door both go through `generate`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from common.ipc import bind_pull, connect_push
from common.messages import (
    ROUTER_INBOX,
    AbortReq,
    GenerateReq,
    ReqError,
    SamplingParams,
    SchedulerReady,
    SchedulerStats,
    TokenOut,
    TokenOutBatch,
)
from common.protocol import ProtocolError, decode, encode
from common.trace import Trace

logger = logging.getLogger("router")


class RequestError(Exception):
    """A request the system refused; carries the OpenAI error fields."""

    def __init__(self, message: str, code: str = "invalid_request_error", status: int = 400):
        super().__init__(message)
        self.message, self.code, self.status = message, code, status


@dataclass
class _Pending:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.monotonic)


class RouterManager:
    def __init__(
        self,
        scheduler_in: str,
        router_in: str,
        tokenizer,
        metrics=None,
        max_pending: int = 4096,
        trace: Trace | None = None,
    ):
        self.ctx = zmq.asyncio.Context()
        self.to_scheduler = connect_push(self.ctx, scheduler_in)
        self.from_scheduler = bind_pull(self.ctx, router_in)
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.trace = trace or Trace(None, "router")
        self.pending: dict[str, _Pending] = {}
        self.max_pending = max_pending
        self.ready: SchedulerReady | None = None
        self.ready_event = asyncio.Event()
        self.stats: SchedulerStats | None = None
        self.healthy = True
        self.unhealthy_reason = ""

    async def receive_loop(self) -> None:
        while True:
            frame = await self.from_scheduler.recv()
            try:
                msg = decode(frame, ROUTER_INBOX)
            except ProtocolError as exc:
                logger.error("bad frame from scheduler: %s", exc)
                continue
            self._dispatch(msg)

    def _dispatch(self, msg) -> None:
        if isinstance(msg, TokenOutBatch):
            self.trace("tokens", *(out.rid for out in msg.outputs))
            for out in msg.outputs:
                self._deliver(out.rid, out)
        elif isinstance(msg, ReqError):
            self._deliver(msg.rid, RequestError(msg.message, msg.code, msg.status))
        elif isinstance(msg, SchedulerStats):
            self.stats = msg
            if self.metrics:
                self.metrics.observe_stats(msg)
        elif isinstance(msg, SchedulerReady):
            self.ready = msg
            self.ready_event.set()

    def _deliver(self, rid: str, item: TokenOut | RequestError) -> None:
        pending = self.pending.get(rid)
        if pending is not None:
            pending.queue.put_nowait(item)

    @property
    def context_len(self) -> int:
        return self.ready.context_len if self.ready else 0

    def check_ready(self) -> None:
        if not self.healthy:
            raise RequestError(
                f"server is shutting down: {self.unhealthy_reason}", "service_unavailable", 503
            )
        if self.ready is None:
            raise RequestError("server is starting", "service_unavailable", 503)

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: str | None = None
    ) -> AsyncIterator[TokenOut]:
        """Yield TokenOut increments until the finishing one; abort if the caller stops."""
        self.check_ready()
        if len(self.pending) >= self.max_pending:
            raise RequestError(
                f"server overloaded: {len(self.pending)} requests in flight "
                f"(--max-queued-requests {self.max_pending}); retry later",
                "overloaded", 503,
            )  # fmt: skip
        rid = rid or uuid.uuid4().hex
        if rid in self.pending:
            raise RequestError(f"request id {rid!r} is already in use", "duplicate_request_id")
        self.pending[rid] = pending = _Pending()
        finished = False
        try:
            self.trace("submit", rid)
            await self.to_scheduler.send(encode(GenerateReq(rid, input_ids, sampling)))
            while True:
                item = await pending.queue.get()
                if isinstance(item, RequestError):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                if self.metrics:
                    self.metrics.observe_output(item, pending.created)
                yield item
                if finished:
                    return
        finally:
            self.pending.pop(rid, None)
            if self.metrics:
                self.metrics.forget(rid)
            if not finished:
                await self.abort(rid)

    async def abort(self, rid: str) -> None:
        await self.to_scheduler.send(encode(AbortReq(rid)))

    def fail_all(self, reason: str) -> None:
        """A child died: every waiting caller gets a 503 instead of hanging."""
        self.healthy = False
        self.unhealthy_reason = reason
        for pending in self.pending.values():
            pending.queue.put_nowait(RequestError(reason, "service_unavailable", 503))

    def close(self) -> None:
        self.ctx.destroy(linger=0)
