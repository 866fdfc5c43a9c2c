"""The OpenAI Responses API: `POST /v1/responses` (a Response, or its stream of events),
`GET` and `DELETE /v1/responses/{id}` and `GET /v1/responses/{id}/input_items`, over the
chat route's rendering, tool parsing, grammars and generation (router.api.chat_response).

A response is stored (unless `store: false`) so that a later request can continue it with
`previous_response_id`: its conversation and answer come first, as the radix cache holds
them (router.api.responses_continuation). `prompt_cache_key` keeps requests with the same
key on the same replica.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse

from common.messages import Output
from router.api.api_context import ApiContext
from router.api.chat_response import ChatPrompt, plan_chat
from router.api.constraints import output_grammar
from router.api.response_assembly import aclose_shielded, first_chunk, whole
from router.api.response_store import ResponseStore, StoredResponse
from router.api.responses_continuation import Continuation
from router.api.responses_request import (
    ReasoningSeal,
    ResponsesRequest,
    chat_tool_choice,
    chat_tools,
    input_messages,
)
from router.api.responses_stream import ResponseBuilder, new_id
from router.api.thinking_signature import ThinkingSigner
from router.request_error import RequestError


@dataclass
class _Turn:
    """What planning one request decided: the prompt and how its output is read, and the
    chat it renders (for the store)."""

    ids: list[int]
    prompt: ChatPrompt
    grammar: tuple[str, str] | None
    messages: list[dict]
    rendered: str


class ResponsesRoutes:
    """The endpoints, over the OpenAI routes' tokenization, checks and generation."""

    def __init__(self, models, store_size: int):
        self.models = models  # router.api.served_models: each request's model's ApiContext
        self.store = ResponseStore(store_size)
        self.seal = ReasoningSeal(ThinkingSigner())

    async def create(self, req: ResponsesRequest, request: Request):
        api = await self.models.context(req.model)
        problem = req.unsupported()
        if problem:
            raise RequestError(problem, "unsupported_parameter")
        functions = req.function_tools()
        turn = await self._plan(api, req, chat_tools(functions))
        max_new = api.tok.fit(len(turn.ids), req.max_output_tokens)
        sampling = req.sampling(max_new, turn.grammar)
        rid = new_id("resp")
        chunks = api.start(req, turn.ids, sampling, rid, route_key=req.prompt_cache_key)
        seal = self.seal if req.wants_encrypted_reasoning else None
        head = self._head(api, req, rid, functions, sampling)
        builder = ResponseBuilder(head, turn.prompt, seal, req.parallel_tool_calls is not False)

        def finished(last: Output) -> None:
            if req.store:
                self._remember(req, turn, builder, last)

        if not req.stream:
            last = await whole(request, _fed(builder, chunks))
            builder.finish(last)
            finished(last)
            return builder.response
        first = await first_chunk(request, chunks)
        return StreamingResponse(
            _events(builder, first, chunks, finished), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )  # fmt: skip

    async def _plan(
        self, api: ApiContext, req: ResponsesRequest, tools: list[dict] | None
    ) -> _Turn:
        tok = api.tok
        prev = None
        if req.previous_response_id is not None:
            prev = self.store.get(req.previous_response_id, "previous_response_id")
        history = [*prev.messages, prev.answer] if prev else []
        messages = history + input_messages(req.input, tok.chat_format, self.seal)
        if not messages:
            raise RequestError("input must hold at least one item", param="input")
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        kwargs = req.template_kwargs()
        grammar = output_grammar(req.response_format(), req.regex, req.ebnf)
        # input_image parts, as chat's image_url parts: read, preprocessed, their runs
        # written as pad values (router.api.image_inputs). A conversation with images is
        # rendered whole each turn, as the chat route does (its runs are the same pad
        # values, so the cache still holds them): the previous ids know no image parts.
        chat, images = await api.take_images(copy.deepcopy(system + messages))
        continuation = None
        if prev is not None and not images:
            continuation = Continuation(tok, prev, system, tools, kwargs)
        rendered = []

        def encode(text: str) -> list[int]:
            rendered.append(text)
            return continuation.encode(text) if continuation else tok.encode_rendered(text)

        ids, prompt, grammar = plan_chat(
            tok, chat, tools, chat_tool_choice(req.tool_choice), kwargs, grammar,
            req.max_output_tokens, encode=encode,
        )  # fmt: skip
        return _Turn(api.with_images(ids, images), prompt, grammar, messages, rendered[0])

    def _head(self, api: ApiContext, req: ResponsesRequest, rid: str, functions: list[dict],
              sampling) -> dict:  # fmt: skip
        """The Response's fields that do not depend on its output."""
        tools = [
            {"type": "function", "name": t["name"], "description": t.get("description"),
             "parameters": t.get("parameters"), "strict": t.get("strict")}
            for t in functions
        ]  # fmt: skip
        reasoning = req.reasoning or {}
        return {
            "id": rid, "object": "response", "model": api.model_name, "error": None,
            "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "store": bool(req.store), "temperature": sampling.temperature,
            "top_p": sampling.top_p, "text": {"format": (req.text or {}).get("format")
                                               or {"type": "text"}},
            "tool_choice": req.tool_choice or "auto", "tools": tools,
            "truncation": req.truncation or "disabled", "usage": None, "user": req.user,
            "prompt_cache_key": req.prompt_cache_key,
        }  # fmt: skip

    def _remember(self, req: ResponsesRequest, turn: _Turn, builder: ResponseBuilder,
                  last: Output) -> None:  # fmt: skip
        """Store the response with what continuing it needs (router.api.response_store)."""
        output_ids = builder.token_ids
        if last.finish_reason == "stop" and output_ids:
            output_ids = output_ids[:-1]  # the stop token: the template ends the turn itself
        items = req.input or []
        if isinstance(req.input, str):
            text = {"type": "input_text", "text": req.input}
            items = [{"type": "message", "role": "user", "content": [text]}]
        stored = StoredResponse(
            builder.response, items, turn.messages, answer_message(builder.output),
            turn.rendered, turn.ids + output_ids,
        )  # fmt: skip
        self.store.put(builder.response["id"], stored)

    async def retrieve(self, response_id: str):
        return self.store.get(response_id).body

    async def delete(self, response_id: str):
        self.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def input_items(self, response_id: str):
        items = self.store.get(response_id).input_items
        data = [{"id": item.get("id") or new_id("item"), **item} for item in items]
        first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
        return {"object": "list", "data": data, "first_id": first, "last_id": last,
                "has_more": False}  # fmt: skip


