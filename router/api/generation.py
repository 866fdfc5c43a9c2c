"""From a prepared request to text chunks: detokenization, stop strings, usage.

Shared by the HTTP API and the SDK front door so both behave the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

from common.image_keys import stray_pads
from common.messages import InvalidParam, Output, SamplingParams
from router.api.chat_format import ChatFormat, template_messages
from router.api.detokenizer import IncrementalDetokenizer
from router.api.generic_tools import generic_chat
from router.replicas.manager import RouterManager
from router.request_error import RequestError

# OpenAI's chat roles ("function": its deprecated tool role); any other is a client's bug
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class Tokenization:
    """Text and chat prompts to token ids, with the limits checked before anything is sent."""

    def __init__(self, tokenizer, manager: RouterManager, clamp: bool = False):
        """`clamp`: a max_tokens beyond what the context leaves is cut to fit (the HTTP
        API's default, as agents ask for more than small models hold: Claude Code sends
        32000); else it is a 400 (--strict-max-tokens, and the SDK)."""
        self.tokenizer = tokenizer
        self.manager = manager
        self.clamp = clamp
        self.chat_format = ChatFormat.of(tokenizer)
        # a vision model's: what its processor does to a rendered prompt before tokenizing
        # (Gemma 3's image marker becomes its whole image text; common/vision_layout.py)
        self.expand_text: Callable[[str], str] | None = None

    def encode_text(self, text: str) -> list[int]:
        """A text prompt as mlx_lm.server encodes it: with the special tokens the tokenizer
        itself adds (the BOS of a Llama 3 or Gemma tokenizer's post-processor)."""
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict], tools=None, template_kwargs=None) -> list[int]:
        return self.encode_rendered(self.render_chat(messages, tools, template_kwargs))

    def encode_rendered(self, prompt: str) -> list[int]:
        """A chat prompt from `render_chat` as token ids. The template writes the BOS itself,
        so the tokenizer adds no second one (apply_chat_template(tokenize=True), which
        mlx_lm.server calls, encodes so too)."""
        if self.expand_text is not None:
            prompt = self.expand_text(prompt)
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def render_chat(
        self, messages: list[dict], tools=None, template_kwargs=None, generation_prompt=True
    ) -> str:
        """The chat as prompt text: its template, given the tools and the template's
        arguments (`chat_template_kwargs`, thinking on by default where the model thinks);
        without the `generation_prompt`, the chat as history."""
        kwargs = self.chat_format.template_kwargs(template_kwargs)
        chat = template_messages(text_messages(messages))
        if not self.chat_format.generic_tools:
            return self._render(chat, tools, kwargs, generation_prompt)
        # the template knows no tools: they are written into the chat, in a system message
        # or, for a template that refuses one (Gemma 2's, Mistral v0.1's), the first turn
        try:
            return self._render(generic_chat(chat, tools), None, kwargs, generation_prompt)
        except RequestError:
            if not tools:
                raise
            chat = generic_chat(chat, tools, in_system=False)
            return self._render(chat, None, kwargs, generation_prompt)

    def _render(self, chat: list[dict], tools, kwargs: dict, generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                chat,
                tools=tools,
                tokenize=False,
                add_generation_prompt=generation_prompt,
                **kwargs,
            )
        except Exception as exc:  # jinja raises many kinds
            raise RequestError(f"cannot render the chat template: {exc}") from None

    def check_ids(
        self, input_ids: list[int], sampling: SamplingParams, invalid=None
    ) -> SamplingParams:
        """The sampling parameters to run the prompt with: checked, max_new_tokens cut to
        the room the context leaves (`fit`). `invalid(InvalidParam)`: the RequestError for
        a sampling parameter out of range, in the request's own words (default:
        SamplingParams' names, the SDK's)."""
        vocab = len(self.tokenizer)
        if not input_ids:
            raise RequestError("the prompt is empty")
        if min(input_ids) < 0 or max(input_ids) >= vocab:
            images = getattr(input_ids, "images", ())  # pad values are inside image runs
            if min(input_ids) < 0 or stray_pads(input_ids, 0, images, vocab):
                raise RequestError(f"prompt token ids must be in [0, {vocab})")
        try:
            sampling.validate(vocab)
        except InvalidParam as exc:
            if invalid is not None:
                raise invalid(exc) from None
            raise RequestError(str(exc), param=exc.field) from None
        fitted = self.fit(len(input_ids), sampling.max_new_tokens)
        if fitted == sampling.max_new_tokens:
            return sampling
        return dataclasses.replace(sampling, max_new_tokens=fitted)

    def fit(self, prompt_tokens: int, max_new: int | None) -> int:
        """The most tokens a completion of a `prompt_tokens` prompt may have, asked for
        `max_new` (None: as many as fit): the context (`RouterManager.max_model_len`)
        minus the prompt, when that is less and `clamp` is on; a request ending there
        finishes with `length`, as at any max_tokens. A prompt that leaves no room for one
        token is refused, and so is a larger max_new without `clamp`."""
        limit = self.manager.max_model_len
        if not limit:  # no replica ready: nothing to fit to (the request waits for one)
            return max_new or 1
        room = limit - prompt_tokens
        if room >= 1 and (max_new is None or max_new <= room or self.clamp):
            return room if max_new is None else min(max_new, room)
        asked = max_new or 1
        raise RequestError(
            f"This model's maximum context length is {limit} tokens. However, you "
            f"requested {prompt_tokens + asked} tokens "
            f"({prompt_tokens} in the prompt, {asked} for the completion).",
            "context_length_exceeded",
        )


