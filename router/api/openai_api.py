"""OpenAI request bodies, their mapping to SamplingParams, and OpenAI's response pieces
(usage, errors, logprobs)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, Field, StrictBool, StrictFloat, StrictInt

from common.byte_level import byte_level_alphabet, is_byte_level
from common.messages import Output, SamplingParams
from router.api.request_body import RequestBody


class StreamOptions(BaseModel):
    include_usage: StrictBool | None = False


class _Common(RequestBody):
    """Fields shared by both endpoints. Types are strict (no "0.5" for a number, no 1 for
    a bool) and `null` means the default, as in OpenAI's API."""

    SAMPLING_NAMES = {"max_new_tokens": "max_tokens"}

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    logit_bias: dict[str, StrictFloat] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool | None = False
    n: StrictInt | None = None
    user: str | None = None
    # the output's format: OpenAI's, or SGLang's regex / ebnf extensions
    response_format: dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None

    def unsupported(self) -> str | None:
        return None

    def logprob_request(self) -> tuple[bool, int]:
        """(return the sampled tokens' logprobs, how many alternatives per token)."""
        return False, 0

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling(
        self, max_new_tokens: int, grammar: tuple[str, str] | None = None
    ) -> SamplingParams:
        """`grammar` is (kind, source), see router.api.constraints."""
        d = SamplingParams()
        kind, source = grammar or ("", "")
        want_logprobs, top_logprobs = self.logprob_request()
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=_or(self.temperature, d.temperature),
            top_p=_or(self.top_p, d.top_p),
            top_k=_or(self.top_k, d.top_k),
            min_p=_or(self.min_p, d.min_p),
            repetition_penalty=_or(self.repetition_penalty, d.repetition_penalty),
            frequency_penalty=_or(self.frequency_penalty, d.frequency_penalty),
            presence_penalty=_or(self.presence_penalty, d.presence_penalty),
            seed=self.seed,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=bool(self.ignore_eos),
            logprobs=want_logprobs,
            top_logprobs=top_logprobs,
            logit_bias=dict(self.logit_bias or {}),
            grammar_kind=kind,
            grammar=source,
        )


def _or(value, default):
    return default if value is None else value


class CompletionRequest(_Common):
    SAMPLING_NAMES = {"max_new_tokens": "max_tokens", "top_logprobs": "logprobs"}

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]] = Field(...)
    echo: StrictBool | None = False
    logprobs: StrictInt | None = None  # how many alternatives; 0 = only the sampled token

    def logprob_request(self) -> tuple[bool, int]:
        return self.logprobs is not None, self.logprobs or 0


class ChatCompletionRequest(_Common):
    messages: list[dict[str, Any]] = Field(..., min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None  # OpenAI's; any but "none" turns thinking on

    def template_kwargs(self) -> dict:
        """chat_template_kwargs, with reasoning_effort as the thinking switch unless they
        set it; neither: no thinking (router.api.chat_format.ChatFormat.template_kwargs)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        return kwargs

    def param_name(self, sampling_field: str) -> str:
        if sampling_field == "max_new_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return super().param_name(sampling_field)

    def unsupported(self) -> str | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs needs logprobs set to true"
        return super().unsupported()

    def logprob_request(self) -> tuple[bool, int]:
        return bool(self.logprobs), self.top_logprobs or 0


class TokenizeRequest(RequestBody):
    """vLLM's /tokenize: a prompt, tokenized as /v1/completions does, or chat messages
    rendered with the chat template as /v1/chat/completions does."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[StrictInt]


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def error_body(message: str, code: str, status: int, param: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": code, "param": param}}


# ---------------------------------------------------------------- logprobs


class TokenPieces:
    """Token id -> (text, UTF-8 bytes) for logprobs, cached. Byte-level BPE tokens map
    back to their exact bytes (half a character has its real bytes and text U+FFFD);
    other tokenizers use the token's decoded text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, tuple[str, list[int]]] = {}
        self.byte_of = byte_level_alphabet() if is_byte_level(tokenizer) else None

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self.cache.get(token_id)
        if hit is None:
            hit = self.cache[token_id] = self._piece(token_id)
        return hit

    def _piece(self, token_id: int) -> tuple[str, list[int]]:
        if self.byte_of is not None:
            symbol = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(symbol, str) and all(ch in self.byte_of for ch in symbol):
                raw = bytes(self.byte_of[ch] for ch in symbol)
                return raw.decode("utf-8", errors="replace"), list(raw)
        text = self.tokenizer.decode([token_id])
        return text, list(text.encode("utf-8"))


def chat_logprobs(token_ids, logprobs, top_logprobs, pieces: TokenPieces) -> dict | None:
    """OpenAI's chat `choices[].logprobs`: {"content": [one entry per token]}."""
    if logprobs is None:
        return None

    def entry(token_id, lp) -> dict:
        text, raw = pieces(token_id)
        return {"token": text, "logprob": lp, "bytes": raw}

    content = []
    for i, (tid, lp) in enumerate(zip(token_ids, logprobs)):
        top = top_logprobs[i] if top_logprobs else []
        content.append(entry(tid, lp) | {"top_logprobs": [entry(t, v) for t, v in top]})
    return {"content": content}


def completion_logprobs(
    token_ids, logprobs, top_logprobs, pieces: TokenPieces, offset: int
) -> dict | None:
    """OpenAI's legacy completions `choices[].logprobs`; `offset` is the text offset of
    the first token (characters of the completion before it)."""
    if logprobs is None:
        return None
    tokens, offsets = [], []
    for tid in token_ids:
        text = pieces(tid)[0]
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    tops = [
        {pieces(t)[0]: v for t, v in (top_logprobs[i] if top_logprobs else [])}
        for i in range(len(token_ids))
    ]
    return {
        "tokens": tokens,
        "token_logprobs": list(logprobs),
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def with_prompt(prompt_ids, prompt_lps: list, completion: dict | None, pieces: TokenPieces) -> dict:
    """Completions logprobs with the prompt's own before the completion's (echo): the first
    prompt token has none (null), as in OpenAI's API; `prompt_lps` is per later prompt
    token [logprob, [[token_id, logprob], ...]]."""
    tokens, offsets, offset = [], [], 0
    for tid in prompt_ids:
        text = pieces(tid)[0]
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    lps = [None] + [lp for lp, _ in prompt_lps]
    tops = [None] + [{pieces(t)[0]: v for t, v in top} for _, top in prompt_lps]
    rest = completion or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    return {
        "tokens": tokens + rest["tokens"],
        "token_logprobs": lps + rest["token_logprobs"],
        "top_logprobs": tops + rest["top_logprobs"],
        "text_offset": offsets + rest["text_offset"],
    }


async def prompt_only(chunks: AsyncIterator[Output]) -> AsyncIterator[Output]:
    """max_tokens 0: the prompt alone (its logprobs, usage), not the one token generated."""
    async with contextlib.aclosing(chunks):
        async for c in chunks:
            empty = None if c.logprobs is None else []
            yield Output("", [], "length", c.prompt_tokens, 0, c.cached_tokens, empty,
                         empty, c.prompt_logprobs)  # fmt: skip
            return
