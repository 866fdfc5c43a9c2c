"""radix-mlx SDK: talk to a running server over its ZMQ front door.

    from radix_mlx import Client
    with Client("tcp://127.0.0.1:30001") as c:
        r = c.generate("Hello", max_new_tokens=8, temperature=0)
        print(r.output_ids, r.text, r.finish_reason, r.usage.cached_tokens)

`AsyncClient` has the same methods as coroutines / async iterators and may run many
requests at once on one connection.

Every call takes an optional `rid` (default: a fresh uuid); `abort(rid)` stops that
request in the server, which then ends it with `finish_reason == "abort"` and what was
generated so far. Closing a stream early aborts its request; so does closing the client
or losing the connection (the server notices the disconnection). `timeout` bounds the
wait for each answer (each chunk of a stream) and raises `RequestTimeout`; a refused or
failed request raises `RadixMLXError` with the server's message, code and HTTP status.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, fields
from typing import Any

import zmq
import zmq.asyncio

from radix_mlx.messages import (
    CLIENT_INBOX,
    ClientAbort,
    ClientError,
    ClientGenerate,
    ClientResult,
    Output,
    SamplingParams,
)
from radix_mlx.output import OutputAccumulator
from radix_mlx.protocol import ProtocolError, decode, encode

_SAMPLING_NAMES = {f.name for f in fields(SamplingParams)}


class RadixMLXError(Exception):
    """The server refused or failed a request; `message` is the server's own words."""

    def __init__(self, message: str, code: str = "error", status: int = 500):
        super().__init__(message)
        self.message, self.code, self.status = message, code, status


class RequestTimeout(RadixMLXError, TimeoutError):
    def __init__(self, seconds: float):
        super().__init__(f"no answer within {seconds} s", "timeout", 408)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class GenerateResult:
    rid: str
    output_ids: list[int]
    text: str
    finish_reason: str | None
    usage: Usage
    # with logprobs=True: per output token, 1:1 with output_ids, its logprob and the
    # top_logprobs best alternatives as [[token_id, logprob], ...]
    logprobs: list[float] | None = None
    top_logprobs: list[list[Any]] | None = None


@dataclass
class StreamChunk:
    rid: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    usage: Usage  # counted so far
    logprobs: list[float] | None = None  # per token in token_ids, as GenerateResult's
    top_logprobs: list[list[Any]] | None = None


def _request(
    stream: bool, text=None, input_ids=None, messages=None, rid=None, cache_salt=None,
    model=None, **sampling: Any,
) -> ClientGenerate:  # fmt: skip
    """The request; `cache_salt` (any call's keyword): only requests with the same salt
    share cached prompt prefixes (vLLM's field); `model` (any call's keyword): the model
    to run, on a server with several (a name it answers to, else an error naming it)."""
    unknown = set(sampling) - _SAMPLING_NAMES
    if unknown:
        raise TypeError(f"unknown sampling parameters: {sorted(unknown)}")
    return ClientGenerate(
        rid=rid or uuid.uuid4().hex,
        sampling=SamplingParams(**sampling),
        text=text,
        input_ids=list(input_ids) if input_ids is not None else None,
        messages=messages,
        stream=stream,
        cache_salt=cache_salt,
        model=model,
    )


def _checked(msg: ClientResult | ClientError) -> ClientResult:
    if isinstance(msg, ClientError):
        raise RadixMLXError(msg.message, msg.code, msg.status)
    return msg


def _answer(kind: type, rid: str, out: Output):
    """A StreamChunk or GenerateResult (the same fields; ids named differently)."""
    usage = Usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)
    return kind(
        rid, out.token_ids, out.text, out.finish_reason, usage, out.logprobs, out.top_logprobs
    )


def _whole(rid: str, outputs) -> GenerateResult:
    """The answers of a request merged, as the server merges chunks (a request that does
    not stream gets one answer)."""
    acc = OutputAccumulator()
    for out in outputs:
        acc.add(out)
    return _answer(GenerateResult, rid, acc.output())


