"""OpenAI request bodies and their mapping to SamplingParams."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from common.messages import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: StrictInt = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: StrictInt = 1
    user: str | None = None

    def unsupported(self) -> str | None:
        if self.n != 1:
            return "n other than 1 is not supported yet"
        return None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling(self, max_new_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            seed=self.seed,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_Common):
    prompt: str | list[StrictInt] | list[str] = Field(...)
    echo: bool = False
    logprobs: StrictInt | None = None


class ChatCompletionRequest(_Common):
    messages: list[dict[str, Any]] = Field(..., min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: bool = False
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools are not supported yet"
        if self.response_format and self.response_format.get("type") != "text":
            return "response_format is not supported yet"
        return super().unsupported()


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def error_body(message: str, code: str, status: int) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": code, "param": None}}
