"""How `benchmarks.serving` talks to a backend: the OpenAI HTTP API with SSE, or
radix-mlx's ZMQ SDK. Both fill the same RequestResult from what the client sees."""

from __future__ import annotations

import json

import aiohttp

from benchmarks.records import Prompt, RequestResult
from benchmarks.workloads import Clock


class HttpSender:
    """POST /v1/completions with SSE; text prompts for servers that only take text.
    Greedy unless `sampling` gives other body fields (`{"temperature": 1.0}`).

    aiohttp, as SGLang's bench_serving: on a 2-core machine the load generator's CPU is
    taken from the server under test, and httpx's streaming took 1.5x aiohttp's CPU per
    event (docs/performance.md, issue 32)."""

    def __init__(
        self, url: str, text_prompts: bool, connections: int, sampling: dict | None = None
    ):
        self.url = url
        self.connections = connections
        self._session: aiohttp.ClientSession | None = None
        self.text_prompts = text_prompts
        self.sampling = sampling or {}

    @property
    def client(self) -> aiohttp.ClientSession:
        # made on first use: a session belongs to the running loop
        if self._session is None:
            self._session = aiohttp.ClientSession(
                base_url=self.url,
                connector=aiohttp.TCPConnector(limit=self.connections),
                timeout=aiohttp.ClientTimeout(total=1800, connect=30),
                read_bufsize=1 << 20,
            )
        return self._session

    async def send(self, prompt: Prompt, out_len: int, res: RequestResult, clock: Clock) -> None:
        body = {
            "prompt": prompt.text if self.text_prompts else prompt.ids,
            "max_tokens": out_len,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.sampling,
        }
        async with self.client.post("/v1/completions", json=body) as resp:
            if resp.status != 200:
                text = (await resp.read()).decode(errors="replace")
                res.error = f"HTTP {resp.status}: {text[:300]}"
                return
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue  # blank separators and mlx_lm.server's ": keepalive" comments
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                self._event(json.loads(data), res, clock)
        res.error = res.error or "stream ended without [DONE]"

    @staticmethod
    def _event(ev: dict, res: RequestResult, clock: Clock) -> None:
        if "error" in ev:
            res.error = str(ev["error"])[:300]
        for choice in ev.get("choices") or []:
            ids = choice.get("token_ids")
            text = choice.get("text") or ""
            res.output_text += text
            if ids is not None:
                res.output_ids += ids
                res.streamed_tokens = (res.streamed_tokens or 0) + len(ids)
            n = len(ids) if ids is not None else int(bool(text))  # text-only: 1 per chunk
            if n:
                clock.tokens(res, n)
        if ev.get("usage"):
            _usage(
                res,
                ev["usage"]["prompt_tokens"],
                ev["usage"]["completion_tokens"],
                (ev["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class SdkSender:
    """radix-mlx's ZMQ SDK: token ids in, token ids out, one shared connection."""

    def __init__(self, address: str):
        from router.client import AsyncClient

        self.client = AsyncClient(address, timeout=1800)

    async def send(self, prompt: Prompt, out_len: int, res: RequestResult, clock: Clock) -> None:
        usage = None
        async for chunk in self.client.stream(
            input_ids=prompt.ids, max_new_tokens=out_len, temperature=0, ignore_eos=True
        ):
            if chunk.token_ids:
                clock.tokens(res, len(chunk.token_ids))
                res.output_ids += chunk.token_ids
                res.streamed_tokens = (res.streamed_tokens or 0) + len(chunk.token_ids)
            res.output_text += chunk.text
            usage = chunk.usage
        if usage is not None:
            _usage(res, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)

    async def close(self) -> None:
        await self.client.close()


def _usage(res: RequestResult, prompt: int, completion: int, cached: int | None) -> None:
    res.reported_prompt_len, res.output_len, res.cached_tokens = prompt, completion, cached or 0
