"""The Anthropic Messages API: `POST /v1/messages` (a message body, or Anthropic's stream
of events) and `POST /v1/messages/count_tokens`, over the same chat rendering, grammars,
output splitting (thinking, text, tool_use blocks) and generation as the OpenAI API.

`usage.cache_read_input_tokens` is the radix cache's hit; `input_tokens` are the prompt
tokens it did not cover (Anthropic counts them apart), so the two add up to the prompt.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from common.messages import Output, SamplingParams
from router.api.anthropic_api import CountTokensRequest, MessagesRequest, anthropic_error_body
from router.api.api_context import ApiContext
from router.api.cache_control import marked_prefix_len
from router.api.chat_output import OutputSplitter, Parts, ToolCall
from router.api.chat_response import ChatPrompt, plan_chat
from router.api.constraints import output_grammar
from router.api.response_assembly import aclose_shielded, first_chunk, whole
from router.api.thinking_signature import ThinkingSigner
from router.request_error import RequestError

_STOP_REASONS = {"length": "max_tokens", "abort": "end_turn"}
ANTHROPIC_MAX_TEMPERATURE = 1.0  # Anthropic's range is [0, 1], OpenAI's [0, 2]


class AnthropicRoutes:
    """The endpoints, over the tokenization, checks and generation every API shares."""

    def __init__(self, models):
        self.models = models  # router.api.served_models: each request's model's ApiContext
        self.signer = ThinkingSigner()

    async def _plan(self, api: ApiContext, req: CountTokensRequest, grammar=None):
        messages, images = await api.take_images(req.openai_messages(self.signer))
        ids, prompt, grammar = plan_chat(
            api.tok, messages, req.openai_tools(),
            req.openai_tool_choice(), req.template_kwargs(), grammar,
            getattr(req, "max_tokens", None),  # count_tokens has none
            req.think_budget(),
        )  # fmt: skip
        return api.with_images(ids, images), prompt, grammar

    async def count_tokens(self, req: CountTokensRequest):
        api = await self.models.context(req.model)
        ids, _, _ = await self._plan(api, req)
        return {"input_tokens": len(ids)}

    async def messages(self, req: MessagesRequest, request: Request):
        api = await self.models.context(req.model)
        grammar = output_grammar(req.response_format(), req.regex, req.ebnf)
        ids, prompt, grammar = await self._plan(api, req, grammar)
        d = SamplingParams()
        kind, source = grammar or ("", "")
        sampling = SamplingParams(
            max_new_tokens=req.max_tokens,
            temperature=d.temperature if req.temperature is None else req.temperature,
            top_p=d.top_p if req.top_p is None else req.top_p,
            top_k=d.top_k if req.top_k is None else req.top_k,
            grammar_kind=kind,
            grammar=source,
        )
        if sampling.temperature > ANTHROPIC_MAX_TEMPERATURE:  # NaN: SamplingParams says so
            raise RequestError(
                f"temperature: range: 0 <= temperature <= {ANTHROPIC_MAX_TEMPERATURE:g}",
                param="temperature",
            )
        rid = f"msg_{uuid.uuid4().hex[:24]}"
        priority = marked_prefix_len(api.tok, req, ids)  # cache_control breakpoints
        chunks = api.start(req, ids, sampling, rid, priority)
        message = _Message(rid, api.model_name, prompt, req.stop_strings(), api.tokenizer)
        if not req.stream:
            return message.body(await whole(request, chunks), self.signer)
        first = await first_chunk(request, chunks)
        return StreamingResponse(
            _events(message, first, chunks, _Blocks(self.signer)), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )  # fmt: skip


class _Message:
    """One answer: its blocks, stop reason and usage, as a body or as stream events."""

    def __init__(self, rid: str, model: str, prompt: ChatPrompt, stops: list[str], tokenizer):
        self.rid, self.model, self.stops = rid, model, stops
        self.splitter = OutputSplitter(prompt.fmt, prompt.tools, prompt.thinking)
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []

    def usage(self, out: Output, output_tokens: int) -> dict:
        return {
            "input_tokens": out.prompt_tokens - out.cached_tokens,
            "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": out.cached_tokens,
        }

    def stop(self, finish: str | None) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of a finished answer."""
        if finish == "stop" and self.splitter.calls:
            return "tool_use", None
        if finish == "stop" and self.stops:
            # the stop string was cut from the text; the tokens still spell it
            text = self.tokenizer.decode(self.token_ids)
            hits = [(text.find(s), s) for s in self.stops if s in text]
            if hits:
                return "stop_sequence", min(hits)[1]
        return _STOP_REASONS.get(finish, "end_turn"), None

    def head(self, out: Output, output_tokens: int, content: list) -> dict:
        return {
            "id": self.rid, "type": "message", "role": "assistant", "model": self.model,
            "content": content, "stop_reason": None, "stop_sequence": None,
            "usage": self.usage(out, output_tokens),
        }  # fmt: skip

    def body(self, out: Output, signer: ThinkingSigner) -> dict:
        self.token_ids = out.token_ids
        parts = self.splitter.feed(out.text, final=True)
        blocks = []
        if parts.reasoning:
            thought = parts.reasoning
            blocks.append(
                {"type": "thinking", "thinking": thought, "signature": signer.sign(thought)}
            )
        if parts.content.strip() or not (parts.reasoning or parts.tool_calls):
            blocks.append({"type": "text", "text": parts.content})
        blocks += [_tool_use(call) for call in parts.tool_calls]
        body = self.head(out, out.completion_tokens, blocks)
        body["stop_reason"], body["stop_sequence"] = self.stop(out.finish_reason)
        return body