def answer_message(output: list[dict]) -> dict:
    """A response's output as the assistant's chat turn: its text and function calls. Its
    thought is left out, as templates leave out earlier turns' thoughts (the model's own
    tokens for it are what a continuation extends)."""
    text = "".join(
        part["text"] for item in output if item["type"] == "message" for part in item["content"]
    )
    turn = {"role": "assistant", "content": text}
    calls = [
        {"id": item["call_id"], "type": "function",
         "function": {"name": item["name"], "arguments": item["arguments"] or "{}"}}
        for item in output if item["type"] == "function_call"
    ]  # fmt: skip
    if calls:
        turn["tool_calls"] = calls
    return turn


async def _fed(builder: ResponseBuilder, chunks: AsyncIterator[Output]):
    """The chunks, each fed to the builder as it passes (its events are not sent)."""
    async with contextlib.aclosing(chunks):
        async for c in chunks:
            builder.feed(c)
            yield c


async def _events(builder: ResponseBuilder, first: Output, chunks: AsyncIterator[Output],
                  finished) -> AsyncIterator[str]:  # fmt: skip
    """OpenAI's event sequence: created, in_progress, the items' events, then completed
    (or incomplete); a failure midway is an `error` event and `response.failed`."""
    try:
        for event in builder.start():
            yield _sse(event)
        c = first
        while True:
            for event in builder.feed(c):
                yield _sse(event)
            if c.finish_reason is not None:
                break
            c = await anext(chunks)
        for event in builder.finish(c):
            yield _sse(event)
        finished(c)
    except RequestError as exc:
        for event in builder.fail(exc.message, exc.code):
            yield _sse(event)
    finally:
        await aclose_shielded(chunks)


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
