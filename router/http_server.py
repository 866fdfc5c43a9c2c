"""The OpenAI-compatible HTTP API (FastAPI on uvicorn).

A client that goes away aborts its request in the scheduler: a stream when Starlette sees
the disconnect (the stream task is cancelled), a non-streaming request through a watcher
that waits for `http.disconnect` while the answer is being generated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from router.generation import Chunk, Tokenization, generate_text
from router.manager import RequestError, RouterManager
from router.metrics import track_finish
from router.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenPieces,
    chat_logprobs,
    completion_logprobs,
    error_body,
    usage,
)

_STATUS_CODES = {
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
}


def create_app(manager: RouterManager, tokenizer, args, metrics=None) -> FastAPI:
    app = FastAPI(title="radix-mlx", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Guard, api_key=args.api_key, max_bytes=args.max_request_bytes)
    if args.allowed_origins:  # outside the guard: a preflight carries no API key
        app.add_middleware(
            CORSMiddleware, allow_origins=args.allowed_origins, allow_methods=["*"],
            allow_headers=["*"],
        )  # fmt: skip
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    routes = _Routes(manager, tokenizer, args, metrics)
    app.get("/health")(routes.health)
    app.get("/v1/models")(routes.models)
    app.get("/metrics")(routes.metrics_text)
    app.post("/v1/completions")(routes.completions)
    app.post("/v1/chat/completions")(routes.chat_completions)
    return app


async def _request_error(_: Request, exc: RequestError):
    return JSONResponse(error_body(exc.message, exc.code, exc.status), exc.status)


async def _validation_error(_: Request, exc: RequestValidationError):
    return JSONResponse(error_body(_describe(exc), "invalid_request_error", 400), 400)


async def _http_error(_: Request, exc: HTTPException):
    code = _STATUS_CODES.get(exc.status_code, "invalid_request_error")
    body = error_body(str(exc.detail), code, exc.status_code)
    return JSONResponse(body, exc.status_code, headers=exc.headers)


class _Routes:
    """The endpoints, over one router manager and tokenizer."""

    def __init__(self, manager: RouterManager, tokenizer, args, metrics):
        self.manager, self.tokenizer, self.args, self.metrics = manager, tokenizer, args, metrics
        self.tok = Tokenization(tokenizer, manager)
        self.pieces = TokenPieces(tokenizer)
        self.model_name = args.model_name

    async def health(self):
        if self.manager.healthy and self.manager.ready is not None:
            return PlainTextResponse("ok")
        reason = self.manager.unhealthy_reason or "starting"
        return PlainTextResponse(reason, status_code=503)

    async def models(self):
        card = {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "radix-mlx",
            "max_model_len": self.manager.context_len,
        }
        return {"object": "list", "data": [card]}

    async def metrics_text(self):
        if self.metrics is None:
            return PlainTextResponse("", media_type="text/plain")
        body, content_type = self.metrics.render()
        return PlainTextResponse(body, media_type=content_type)

    def _check(self, req) -> None:
        """What any request needs before its prompt is looked at."""
        self.manager.check_ready()
        if req.model not in (None, "", self.model_name, self.args.model_path):
            raise RequestError(
                f"model {req.model!r} does not exist; serving {self.model_name!r}",
                "model_not_found",
                404,
            )
        problem = req.unsupported()
        if problem:
            raise RequestError(problem, "unsupported_parameter")

    def _start(self, req, ids: list[int], sampling, rid: str) -> AsyncIterator[Chunk]:
        """The request's chunks of generated text."""
        self.tok.check_ids(ids, sampling)
        stops = req.stop_strings()
        chunks = generate_text(self.manager, self.tokenizer, ids, sampling, stops, rid)
        return track_finish(chunks, self.metrics, rid)

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tok.encode_text(prompt)
        if prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise RequestError("a batch of prompts is not supported yet; send one prompt")
            return self.tok.encode_text(prompt[0])
        return list(prompt)

    async def completions(self, req: CompletionRequest, request: Request):
        self._check(req)
        ids = self._prompt_ids(req.prompt)
        sampling = req.sampling(req.max_tokens if req.max_tokens is not None else 16)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        chunks = self._start(req, ids, sampling, rid)
        echo = self.tokenizer.decode(ids) if req.echo else ""
        offset = [0]  # text offset of the next token, for logprobs

        def render(c: Chunk, text: str) -> dict:
            lp = None
            if sampling.logprobs and c.token_ids:
                lp = completion_logprobs(
                    c.token_ids, c.logprobs, c.top_logprobs, self.pieces, offset[0]
                )
                offset[0] += len(text)
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}
            choice["token_ids"] = c.token_ids
            return self._body(rid, "text_completion", created, choice)

        if req.stream:
            return await _sse(request, chunks, render, _include_usage(req), prefix=echo)
        return await _unless_disconnected(request, _collect(chunks, render, prefix=echo))

    async def chat_completions(self, req: ChatCompletionRequest, request: Request):
        self._check(req)
        ids = self.tok.encode_chat(req.messages)
        max_new = req.max_completion_tokens
        if max_new is None:
            max_new = req.max_tokens
        if max_new is None:  # as much as fits in the context and in the KV pool
            room = min(self.manager.context_len, self.manager.ready.num_slots) - len(ids)
            max_new = max(1, room)
        sampling = req.sampling(max_new)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        chunks = self._start(req, ids, sampling, rid)
        first = [True]

        def logprobs_of(c: Chunk) -> dict | None:
            if not sampling.logprobs or not c.token_ids:
                return None
            return chat_logprobs(c.token_ids, c.logprobs, c.top_logprobs, self.pieces)

        def render_delta(c: Chunk, text: str) -> dict:
            delta = {"content": text}
            if first[0]:
                delta["role"], first[0] = "assistant", False
            choice = {"index": 0, "delta": delta, "logprobs": logprobs_of(c)}
            choice["finish_reason"] = c.finish_reason
            return self._body(rid, "chat.completion.chunk", created, choice)

        def render_whole(c: Chunk, text: str) -> dict:
            choice = {"index": 0, "logprobs": logprobs_of(c), "finish_reason": c.finish_reason}
            choice["message"] = {"role": "assistant", "content": text}
            choice["token_ids"] = c.token_ids
            return self._body(rid, "chat.completion", created, choice)

        if req.stream:
            return await _sse(request, chunks, render_delta, _include_usage(req))
        return await _unless_disconnected(request, _collect(chunks, render_whole))

    def _body(self, rid: str, kind: str, created: int, choice: dict) -> dict:
        return {
            "id": rid,
            "object": kind,
            "created": created,
            "model": self.model_name,
            "choices": [choice],
        }


