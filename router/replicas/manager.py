"""RouterManager: tokenized requests down to a replica's scheduler, token outputs back to
callers.

Runs on the router's asyncio loop. Each request gets a queue; one receive task per replica
(`router.replicas.replica_set`) routes that scheduler's TokenOutBatch / ReqError messages into those
queues. The HTTP server and the SDK front door both go through `generate`, which sends
each request to the replica the routing policy (`router.replicas.routing`) picks among those that
serve.

The manager also holds the serving state the supervisor and the signal handlers set:
starting, serving, draining and stopped (new requests get 503). While serving with no
replica ready (all are restarting), new requests wait up to `restart_wait`
(--restart-wait-timeout) for one, then get a 503 with Retry-After. When a replica goes
down, its requests that have not produced a token yet are sent once to another replica
that serves; the others fail with a 503 that names the replica and the cause.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import zmq.asyncio

from common.cache_salt import salted_key
from common.messages import (
    AbortReq,
    CacheEvicted,
    DiskReport,
    EmbedOut,
    EmbedReq,
    GenerateReq,
    LoraUpdate,
    LoraUpdated,
    ReqError,
    SamplingParams,
    SchedulerReady,
    SchedulerStats,
    TokenOut,
    TokenOutBatch,
    WorkerHung,
)
from common.protocol import encode
from common.trace import Trace
from router.replicas.replica_set import Replica, ReplicaSet, read_scheduler
from router.replicas.routing import RoundRobin, by_key
from router.request_error import RequestError, unavailable

logger = logging.getLogger("router")
RETRY_AFTER = 5  # seconds, the Retry-After of a 503 while restarting


@dataclass
class _Lost:
    """The replica a request ran on went down; it may be retried once if nothing came yet."""

    replica: Replica
    error: RequestError


@dataclass
class _Pending:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.monotonic)
    replica: Replica | None = None
    produced: bool = False  # an output reached the caller
    retried: bool = False


class RouterManager:
    def __init__(
        self,
        replicas: ReplicaSet,
        tokenizer,
        metrics=None,
        max_pending: int = 4096,
        trace: Trace | None = None,
        policy=None,
        ctx: zmq.asyncio.Context | None = None,
        restart_wait: float = 30.0,  # --restart-wait-timeout
    ):
        self.restart_wait = restart_wait
        self.ctx = ctx or zmq.asyncio.Context()
        self.replicas = replicas
        self.policy = policy or RoundRobin()
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.trace = trace or Trace(None, "router")
        self.pending: dict[str, _Pending] = {}
        self.max_pending = max_pending
        self.state, self.reason = "starting", ""
        self.down_reason = ""  # the last replica failure, while none serves
        self._settled = asyncio.Event()  # set while a replica is ready, draining or stopped
        self._receivers: list[asyncio.Task] = []
        # called with each replica that reports ready (a restart's too): LoraControl's
        self.ready_hooks: list[Callable[[Replica], None]] = []
        for replica in replicas:
            self._declare(replica)

    # ------------------------------------------------------------ replicas

    @property
    def ready(self) -> SchedulerReady | None:
        return self.replicas.first_ready()

    @property
    def max_model_len(self) -> int:
        """The most tokens (prompt + completion) one request can have on every ready
        replica: the model's context, or the KV pool when it is smaller (a scheduler
        refuses what its pool can never hold: kv_pool_too_small). 0 while none is ready."""
        limits = [min(r.ready.context_len, r.ready.num_slots) for r in self.replicas if r.ready]
        return min(limits, default=0)

    def add_replica(self, replica: Replica) -> None:
        """Start reading a replica's frames (before `receive_loop` runs or after)."""
        if replica not in self.replicas.replicas:
            self.replicas.add(replica)
        self._declare(replica)
        if self._receivers:
            self._receivers.append(asyncio.create_task(self._receive(replica)))

    def _declare(self, replica: Replica) -> None:
        if self.metrics is not None:
            self.metrics.add_replica(replica.id)

    async def receive_loop(self) -> None:
        self._receivers = [asyncio.create_task(self._receive(r)) for r in self.replicas]
        try:
            await asyncio.Event().wait()  # the tasks run until this one is cancelled
        finally:
            for task in self._receivers:
                task.cancel()

    async def _receive(self, replica: Replica) -> None:
        def lost(rid: str, why: str) -> None:
            self._deliver(replica, rid, RequestError(why, "internal_error", 500))

        await read_scheduler(replica, lambda msg, _: self._dispatch(replica, msg), lost, logger)

    def _dispatch(self, replica: Replica, msg) -> None:
        if isinstance(msg, TokenOutBatch):
            self.trace("tokens", *(out.rid for out in msg.outputs))
            for out in msg.outputs:
                self._deliver(replica, out.rid, out)
        elif isinstance(msg, (EmbedOut, LoraUpdated)):
            self._deliver(replica, msg.rid, msg)
        elif isinstance(msg, ReqError):
            headers = {"Retry-After": str(math.ceil(msg.retry_after))} if msg.retry_after else None
            self._deliver(
                replica, msg.rid, RequestError(msg.message, msg.code, msg.status, headers)
            )
        elif isinstance(msg, SchedulerStats):
            replica.stats = msg
            if self.metrics:
                self.metrics.observe_stats(msg, replica.id)
        elif isinstance(msg, CacheEvicted):
            self.policy.evicted(replica, msg.paths)
        elif isinstance(msg, DiskReport):
            if self.metrics:
                self.metrics.observe_disk(msg, replica.id)
        elif isinstance(msg, SchedulerReady):
            self._replica_ready(replica, msg)
        elif isinstance(msg, WorkerHung):
            replica.hung = msg

    def _replica_ready(self, replica: Replica, msg: SchedulerReady) -> None:
        if replica.state == "refused":
            return
        replica.ready, replica.state, replica.reason, replica.hung = msg, "ready", "", None
        if self.metrics:
            self.metrics.observe_ready(msg, replica.id)  # before /health can say 200
        replica.ready_event.set()
        for hook in self.ready_hooks:
            hook(replica)
        if len(self.replicas) > 1:
            logger.info("replica %s ready (%s)", replica.id, replica.address)
        self._settled.set()

    def _deliver(
        self, replica: Replica, rid: str, item: TokenOut | EmbedOut | LoraUpdated | RequestError
    ) -> None:
        pending = self.pending.get(rid)
        if pending is not None and pending.replica is replica:
            pending.queue.put_nowait(item)
        elif isinstance(item, TokenOut) and item.finish_reason is None:
            self._send_nowait(replica, AbortReq(rid))  # nobody waits for it here

    def replica_starting(self, replica: Replica) -> None:
        """Its processes were (re)started; it serves again once it reports ready."""
        replica.state, replica.ready_event = "starting", asyncio.Event()
        replica.hung, replica.last_heard = None, time.monotonic()

    def replica_down(self, replica: Replica, reason: str) -> None:
        """A replica died, hung or went away: its requests that produced nothing yet are
        retried elsewhere (once), the others fail with a 503 naming it."""
        replica.state, replica.reason, replica.hung = "down", reason, None
        self.policy.reset(replica)
        error = unavailable(f"replica {replica.id} ({replica.address}) failed: {reason}"
                            if len(self.replicas) > 1 else reason)  # fmt: skip
        for rid in replica.in_flight:
            pending = self.pending.get(rid)
            if pending is not None:
                pending.queue.put_nowait(_Lost(replica, error))
        replica.in_flight.clear()
        if not self.replicas.serving() and self.state == "serving":
            self.down_reason = reason
            self._settled.clear()

    # ------------------------------------------------------------ serving state

    @property
    def healthy(self) -> bool:
        return self.state == "serving" and bool(self.replicas.serving())

    @property
    def unhealthy_reason(self) -> str:
        if self.state == "serving" and not self.replicas.serving():
            return f"restarting: {self.down_reason}" if self.down_reason else "no replica serves"
        return self.reason or self.state

    def serving(self) -> None:
        self.state, self.reason, self.down_reason = "serving", "", ""
        if self.replicas.serving():
            self._settled.set()

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
        if self.state == "serving" and not self.replicas.serving():
            try:
                await asyncio.wait_for(self._settled.wait(), self.restart_wait)
            except asyncio.TimeoutError:
                raise unavailable(
                    f"server is {self.unhealthy_reason}; retry later", RETRY_AFTER
                ) from None
        self.check_ready()

    def check_ready(self) -> None:
        """Raise the 503 a new request gets now; during a restart `generate` waits."""
        if self.state in ("draining", "stopped"):
            raise unavailable(f"server is {self.reason}")
        if self.ready is None:
            raise unavailable("server is starting")

    # ------------------------------------------------------------ requests

    def _route(self, input_ids: list[int], exclude: Replica | None = None,
               route_key: str | None = None) -> Replica | None:  # fmt: skip
        candidates = [r for r in self.replicas.serving() if r is not exclude]
        if not candidates:
            return None
        started = time.thread_time()  # CPU time: on a busy machine, preemption is not ours
        if route_key and len(candidates) > 1:  # the client's hint: with this key, this one
            replica, reason = by_key(candidates, route_key), "route_key"
            self.policy.learn(replica, input_ids)
        else:
            replica, reason = self.policy.choose(candidates, input_ids)
        if self.metrics:
            seconds = time.thread_time() - started
            self.metrics.observe_routing(self.policy.name, reason, replica.id, seconds)
        return replica

    async def _submit(self, rid: str, pending: _Pending, req: GenerateReq,
                      exclude: Replica | None = None,
                      route_key: str | None = None) -> None:  # fmt: skip
        # a salted prompt is keyed as the replica's trie keys it: no hit across salts
        key = salted_key(req.input_ids, req.cache_salt, req.lora)
        replica = self._route(key, exclude, route_key)
        if replica is None:
            raise unavailable(f"server is {self.unhealthy_reason}; retry later", RETRY_AFTER)
        pending.replica = replica
        replica.in_flight.add(rid)
        replica.routed += 1
        self.trace("submit", rid)
        await replica.link.send(encode(req))

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: str | None = None,
        cache_salt: str = "", priority_len: int = 0, route_key: str | None = None,
        lora: int = 0,
    ) -> AsyncIterator[TokenOut]:  # fmt: skip
        """Yield TokenOut increments until the finishing one; abort if the caller stops.
        `cache_salt`, `priority_len`, `lora`: see GenerateReq; `route_key` (a client's
        prompt_cache_key) picks the replica (router.replicas.routing.by_key) rather than
        the routing policy."""
        await self._wait_serving()
        self._check_room()
        rid = rid or uuid.uuid4().hex
        if rid in self.pending:
            raise RequestError(f"request id {rid!r} is already in use", "duplicate_request_id")
        self.pending[rid] = pending = _Pending()
        finished = False
        images = getattr(input_ids, "images", [])  # a vision prompt's (api.image_inputs)
        req = GenerateReq(rid, list(input_ids), sampling, cache_salt, priority_len, lora, images)
        try:
            await self._submit(rid, pending, req, route_key=route_key)
            while True:
                item = await pending.queue.get()
                if isinstance(item, _Lost):
                    finished = True
                    if pending.produced or pending.retried or not self._retry_possible(item):
                        raise item.error
                    pending.retried, finished = True, False
                    logger.warning("retrying %s on another replica: %s", rid, item.error.message)
                    await self._submit(rid, pending, req, item.replica, route_key)
                    continue
                if isinstance(item, RequestError):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                pending.produced = True
                if self.metrics:
                    self.metrics.observe_output(item, pending.created, pending.replica.id)
                yield item
                if finished:
                    return
        finally:
            self.pending.pop(rid, None)
            if pending.replica is not None:
                pending.replica.in_flight.discard(rid)
            if self.metrics:
                self.metrics.forget(rid)
            if not finished and pending.replica is not None:
                self._send_nowait(pending.replica, AbortReq(rid))

    def _check_room(self) -> None:
        if len(self.pending) >= self.max_pending:
            raise RequestError(
                f"server overloaded: {len(self.pending)} requests in flight "
                f"(--max-queued-requests {self.max_pending}); retry later",
                "overloaded", 503,
            )  # fmt: skip

    async def embed(self, inputs: list[list[int]]) -> EmbedOut:
        """The inputs' embeddings, from the least loaded replica that serves (embeddings
        use no cache, so no replica's is better); a request lost with its replica is sent
        once to another."""
        await self._wait_serving()
        self._check_room()
        rid = uuid.uuid4().hex
        self.pending[rid] = pending = _Pending()
        finished = False
        try:
            for attempt in range(2):
                serving = self.replicas.serving()
                if not serving:
                    raise unavailable(
                        f"server is {self.unhealthy_reason}; retry later", RETRY_AFTER
                    )
                pending.replica = replica = min(serving, key=lambda r: len(r.in_flight))
                replica.in_flight.add(rid)
                await replica.link.send(encode(EmbedReq(rid, inputs)))
                item = await pending.queue.get()
                if isinstance(item, _Lost) and attempt == 0 and self._retry_possible(item):
                    continue
                finished = True
                if isinstance(item, (_Lost, RequestError)):
                    raise item.error if isinstance(item, _Lost) else item
                if self.metrics:
                    self.metrics.observe_embedding(item.prompt_tokens, replica.id)
                return item
        finally:
            self.pending.pop(rid, None)
            if pending.replica is not None:
                pending.replica.in_flight.discard(rid)
                if not finished:
                    self._send_nowait(pending.replica, AbortReq(rid))

    async def update_lora(self, lora: int, name: str, path: str = "") -> None:
        """Load the adapter at `path` as id `lora` on every serving replica, or (no path)
        unload it once its requests there are done; RequestError (400) with the worker's
        reason if one refuses."""
        await self._wait_serving()
        for replica in self.replicas.serving():
            await self.update_replica_lora(replica, lora, name, path)

    async def update_replica_lora(self, replica: Replica, lora: int, name: str, path: str) -> None:
        """`update_lora` on one replica."""
        rid = uuid.uuid4().hex
        self.pending[rid] = pending = _Pending(replica=replica)
        replica.in_flight.add(rid)  # a replica lost meanwhile answers with _Lost
        try:
            await replica.link.send(encode(LoraUpdate(rid, lora, name, path)))
            item = await pending.queue.get()
        finally:
            self.pending.pop(rid, None)
            replica.in_flight.discard(rid)
        if isinstance(item, (_Lost, RequestError)):
            raise item.error if isinstance(item, _Lost) else item
        if item.error:
            raise RequestError(item.error, param="lora_path" if path else "lora_name")

    def _retry_possible(self, lost: _Lost) -> bool:
        others = [r for r in self.replicas.serving() if r is not lost.replica]
        return self.state == "serving" and bool(others)

    def _send_nowait(self, replica: Replica, msg) -> None:
        """A message that must not wait: with no scheduler connected (a restart), it is
        dropped, and the fresh scheduler knows nothing of the request anyway."""
        if not replica.link.send_nowait(encode(msg)):
            logger.debug("dropped %s: the scheduler's queue is full", type(msg).__name__)

    def close(self) -> None:
        for replica in self.replicas:
            replica.link.close()
        self.ctx.destroy(linger=0)