class Client:
    """Blocking client; one request at a time per instance."""

    def __init__(self, address: str, timeout: float | None = 600.0, api_key: str | None = None):
        self.address, self.timeout, self.api_key = address, timeout, api_key
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)

    def generate(
        self, text: str | None = None, *, input_ids=None, rid=None, timeout=None, **sampling
    ) -> GenerateResult:
        req = _request(False, text, input_ids, rid=rid, **sampling)
        return _whole(req.rid, self._run(req, timeout))

    def chat(self, messages: list[dict], *, rid=None, timeout=None, **sampling) -> GenerateResult:
        req = _request(False, messages=messages, rid=rid, **sampling)
        return _whole(req.rid, self._run(req, timeout))

    def stream(
        self,
        text: str | None = None,
        *,
        input_ids=None,
        messages=None,
        rid=None,
        timeout=None,
        **sampling,
    ) -> Iterator[StreamChunk]:
        """Yield increments; closing the iterator early aborts the request."""
        req = _request(True, text, input_ids, messages, rid=rid, **sampling)
        for out in self._run(req, timeout):
            yield _answer(StreamChunk, req.rid, out)

    def abort(self, rid: str) -> None:
        if not self._sock.closed:
            self._sock.send(encode(ClientAbort(rid)))

    def _run(self, req: ClientGenerate, timeout: float | None) -> Iterator[ClientResult]:
        timeout = timeout if timeout is not None else self.timeout
        req.api_key = self.api_key
        self._sock.send(encode(req))
        done = False
        try:
            while not done:
                out = _checked(self._recv(req.rid, timeout))
                done = out.finish_reason is not None
                yield out
        finally:
            if not done:
                self.abort(req.rid)

    def _recv(self, rid: str, timeout: float | None) -> ClientResult | ClientError:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._sock.poll(None if wait is None else int(wait * 1000)):
                raise RequestTimeout(timeout)
            try:
                msg = decode(self._sock.recv(), CLIENT_INBOX)
            except ProtocolError as exc:
                raise RadixMLXError(f"bad answer from the server: {exc}", "protocol") from None
            if msg.rid in (rid, ""):
                return msg  # anything else is a late answer to an aborted request

    def close(self) -> None:
        self._ctx.destroy(linger=0)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client; any number of concurrent requests share one connection."""

    def __init__(self, address: str, timeout: float | None = 600.0, api_key: str | None = None):
        self.address, self.timeout, self.api_key = address, timeout, api_key
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None

    async def generate(
        self,
        text: str | None = None,
        *,
        input_ids=None,
        messages=None,
        rid=None,
        timeout=None,
        **sampling,
    ) -> GenerateResult:
        req = _request(False, text, input_ids, messages, rid=rid, **sampling)
        run = self._run(req, timeout)
        try:
            return _whole(req.rid, [out async for out in run])
        finally:
            await run.aclose()

    async def chat(
        self, messages: list[dict], *, rid=None, timeout=None, **sampling
    ) -> GenerateResult:
        return await self.generate(messages=messages, rid=rid, timeout=timeout, **sampling)

    async def stream(
        self,
        text: str | None = None,
        *,
        input_ids=None,
        messages=None,
        rid=None,
        timeout=None,
        **sampling,
    ) -> AsyncIterator[StreamChunk]:
        """Yield increments; leaving early (`aclose`, or garbage collection of the
        iterator after `break`) aborts the request."""
        req = _request(True, text, input_ids, messages, rid=rid, **sampling)
        run = self._run(req, timeout)
        try:
            async for out in run:
                yield _answer(StreamChunk, req.rid, out)
        finally:
            await run.aclose()

    async def abort(self, rid: str) -> None:
        if not self._sock.closed:
            await self._sock.send(encode(ClientAbort(rid)))

    async def _run(self, req: ClientGenerate, timeout) -> AsyncIterator[ClientResult]:
        timeout = timeout if timeout is not None else self.timeout
        req.api_key = self.api_key
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())
        if req.rid in self._queues:
            raise ValueError(f"request id {req.rid!r} is already running on this client")
        queue = self._queues[req.rid] = asyncio.Queue()
        await self._sock.send(encode(req))
        done = False
        try:
            while not done:
                try:
                    msg = await asyncio.wait_for(queue.get(), timeout)
                except asyncio.TimeoutError:
                    raise RequestTimeout(timeout) from None
                out = _checked(msg)
                done = out.finish_reason is not None
                yield out
        finally:
            self._queues.pop(req.rid, None)
            if not done:
                await self.abort(req.rid)

    async def _read(self) -> None:
        while True:
            frame = await self._sock.recv()
            try:
                msg = decode(frame, CLIENT_INBOX)
            except ProtocolError as exc:
                msg = ClientError("", f"bad answer from the server: {exc}", "protocol", 500)
            targets = self._queues.values() if msg.rid == "" else [self._queues.get(msg.rid)]
            for q in targets:
                if q is not None:
                    q.put_nowait(msg)

    async def close(self) -> None:
        """Close the connection; requests still waiting end with RadixMLXError (and the
        server aborts them when it sees the disconnection)."""
        if self._reader is not None:
            self._reader.cancel()
        for rid, q in list(self._queues.items()):
            q.put_nowait(ClientError(rid, "the client was closed", "closed", 499))
        self._ctx.destroy(linger=0)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
