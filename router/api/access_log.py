"""One log line per HTTP request, written by one middleware when the response has been
sent (a stream: after its last event), so a request refused before any generation (a
400, 401, 404, 413) leaves its trace as well as one that generated:

    POST /v1/chat/completions 200, latency: 0.412 s, #prompt-token: 52, #cached-token: 48,
    #generated-token: 16    (one line)
    POST /v1/messages 400, latency: 0.002 s, error: messages.1.content: ...

The token counts come from the request's outputs (`count_usage` wraps each choice's
chunks); the error is the message of the error body (OpenAI's and Anthropic's both say
`error.message`)."""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from common.messages import Output

logger = logging.getLogger("router.access")
MAX_ERROR_BODY = 64 * 1024  # error bodies are small; a larger one is not read for its message


@dataclass
class _Usage:
    prompt: int = 0
    cached: int = 0
    generated: int = 0
    counted: bool = False


_usage: contextvars.ContextVar[_Usage | None] = contextvars.ContextVar("usage", default=None)


async def count_usage(chunks: AsyncIterator[Output]) -> AsyncIterator[Output]:
    """`chunks` unchanged; the last one's usage is added to the current request's line."""
    last = None
    try:
        async with contextlib.aclosing(chunks):
            async for c in chunks:
                last = c
                yield c
    finally:
        usage = _usage.get()
        if usage is not None and last is not None:
            usage.counted = True
            usage.prompt += last.prompt_tokens
            usage.cached += last.cached_tokens
            usage.generated += last.completion_tokens


def count_embedded(tokens: int) -> None:
    """An embeddings request's input tokens, on its line (none cached, none generated)."""
    usage = _usage.get()
    if usage is not None:
        usage.counted, usage.prompt = True, usage.prompt + tokens


class AccessLog:
    """Pure ASGI middleware (no per-chunk cost on streams beyond a status check)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status, error_body = time.perf_counter(), [0], bytearray()
        usage = _Usage()
        token = _usage.set(usage)

        async def logged_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body" and status[0] >= 400:
                if len(error_body) < MAX_ERROR_BODY:
                    error_body.extend(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, logged_send)
        except Exception as exc:  # Starlette answers it with a 500 outside this middleware
            status[0], error_body[:] = status[0] or 500, json.dumps({"error": str(exc)}).encode()
            raise
        finally:
            _usage.reset(token)
            line = f"{scope['method']} {scope['path']} {status[0] or '-'}, "
            line += f"latency: {time.perf_counter() - start:.3f} s"
            if usage.counted:
                line += (
                    f", #prompt-token: {usage.prompt}, #cached-token: {usage.cached}, "
                    f"#generated-token: {usage.generated}"
                )
            if status[0] >= 400:  # on one line, whatever the message holds
                line += ", error: " + " ".join(_error_message(bytes(error_body)).split())
            logger.info("%s", line)


def _error_message(body: bytes) -> str:
    try:
        error = json.loads(body)["error"]
        return str(error["message"] if isinstance(error, dict) else error)
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace")[:200] or "(no body)"
