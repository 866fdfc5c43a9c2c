"""How a chat completion's choice renders: OpenAI's message (or streamed deltas) with the
answer's content, `reasoning_content` and `tool_calls` split apart (router.api.chat_output)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from common.messages import Output
from router.api.chat_format import ChatFormat
from router.api.chat_output import OutputSplitter, finish_reason
from router.api.constraints import after_thinking, check_tools, tool_choice, tool_grammar
from router.api.generation import Tokenization


@dataclass
class ChatPrompt:
    """What the chat's rendering decided: the tools whose calls are parsed (None: the
    output is text), and whether the output starts inside a thinking block."""

    fmt: ChatFormat
    tools: list | None
    thinking: bool


def plan_chat(
    tok: Tokenization, messages, tools, choice, template_kwargs, grammar,
    max_tokens: int | None = None, think_budget: int | None = None, encode=None,
) -> tuple[list[int], ChatPrompt, tuple[str, str] | None]:  # fmt: skip
    """(prompt ids, what the rendering decided, the output's grammar) of a chat with
    OpenAI-shaped `messages`, `tools` and tool `choice`; `grammar` is the requested output
    format's (router.api.constraints.output_grammar), which a forced tool call replaces.
    A thought is bounded by `think_budget` tokens (Anthropic's budget_tokens) if given,
    else by half of `max_tokens` (the request's, if it set one, cut to what the context
    leaves), so the answer still fits after it; a budget the cut leaves no room after is
    halved too. `encode(text)`: the rendered text's ids, if not `tok.encode_rendered`'s
    (a continued response's, router.api.responses_continuation)."""
    fmt = tok.chat_format
    tools = check_tools(fmt, tools)
    parse_tools, forced = tool_choice(choice, tools)
    text = tok.render_chat(messages, tools, template_kwargs)
    prompt = ChatPrompt(fmt, tools if parse_tools else None, fmt.starts_thinking(text))
    ids = (encode or tok.encode_rendered)(text)
    if max_tokens:
        max_tokens = tok.fit(len(ids), max_tokens)
        if not think_budget or think_budget >= max_tokens:
            think_budget = max_tokens // 2
    if forced:  # the output is the call: a text format (instructor sends one too) is moot
        grammar = tool_grammar(fmt, tools, forced, prompt.thinking, think_budget)
    elif prompt.thinking:
        grammar = after_thinking(fmt, grammar, think_budget)
    return ids, prompt, grammar


def chat_renderer(
    prompt: ChatPrompt,
    index: int,
    stream: bool,
    body: Callable[[str, dict], dict],
    logprobs_of: Callable[[Output], dict | None],
) -> Callable[[Output, str], dict]:
    """render(chunk, text) -> a response body with this choice; `body(kind, choice)` wraps
    the choice. Streaming, each call renders the increment since the previous one."""
    renderer = ChatRenderer(prompt, index, body, logprobs_of)
    return renderer.delta if stream else renderer.whole


class ChatRenderer:
    """One chat choice's rendering: the whole message, or its streamed deltas, the first
    of which names the role. The splitter holds back what may be a marker's start."""

    def __init__(
        self,
        prompt: ChatPrompt,
        index: int,
        body: Callable[[str, dict], dict],
        logprobs_of: Callable[[Output], dict | None],
    ):
        self.index, self.body, self.logprobs_of = index, body, logprobs_of
        self.splitter = OutputSplitter(prompt.fmt, prompt.tools, prompt.thinking)
        self.role_sent = False  # OpenAI's first delta carries the role, the others not

    def delta(self, c: Output, text: str) -> dict:
        parts = self.splitter.feed(text, final=c.finish_reason is not None)
        delta = {} if self.role_sent else {"role": "assistant"}
        self.role_sent = True
        if parts.content or not (parts.reasoning or parts.tool_deltas):
            delta["content"] = parts.content
        if parts.reasoning:
            delta["reasoning_content"] = parts.reasoning
        if parts.tool_deltas:
            delta["tool_calls"] = [d.openai() for d in parts.tool_deltas]
        choice = {"index": self.index, "delta": delta, "logprobs": self.logprobs_of(c)}
        choice["finish_reason"] = finish_reason(c.finish_reason, self.splitter)
        return self.body("chat.completion.chunk", choice)

    def whole(self, c: Output, text: str) -> dict:
        parts = self.splitter.feed(text, final=True)
        message = {"role": "assistant", "content": parts.content}
        if parts.reasoning:
            message["reasoning_content"] = parts.reasoning
        if parts.tool_calls:
            message["tool_calls"] = [call.openai() for call in parts.tool_calls]
            message["content"] = parts.content if parts.content.strip() else None
        choice = {"index": self.index, "logprobs": self.logprobs_of(c), "message": message}
        choice["finish_reason"] = finish_reason(c.finish_reason, self.splitter)
        choice["token_ids"] = c.token_ids
        return self.body("chat.completion", choice)
