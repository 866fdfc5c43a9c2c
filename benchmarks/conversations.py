"""Conversation senders for `benchmarks.serving`: each session's turns as a chat that
grows, sent as text through the OpenAI chat API (`radix-mlx-chat`: the whole history every
turn, the answer's text re-tokenized by the template, as a chat client sends it) or the
Responses API (`radix-mlx-responses`: only the new turn, continuing the previous response
by `previous_response_id`). A turn's prompt length and cached tokens are the server's
usage; TTFT is the time to the first text delta, for both."""

from __future__ import annotations

import json

import httpx

from benchmarks.records import Prompt, RequestResult
from benchmarks.sse import aiter_sse_data
from benchmarks.workloads import Clock


class _Sender:
    def __init__(self, url: str, connections: int):
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        timeout = httpx.Timeout(1800, connect=30)
        self.client = httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout)

    async def send(self, prompt: Prompt, out_len: int, res: RequestResult, clock: Clock) -> None:
        """A request on its own: the first turn of a fresh conversation."""
        await self.conversation().send(prompt, out_len, res, clock)

    async def _stream(self, path: str, body: dict, res: RequestResult, on_event) -> None:
        async with self.client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {text[:300]}"
                return
            async for data in aiter_sse_data(resp):
                if data.strip() == "[DONE]":
                    return
                on_event(json.loads(data))

    async def close(self) -> None:
        await self.client.aclose()


def _usage(res: RequestResult, prompt: int, output: int, cached: int) -> None:
    res.prompt_len = res.reported_prompt_len = prompt  # the template's: known only here
    res.output_len, res.cached_tokens = output, cached


class ChatSender(_Sender):
    def conversation(self) -> ChatConversation:
        return ChatConversation(self)


class ChatConversation:
    def __init__(self, sender: ChatSender):
        self.sender, self.messages = sender, []

    async def send(self, prompt: Prompt, out_len: int, res: RequestResult, clock: Clock) -> None:
        self.messages.append({"role": "user", "content": prompt.text})
        body = {"messages": self.messages, "max_tokens": out_len, "temperature": 0,
                "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        answer = []

        def on_event(ev: dict) -> None:
            if "error" in ev:
                res.error = str(ev["error"])[:300]
            for choice in ev.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") or ""
                if text:
                    answer.append(text)
                    clock.tokens(res, 1)
            if ev.get("usage"):
                u = ev["usage"]
                cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                _usage(res, u["prompt_tokens"], u["completion_tokens"], cached)

        await self.sender._stream("/v1/chat/completions", body, res, on_event)
        res.output_text = "".join(answer)
        self.messages.append({"role": "assistant", "content": res.output_text})


class ResponsesSender(_Sender):
    def conversation(self) -> ResponsesConversation:
        return ResponsesConversation(self)


class ResponsesConversation:
    def __init__(self, sender: ResponsesSender):
        self.sender, self.previous = sender, None

    async def send(self, prompt: Prompt, out_len: int, res: RequestResult, clock: Clock) -> None:
        body = {"input": prompt.text, "max_output_tokens": out_len, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        if self.previous is not None:
            body["previous_response_id"] = self.previous
        answer = []

        def on_event(ev: dict) -> None:
            kind = ev.get("type")
            if kind == "response.output_text.delta" and ev["delta"]:
                answer.append(ev["delta"])
                clock.tokens(res, 1)
            elif kind in ("response.completed", "response.incomplete"):
                response, u = ev["response"], ev["response"]["usage"]
                self.previous = response["id"]
                cached = u["input_tokens_details"]["cached_tokens"]
                _usage(res, u["input_tokens"], u["output_tokens"], cached)
            elif kind in ("error", "response.failed"):
                res.error = json.dumps(ev)[:300]

        await self.sender._stream("/v1/responses", body, res, on_event)
        res.output_text = "".join(answer)