def _tool_use(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": _input(call)}


def _input(call: ToolCall) -> dict:
    try:
        value = json.loads(call.arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {"value": value}


class _Blocks:
    """The stream's content blocks: which is open, and the events that open, fill and
    close them. Whitespace between blocks (after thinking, before a tool call) opens none.
    A tool call's arguments stream as `input_json_delta`s as they are written (where the
    format allows: router.api.tool_stream); a thinking block ends with its `signature_delta`."""

    def __init__(self, signer: ThinkingSigner):
        self.index, self.kind, self.space = -1, None, ""
        self.signer, self.thought = signer, ""

    def events(self, parts: Parts) -> list[tuple[str, dict]]:
        out = []
        if parts.reasoning:
            out += self.open("thinking", {"thinking": "", "signature": ""})
            self.thought += parts.reasoning
            out.append(self._delta({"type": "thinking_delta", "thinking": parts.reasoning}))
        text = parts.content
        if text and self.kind != "text" and not text.strip():
            self.space += text
            text = ""
        if text:
            out += self.open("text", {"text": ""})
            text, self.space = self.space + text, ""
            out.append(self._delta({"type": "text_delta", "text": text}))
        for piece in parts.tool_deltas:
            if piece.name is not None:
                block = {"id": piece.id, "name": piece.name, "input": {}}
                out += self.open("tool_use", block, True)
            if piece.arguments:
                delta = {"type": "input_json_delta", "partial_json": piece.arguments}
                out.append(self._delta(delta))
        return out

    def open(self, kind: str, block: dict, always: bool = False) -> list:
        if self.kind == kind and not always:
            return []
        out = self.close()
        self.index, self.kind = self.index + 1, kind
        start = {"type": "content_block_start", "index": self.index}
        return out + [("content_block_start", start | {"content_block": {"type": kind, **block}})]

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {
            "type": "content_block_delta",
            "index": self.index,
            "delta": delta,
        }

    def close(self) -> list:
        if self.kind is None:
            return []
        out = []
        if self.kind == "thinking":
            signature = self.signer.sign(self.thought)
            out.append(self._delta({"type": "signature_delta", "signature": signature}))
            self.thought = ""
        self.kind = None
        return out + [("content_block_stop", {"type": "content_block_stop", "index": self.index})]


async def _events(message: _Message, first: Output, chunks: AsyncIterator[Output], blocks):
    """Anthropic's event sequence: message_start, ping, the blocks, message_delta (stop
    reason, usage), message_stop; a failure midway is an `error` event."""
    count, last = 0, first
    start = {"type": "message_start", "message": message.head(first, 0, [])}
    yield _sse("message_start", start)
    yield _sse("ping", {"type": "ping"})
    try:
        c = first
        while True:
            count += len(c.token_ids)
            message.token_ids += c.token_ids
            last = c
            parts = message.splitter.feed(c.text, final=c.finish_reason is not None)
            for name, event in blocks.events(parts):
                yield _sse(name, event)
            if c.finish_reason is not None:
                break
            c = await anext(chunks)
        if blocks.index < 0:  # an empty answer still has its (empty) text block
            for name, event in blocks.open("text", {"text": ""}):
                yield _sse(name, event)
        for name, event in blocks.close():
            yield _sse(name, event)
        reason, sequence = message.stop(last.finish_reason)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        yield _sse("message_delta", {"type": "message_delta", "delta": delta,
                                     "usage": message.usage(last, count)})  # fmt: skip
        yield _sse("message_stop", {"type": "message_stop"})
    except RequestError as exc:
        yield _sse("error", anthropic_error_body(exc.message, exc.status))
    finally:
        await aclose_shielded(chunks)


def _sse(name: str, body: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"
