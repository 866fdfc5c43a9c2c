"""The router's ZMQ front door for SDK clients (`router.client`).

A ROUTER socket: each SDK request runs as an asyncio task keyed by (client identity, rid);
ClientAbort cancels it, which aborts the request in the scheduler. Sends are
ROUTER_MANDATORY, so a client that vanished makes the next send fail and its request is
aborted rather than left running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import zmq
import zmq.asyncio

from common.messages import (
    FRONTDOOR_INBOX,
    ClientAbort,
    ClientError,
    ClientGenerate,
    ClientResult,
)
from common.protocol import ProtocolError, decode, encode, peek_rid
from router.generation import Tokenization, generate_text
from router.manager import RequestError, RouterManager

logger = logging.getLogger("router")


class FrontDoor:
    def __init__(self, address: str, manager: RouterManager, tokenizer):
        self.manager = manager
        self.tokenizer = tokenizer
        self.tok = Tokenization(tokenizer, manager)
        self.sock = manager.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.bind(address)
        self.address = address
        self.tasks: dict[tuple[bytes, str], asyncio.Task] = {}

    async def serve(self) -> None:
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
                    task.cancel()
                continue
            if key in self.tasks:
                await self._send(ident, ClientError(msg.rid, f"request id {msg.rid!r} in use"))
                continue
            task = asyncio.create_task(self._handle(ident, msg))
            self.tasks[key] = task
            task.add_done_callback(lambda _t, k=key: self.tasks.pop(k, None))

    async def _handle(self, ident: bytes, msg: ClientGenerate) -> None:
        try:
            ids = self._input_ids(msg)
            self.tok.check_ids(ids, msg.sampling)
            text, out_ids = "", []
            chunks = generate_text(self.manager, self.tokenizer, ids, msg.sampling)
            async with contextlib.aclosing(chunks):
                async for c in chunks:
                    text += c.text
                    out_ids += c.token_ids
                    if not msg.stream and c.finish_reason is None:
                        continue
                    result = ClientResult(
                        msg.rid,
                        c.token_ids if msg.stream else out_ids,
                        c.text if msg.stream else text,
                        c.finish_reason,
                        c.prompt_tokens,
                        len(out_ids),
                        c.cached_tokens,
                    )
                    if not await self._send(ident, result):
                        return  # client gone: leaving the loop aborts the request
        except RequestError as exc:
            await self._send(ident, ClientError(msg.rid, exc.message, exc.code, exc.status))
        except asyncio.CancelledError:
            pass  # ClientAbort: the generator's cleanup told the scheduler

    def _input_ids(self, msg: ClientGenerate) -> list[int]:
        given = [x is not None for x in (msg.text, msg.input_ids, msg.messages)]
        if sum(given) != 1:
            raise RequestError("give exactly one of text, input_ids or messages")
        if msg.text is not None:
            return self.tok.encode_text(msg.text)
        if msg.messages is not None:
            return self.tok.encode_chat(msg.messages)
        return list(msg.input_ids)

    async def _send(self, ident: bytes, msg) -> bool:
        try:
            await self.sock.send_multipart([ident, encode(msg)])
            return True
        except zmq.ZMQError as exc:
            logger.info("SDK client vanished (%s); dropping its request", exc)
            return False
