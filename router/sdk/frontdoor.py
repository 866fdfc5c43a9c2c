"""The router's ZMQ front door for SDK clients (`router.client`).

A ROUTER socket: each SDK request runs as an asyncio task keyed by (client identity, rid);
ClientAbort cancels it, which aborts the request in the scheduler and answers with a last
result whose finish_reason is "abort". A client that vanishes does not leak its requests:
sends are ROUTER_MANDATORY, so a send to a client whose connection is gone fails, and every
PROBE_INTERVAL seconds each client with requests in progress gets a probe (a ClientResult
for rid PROBE_RID, which matches no request, so clients drop it); a failed send cancels
all of that client's requests. (libzmq's ROUTER_NOTIFY would tell us directly, but it is
a draft API that the pyzmq wheels do not enable.)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import uuid

import zmq
import zmq.asyncio

from common.cache_salt import salt_problem
from common.messages import (
    FRONTDOOR_INBOX,
    ClientAbort,
    ClientError,
    ClientGenerate,
    ClientResult,
    Output,
)
from common.protocol import ProtocolError, decode, encode, peek_rid
from router.api.generation import Tokenization, generate_text
from router.metrics import track_finish
from router.output import OutputAccumulator
from router.request_error import RequestError

logger = logging.getLogger("router")
PROBE_INTERVAL = 1.0  # seconds between liveness probes of clients with requests in progress
PROBE_RID = "\x00probe"  # no request uses it: SDK clients drop the probe


class FrontDoor:
    def __init__(self, address: str, models, ctx: zmq.asyncio.Context,
                 api_key: str | None = None):  # fmt: skip
        """`models` (router.api.served_models): each request's model's ApiContext."""
        self.api_key = api_key
        self.models = models
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.bind(address)
        self.address = address
        self.tasks: dict[tuple[bytes, str], asyncio.Task] = {}
        self.aborted: set[tuple[bytes, str]] = set()  # cancelled by a ClientAbort

    async def serve(self) -> None:
        prober = asyncio.create_task(self._probe_clients())
        try:
            await self._receive()
        finally:
            prober.cancel()

    async def _receive(self) -> None:
        while True:
            parts = await self.sock.recv_multipart()
            if len(parts) != 2:
                logger.warning("SDK message with %d frames dropped", len(parts))
                continue
            ident, frame = parts
            try:
                msg = decode(frame, FRONTDOOR_INBOX)
            except ProtocolError as exc:
                logger.warning("bad frame from SDK client: %s", exc)
                await self._send(ident, ClientError(peek_rid(frame) or "", f"bad frame: {exc}"))
                continue
            key = (ident, msg.rid)
            if isinstance(msg, ClientAbort):
                task = self.tasks.get(key)
                if task is not None:
                    self.aborted.add(key)
                    task.cancel()
                continue
            if self.api_key and not hmac.compare_digest(msg.api_key or "", self.api_key):
                error = ClientError(msg.rid, "invalid or missing API key", "invalid_api_key", 401)
                await self._send(ident, error)
                continue
            if key in self.tasks:
                await self._send(ident, ClientError(msg.rid, f"request id {msg.rid!r} in use"))
                continue
            task = asyncio.create_task(self._handle(ident, msg))
            self.tasks[key] = task
            task.add_done_callback(lambda _t, k=key: self._done(k))

    def _done(self, key: tuple[bytes, str]) -> None:
        self.tasks.pop(key, None)
        self.aborted.discard(key)

    async def _probe_clients(self) -> None:
        probe = encode(_result(PROBE_RID, Output("", [], None, 0, 0, 0)))
        while True:
            await asyncio.sleep(PROBE_INTERVAL)
            for ident in {who for who, _ in self.tasks}:
                try:
                    await self.sock.send_multipart([ident, probe], flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass  # connected but not reading yet (its queue is full)
                except zmq.ZMQError:
                    self._client_gone(ident)

    def _client_gone(self, ident: bytes) -> None:
        gone = [task for (who, _), task in self.tasks.items() if who == ident]
        if gone:
            logger.info("SDK client disconnected; aborting its %d request(s)", len(gone))
        for task in gone:
            task.cancel()

    async def _handle(self, ident: bytes, msg: ClientGenerate) -> None:
        """Answer with each chunk if the request streams, else with the whole output."""
        acc, prompt_len = OutputAccumulator(), 0
        try:
            api = await self.models.context(msg.model)
            ids = _input_ids(api.strict_tok, msg)
            prompt_len = len(ids)
            api.strict_tok.check_ids(ids, msg.sampling)
            problem = salt_problem(msg.cache_salt)
            if problem:
                raise RequestError(problem, param="cache_salt")
            rid = f"sdk-{uuid.uuid4().hex}"  # client rids are only unique per client
            chunks = generate_text(
                api.manager, api.tokenizer, ids, msg.sampling, rid=rid,
                cache_salt=msg.cache_salt or "",
            )  # fmt: skip
            chunks = track_finish(chunks, api.manager.metrics, rid)
            async with contextlib.aclosing(chunks):
                async for c in chunks:
                    acc.add(c)
                    if not msg.stream and c.finish_reason is None:
                        continue
                    if not await self._send(ident, _result(msg.rid, acc.take())):
                        return  # client gone: leaving the loop aborts the request
        except RequestError as exc:
            await self._send(ident, ClientError(msg.rid, exc.message, exc.code, exc.status))
        except asyncio.CancelledError:
            # The generator's cleanup told the scheduler. A ClientAbort gets a last answer
            # (what was generated so far and not sent yet, finish_reason "abort") so the
            # caller's wait ends.
            if (ident, msg.rid) in self.aborted:
                rest = acc.take()
                rest = dataclasses.replace(rest, finish_reason="abort", prompt_tokens=prompt_len)
                await self._send(ident, _result(msg.rid, rest))

    async def _send(self, ident: bytes, msg) -> bool:
        try:
            await self.sock.send_multipart([ident, encode(msg)])
            return True
        except zmq.ZMQError as exc:
            logger.info("SDK client vanished (%s); dropping its request", exc)
            return False


def _input_ids(tok: Tokenization, msg: ClientGenerate) -> list[int]:
    given = [x is not None for x in (msg.text, msg.input_ids, msg.messages)]
    if sum(given) != 1:
        raise RequestError("give exactly one of text, input_ids or messages")
    if msg.text is not None:
        return tok.encode_text(msg.text)
    if msg.messages is not None:
        return tok.encode_chat(msg.messages)
    return list(msg.input_ids)


def _result(rid: str, output: Output) -> ClientResult:
    fields = {f.name: getattr(output, f.name) for f in dataclasses.fields(Output)}
    return ClientResult(rid=rid, **fields)
