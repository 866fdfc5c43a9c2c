"""The OpenAI-compatible HTTP API (FastAPI on uvicorn)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from router.generation import Chunk, Tokenization, generate_text
from router.manager import RequestError, RouterManager
from router.openai_api import ChatCompletionRequest, CompletionRequest, error_body, usage


def create_app(manager: RouterManager, tokenizer, args, metrics=None) -> FastAPI:
    app = FastAPI(title="radix-mlx", docs_url=None, redoc_url=None)
    tok = Tokenization(tokenizer, manager)
    model_name = args.model_name

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError):
        return JSONResponse(error_body(exc.message, exc.code, exc.status), exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        return JSONResponse(error_body(_describe(exc), "invalid_request_error", 400), 400)

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        if args.api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization") != f"Bearer {args.api_key}":
                return JSONResponse(error_body("invalid API key", "invalid_api_key", 401), 401)
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > args.max_request_bytes:
            msg = f"request body of {size} bytes exceeds the limit of {args.max_request_bytes}"
            return JSONResponse(error_body(msg, "request_too_large", 413), 413)
        return await call_next(request)

    @app.get("/health")
    async def health():
        if manager.healthy and manager.ready is not None:
            return PlainTextResponse("ok")
        reason = manager.unhealthy_reason or "starting"
        return PlainTextResponse(reason, status_code=503)

    @app.get("/v1/models")
    async def models():
        card = {
            "id": model_name,
            "object": "model",
            "created": 0,
            "owned_by": "radix-mlx",
            "max_model_len": manager.context_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics_endpoint():
        if metrics is None:
            return PlainTextResponse("", media_type="text/plain")
        body, content_type = metrics.render()
        return PlainTextResponse(body, media_type=content_type)

    def check_model(req) -> None:
        if req.model not in (None, "", model_name, args.model_path):
            raise RequestError(
                f"model {req.model!r} does not exist; serving {model_name!r}",
                "model_not_found",
                404,
            )
        problem = req.unsupported()
        if problem:
            raise RequestError(problem, "unsupported_parameter")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        manager.check_ready()
        check_model(req)
        if isinstance(req.prompt, str):
            ids = tok.encode_text(req.prompt)
        elif req.prompt and isinstance(req.prompt[0], str):
            if len(req.prompt) != 1:
                raise RequestError("a batch of prompts is not supported yet; send one prompt")
            ids = tok.encode_text(req.prompt[0])
        else:
            ids = list(req.prompt)
        sampling = req.sampling(req.max_tokens if req.max_tokens is not None else 16)
        tok.check_ids(ids, sampling)
        echo = tokenizer.decode(ids) if req.echo else ""
        chunks = generate_text(manager, tokenizer, ids, sampling, req.stop_strings())
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def render(c: Chunk, text: str) -> dict:
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model_name,
                "choices": [
                    {
                        "index": 0,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": c.finish_reason,
                        "token_ids": c.token_ids,
                    }
                ],
            }

        if req.stream:
            return await _sse(chunks, render, _include_usage(req), prefix=echo)
        return await _collect(chunks, render, prefix=echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        manager.check_ready()
        check_model(req)
        ids = tok.encode_chat(req.messages)
        max_new = req.max_completion_tokens or req.max_tokens
        sampling = req.sampling(
            max_new if max_new is not None else max(1, manager.context_len - len(ids))
        )
        tok.check_ids(ids, sampling)
        chunks = generate_text(manager, tokenizer, ids, sampling, req.stop_strings())
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        first = [True]

        def render_delta(c: Chunk, text: str) -> dict:
            delta = {"content": text}
            if first[0]:
                delta["role"], first[0] = "assistant", False
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model_name,
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": c.finish_reason}
                ],
            }

        def render_whole(c: Chunk, text: str) -> dict:
            return {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": model_name,
                "choices": [
                    {
                        "index": 0,
                        "logprobs": None,
                        "finish_reason": c.finish_reason,
                        "message": {"role": "assistant", "content": text},
                        "token_ids": c.token_ids,
                    }
                ],
            }

        if req.stream:
            return await _sse(chunks, render_delta, _include_usage(req))
        return await _collect(chunks, render_whole)

    return app


def _include_usage(req) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


async def _collect(chunks: AsyncIterator[Chunk], render: Callable, prefix: str = "") -> dict:
    text, ids, last = prefix, [], None
    async for c in chunks:
        text += c.text
        ids += c.token_ids
        last = c
    whole = Chunk(
        text,
        ids,
        last.finish_reason,
        last.prompt_tokens,
        last.completion_tokens,
        last.cached_tokens,
    )
    body = render(whole, text)
    body["usage"] = usage(last.prompt_tokens, len(ids), last.cached_tokens)
    return body


async def _sse(
    chunks: AsyncIterator[Chunk], render: Callable, include_usage: bool, prefix: str = ""
) -> StreamingResponse:
    """Server-sent events; the first chunk is awaited first so early errors get a 4xx."""
    first = await anext(chunks)

    async def events():
        last, sent = first, len(first.token_ids)
        try:
            if prefix:
                yield _event(render(Chunk(prefix, [], None, 0, 0, 0), prefix))
            yield _event(render(first, first.text))
            async for c in chunks:
                last = c
                sent += len(c.token_ids)
                yield _event(render(c, c.text))
            if include_usage:
                body = render(last, "")
                body["choices"] = []
                body["usage"] = usage(last.prompt_tokens, sent, last.cached_tokens)
                yield _event(body)
        except RequestError as exc:
            yield _event(error_body(exc.message, exc.code, exc.status))
        finally:
            await chunks.aclose()
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _describe(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if err.get("type") == "json_invalid":
            return f"malformed JSON body: {err.get('msg')}"
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts[:5])