class _Guard:
    """Pure ASGI middleware (no per-chunk cost on streams): the API key on /v1/ and the
    request body limit, checked on Content-Length and again on the bytes received, so a
    chunked upload cannot get around it."""

    def __init__(self, app, api_key: str | None, max_bytes: int):
        self.app = app
        self.bearer = f"Bearer {api_key}".encode() if api_key else None
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.bearer is not None and scope["path"].startswith("/v1/"):
            if headers.get(b"authorization") != self.bearer:
                body = error_body("invalid or missing API key", "invalid_api_key", 401)
                return await JSONResponse(body, 401)(scope, receive, send)
        size = headers.get(b"content-length", b"")
        if size.isdigit() and int(size) > self.max_bytes:
            return await JSONResponse(self._too_large(int(size)), 413)(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(413, self._too_large(seen)["error"]["message"])
            return message

        await self.app(scope, limited_receive, send)

    def _too_large(self, size: int) -> dict:
        msg = f"request body of {size} bytes exceeds the limit of {self.max_bytes} bytes"
        return error_body(msg, "request_too_large", 413)


def _include_usage(req) -> bool:
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


async def _until_disconnected(request: Request) -> None:
    """Returns when the client goes away (after the body was read, uvicorn's `receive`
    only answers with `http.disconnect`)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable):
    """Await `work`; if the client disconnects first, cancel it (which aborts the request
    upstream) and answer 499, which nobody will read."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise RequestError("client closed the request", "client_closed_request", 499)
    return task.result()


async def _collect(chunks: AsyncIterator[Chunk], render: Callable, prefix: str = "") -> dict:
    texts, ids, logprobs, top, last = [prefix], [], [], [], None
    async with _closing(chunks):
        async for c in chunks:
            texts.append(c.text)
            ids += c.token_ids
            logprobs = _extend(logprobs, c.logprobs, c.token_ids)
            top = _extend(top, c.top_logprobs, c.token_ids)
            last = c
    text = "".join(texts)
    whole = dataclasses.replace(last, text=text, token_ids=ids, logprobs=logprobs, top_logprobs=top)
    body = render(whole, text)
    body["usage"] = usage(last.prompt_tokens, len(ids), last.cached_tokens)
    return body


def _extend(acc: list | None, more: list | None, token_ids: list[int]) -> list | None:
    """Per-token lists across chunks; None once a chunk with tokens has none."""
    if acc is None or (more is None and token_ids):
        return None
    if more:
        acc += more
    return acc


async def _sse(
    request: Request,
    chunks: AsyncIterator[Chunk],
    render: Callable,
    include_usage: bool,
    prefix: str = "",
) -> StreamingResponse:
    """Server-sent events; the first chunk is awaited first so early errors get a 4xx.

    Chunks whose text is still held back (half a character, a possible stop string) are
    not sent on their own: their token ids ride along with the next chunk that has text.
    """
    try:
        first = await _unless_disconnected(request, anext(chunks))
    except BaseException:
        await _aclose_shielded(chunks)
        raise

    async def events():
        last, sent, held = first, len(first.token_ids), None
        try:
            if prefix:
                yield _event(render(Chunk(prefix, [], None, 0, 0, 0), prefix))
            yield _event(render(first, first.text))
            async for c in chunks:
                last = c
                sent += len(c.token_ids)
                if held is not None:
                    c, held = _merge(held, c), None
                if not c.text and c.finish_reason is None:
                    held = c
                    continue
                yield _event(render(c, c.text))
            if include_usage:
                body = render(last, "")
                body["choices"] = []
                body["usage"] = usage(last.prompt_tokens, sent, last.cached_tokens)
                yield _event(body)
        except RequestError as exc:
            yield _event(error_body(exc.message, exc.code, exc.status))
        finally:
            await _aclose_shielded(chunks)
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


def _merge(a: Chunk, b: Chunk) -> Chunk:
    """`b` with the text, tokens and logprobs of the held-back `a` in front."""

    def cat(x, y):
        x = [] if x is None and not a.token_ids else x
        y = [] if y is None and not b.token_ids else y
        return None if x is None or y is None else x + y

    return dataclasses.replace(
        b,
        text=a.text + b.text,
        token_ids=a.token_ids + b.token_ids,
        logprobs=cat(a.logprobs, b.logprobs),
        top_logprobs=cat(a.top_logprobs, b.top_logprobs),
    )


class _closing:
    """`contextlib.aclosing` whose close survives a cancelled task."""

    def __init__(self, gen):
        self.gen = gen

    async def __aenter__(self):
        return self.gen

    async def __aexit__(self, *exc):
        await _aclose_shielded(self.gen)


async def _aclose_shielded(gen) -> None:
    with anyio.CancelScope(shield=True):
        await gen.aclose()


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _describe(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error") or err.get("msg")
            return f"malformed JSON body: {detail}"
        if not loc and err.get("type") == "missing":
            return "the request has no body; send a JSON object"
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts[:5])