def text_messages(messages: list) -> list[dict]:
    """Chat messages with each content as one string, which is what chat templates expect:
    OpenAI's list of text parts is joined (as mlx-lm's server does) and a missing content
    (an assistant turn that only called tools) is empty. Other parts are refused by name."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(
                f"messages[{i}] must be an object with a string 'role'", param=f"messages[{i}]"
            )
        if message["role"] not in CHAT_ROLES:
            raise RequestError(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                f"not {message['role']!r}",
                param=f"messages[{i}].role",
            )
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(
                _text_part(part, f"messages[{i}].content[{j}]") for j, part in enumerate(content)
            )
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise RequestError(
                f"messages[{i}].content must be a string or a list of text parts",
                param=f"messages[{i}].content",
            )
        out.append({**message, "content": content})
    return out


def _text_part(part: Any, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    if kind != "text":
        raise RequestError(
            f"{where}: only text content parts are supported, not {kind!r}", param=where
        )
    if not isinstance(part.get("text"), str):
        raise RequestError(f"{where}: a text part needs a string 'text'", param=where)
    return part["text"]


async def generate_text(
    manager: RouterManager,
    tokenizer,
    input_ids: list[int],
    sampling: SamplingParams,
    stop: list[str] | None = None,
    rid: str | None = None,
    cache_salt: str = "",
    priority_len: int = 0,
    route_key: str | None = None,
    lora: int = 0,
) -> AsyncIterator[Output]:
    """Stream chunks (an Output each: new text and token ids, usage so far); a stop string
    ends the request early (and aborts it upstream). `cache_salt`, `priority_len` and
    `lora`: see common.messages.GenerateReq; `route_key`: RouterManager.generate."""
    detok = IncrementalDetokenizer(tokenizer)
    matcher = StopMatcher(stop or [])
    outs = manager.generate(input_ids, sampling, rid, cache_salt, priority_len, route_key, lora)
    async with contextlib.aclosing(outs):
        async for chunk in outs:
            for out in _per_token(chunk) if matcher.stops else [chunk]:
                text, finish, hit = _text_of(out, detok, matcher)
                yield Output(
                    text,
                    out.token_ids,
                    finish,
                    out.prompt_tokens,
                    out.completion_tokens,
                    out.cached_tokens,
                    out.logprobs,
                    out.top_logprobs,
                    out.prompt_logprobs,
                )
                if hit:
                    return  # leaving the generator aborts the request


def _text_of(out, detok: IncrementalDetokenizer, matcher: StopMatcher) -> tuple[str, str, bool]:
    """(new text, finish reason, whether a stop string ended it) of one output."""
    text = detok.add(out.token_ids)
    finish = out.finish_reason
    if finish is not None:
        text += detok.flush()
    text, hit = matcher.feed(text, final=finish is not None)
    return text, "stop" if hit else finish, hit


def _per_token(chunk) -> list:
    """A chunk of several tokens (speculative decoding accepts runs of them) as one output
    per token, so a stop string ends the output at the token that completes it, with the
    usage counted to there, as when tokens come one by one."""
    n = len(chunk.token_ids)
    if n <= 1:
        return [chunk]
    with_lp = chunk.logprobs is not None and len(chunk.logprobs) == n
    return [
        dataclasses.replace(
            chunk,
            token_ids=[tok],
            finish_reason=chunk.finish_reason if j == n - 1 else None,
            completion_tokens=chunk.completion_tokens - (n - 1 - j),
            logprobs=chunk.logprobs[j : j + 1] if with_lp else None,
            top_logprobs=chunk.top_logprobs[j : j + 1] if with_lp else None,
            prompt_logprobs=chunk.prompt_logprobs if j == 0 else None,
        )
        for j, tok in enumerate(chunk.token_ids)
    ]


class StopMatcher:
    """Finds stop strings in streamed text, holding back what might start one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buffer = ""

    def feed(self, text: str, final: bool) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        self.buffer += text
        cut = min((i for i in (self.buffer.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.buffer = self.buffer[:cut], ""
            return out, True
        if final:
            out, self.buffer = self.buffer, ""
            return out, False
        keep = self.hold
        out = self.buffer[: len(self.buffer) - keep] if keep else self.buffer
        self.buffer = self.buffer[len(out) :]
        return out, False
