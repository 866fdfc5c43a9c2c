"""RouterManager: tokenized requests down to the scheduler, token outputs back to callers.

Runs on the router's asyncio loop. Each request gets a queue; one receive task routes
the scheduler's TokenOutBatch / ReqError messages into those queues. The HTTP server and
the SDK front door both go through `generate`.

The manager also holds the serving state the supervisor and the signal handlers set:
starting, serving, restarting (new requests wait up to RESTART_WAIT for the fresh
children, then get a 503 with Retry-After), draining and stopped (new requests get 503).
"""

from __future__ import annotations

import asyncio
import logging
import math
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
    WorkerHung,
)
from common.protocol import ProtocolError, decode, encode, peek_rids
from common.trace import Trace

logger = logging.getLogger("router")
RESTART_WAIT = 30.0  # seconds a request that arrives during a restart waits for it
RETRY_AFTER = 5  # seconds, the Retry-After of a 503 while restarting


class RequestError(Exception):
    """A request the system refused; carries the OpenAI error fields (and HTTP headers)."""

    def __init__(
        self,
        message: str,
        code: str = "invalid_request_error",
        status: int = 400,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message, self.code, self.status = message, code, status
        self.headers = headers


def unavailable(message: str, retry_after: float | None = None) -> RequestError:
    headers = {"Retry-After": str(math.ceil(retry_after))} if retry_after else None
    return RequestError(message, "service_unavailable", 503, headers)


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
        self.hung: WorkerHung | None = None  # the scheduler's watchdog fired
        self.last_heard = time.monotonic()  # the scheduler's last frame (at least 1/s)
        self.state, self.reason = "starting", ""
        self._settled = asyncio.Event()  # set while not restarting
        self._settled.set()

    @property
    def healthy(self) -> bool:
        return self.state == "serving"

    @property
    def unhealthy_reason(self) -> str:
        return self.reason or self.state

    async def receive_loop(self) -> None:
        while True:
            frame = await self.from_scheduler.recv()
            self.last_heard = time.monotonic()
            try:
                msg = decode(frame, ROUTER_INBOX)
            except ProtocolError as exc:
                logger.error("bad frame from scheduler: %s", exc)
                for rid in peek_rids(frame):  # their answer is lost: do not let them wait
                    self._deliver(rid, RequestError(f"bad frame from the scheduler: {exc}",
                                                    "internal_error", 500))  # fmt: skip
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
            if self.metrics:
                self.metrics.observe_ready(msg)  # before /health can say 200
            self.ready_event.set()
        elif isinstance(msg, WorkerHung):
            self.hung = msg

    def _deliver(self, rid: str, item: TokenOut | RequestError) -> None:
        pending = self.pending.get(rid)
        if pending is not None:
            pending.queue.put_nowait(item)
        elif isinstance(item, TokenOut) and item.finish_reason is None:
            self._send_nowait(AbortReq(rid))  # nobody waits for it (failed in a restart)

    # ------------------------------------------------------------ serving state

    def serving(self) -> None:
        self.state, self.reason, self.hung = "serving", "", None
        self.last_heard = time.monotonic()
        self._settled.set()

    def restarting(self, reason: str) -> None:
        """A child died or hung: fail what was in flight; new requests wait."""
        self.state, self.reason, self.hung = "restarting", f"restarting: {reason}", None
        self.ready_event.clear()
        self._settled.clear()
        self.fail_all(reason)

    def draining(self) -> None:
        self.state, self.reason = "draining", "draining: the server is shutting down"
        self._settled.set()

    def stopped(self, reason: str) -> None:
        self.state, self.reason = "stopped", reason
        self._settled.set()

    def fail_all(self, reason: str) -> None:
        """Every waiting caller gets a 503 instead of hanging."""
        for pending in self.pending.values():
            pending.queue.put_nowait(unavailable(reason))

    async def _wait_serving(self) -> None:
        if self.state == "restarting":
            try:
                await asyncio.wait_for(self._settled.wait(), RESTART_WAIT)
            except asyncio.TimeoutError:
                raise unavailable(f"server is {self.reason}; retry later", RETRY_AFTER) from None
        self.check_ready()

    @property
    def context_len(self) -> int:
        return self.ready.context_len if self.ready else 0

    def check_ready(self) -> None:
        """Raise the 503 a new request gets now; during a restart `generate` waits."""
        if self.state in ("draining", "stopped"):
            raise unavailable(f"server is {self.reason}")
        if self.ready is None:
            raise unavailable("server is starting")

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: str | None = None
    ) -> AsyncIterator[TokenOut]:
        """Yield TokenOut increments until the finishing one; abort if the caller stops."""
        await self._wait_serving()
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
                self._send_nowait(AbortReq(rid))

    def _send_nowait(self, msg) -> None:
        """A message that must not wait: with no scheduler connected (a restart), it is
        dropped, and the fresh scheduler knows nothing of the request anyway."""
        sent = self.to_scheduler.send(encode(msg), zmq.NOBLOCK)  # a Future, done at once
        if sent.done() and sent.exception() is not None:  # retrieved: zmq.Again, dropped
            logger.debug("dropped %s: the scheduler's queue is full", type(msg).__name__)

    def close(self) -> None:
        self.ctx.destroy(linger=0)
