"""Anthropic Messages API request bodies, their translation into the chat the template
renders (OpenAI-shaped messages, tools and tool choice, as router.api.constraints takes
them), and Anthropic's error body."""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field, StrictBool, StrictFloat, StrictInt

from router.api.request_body import RequestBody
from router.api.thinking_signature import ThinkingSigner
from router.request_error import RequestError

# HTTP status -> Anthropic's error type
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(message: str, status: int) -> dict:
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class CountTokensRequest(RequestBody):
    """The prompt of a Messages request: what count_tokens counts."""

    model: str | None = None
    messages: list[dict[str, Any]] = Field(..., min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None

    def openai_messages(self, signer: ThinkingSigner | None = None) -> list[dict]:
        """The messages as OpenAI's; `signer` checks the history's thinking blocks."""
        out = [{"role": "system", "content": system_text(self.system)}] if self.system else []
        for i, message in enumerate(self.messages):
            out += _message(i, message, signer)
        return out

    def openai_tools(self) -> list[dict] | None:
        if not self.tools:
            return None
        tools = []
        for i, tool in enumerate(self.tools):
            if not isinstance(tool.get("name"), str):
                raise RequestError(f"tools.{i}.name: a tool needs a string name")
            function = {"name": tool["name"], "parameters": tool.get("input_schema") or {}}
            if tool.get("description"):
                function["description"] = tool["description"]
            tools.append({"type": "function", "function": function})
        return tools

    def openai_tool_choice(self):
        """Anthropic's tool_choice as OpenAI's (router.api.constraints.tool_choice)."""
        choice = self.tool_choice or {"type": "auto"}
        kind = choice.get("type")
        if kind in ("auto", "none"):
            return kind
        if kind == "any":
            return "required"
        if kind == "tool" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        raise RequestError("tool_choice.type must be auto, any, tool (with a name) or none")

    def template_kwargs(self) -> dict:
        """`thinking` as the template's switch; without it, off (as on Anthropic's API:
        router.api.chat_format.ChatFormat.template_kwargs)."""
        kind = (self.thinking or {}).get("type")
        if kind is None:
            return {}
        if kind not in ("enabled", "disabled", "adaptive"):
            raise RequestError("thinking.type must be enabled, disabled or adaptive")
        return {"enable_thinking": kind != "disabled"}

    def think_budget(self) -> int | None:
        """thinking.budget_tokens of enabled thinking: the thought's bound in tokens.
        (Anthropic's minimum of 1,024 is not kept: small local models think briefly.)"""
        thinking = self.thinking or {}
        if thinking.get("type") != "enabled" or thinking.get("budget_tokens") is None:
            return None
        budget = thinking["budget_tokens"]
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise RequestError("thinking.budget_tokens must be a positive integer")
        if budget >= getattr(self, "max_tokens", budget + 1):
            raise RequestError("`max_tokens` must be greater than `thinking.budget_tokens`")
        return budget


class MessagesRequest(CountTokensRequest):
    SAMPLING_NAMES = {"max_new_tokens": "max_tokens"}

    max_tokens: StrictInt
    stop_sequences: list[str] | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    metadata: dict[str, Any] | None = None
    stream: StrictBool | None = False
    # structured output: Anthropic's output_config.format (json_schema), SGLang's regex/ebnf
    output_config: dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None

    def response_format(self) -> dict | None:
        """output_config.format as OpenAI's response_format (router.api.constraints)."""
        fmt = (self.output_config or {}).get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            raise RequestError("output_config.format must be {'type': 'json_schema', 'schema'}")
        return {"type": "json_schema", "json_schema": {"schema": fmt.get("schema", {})}}

    def stop_strings(self) -> list[str]:
        return list(self.stop_sequences or [])


def system_text(system: str | list, where: str = "system") -> str:
    if isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise RequestError(f"{where} must be a string or a list of text blocks")
    return "".join(_text_block(b, f"{where}.{i}") for i, b in enumerate(system))


def _check_thought(block: dict, where: str, signer: ThinkingSigner | None) -> None:
    """A thinking block of the history must carry this server's signature of its text
    (router.api.thinking_signature); this server returns no redacted_thinking blocks."""
    if signer is None:
        return
    if block["type"] == "redacted_thinking":
        raise RequestError(f"{where}: invalid redacted_thinking block (not from this server)")
    if not signer.valid(block.get("thinking"), block.get("signature")):
        raise RequestError(f"{where}: Invalid `signature` in `thinking` block")


def _message(i: int, message: dict, signer: ThinkingSigner | None = None) -> list[dict]:
    """One Anthropic message as OpenAI messages: a user turn's tool results become `tool`
    messages (before its text), an assistant's tool_use blocks its `tool_calls`. A system
    message among them (Claude Code sends one) is system text at its position."""
    role, content = message.get("role"), message.get("content")
    if role == "system":
        return [{"role": "system", "content": system_text(content, f"messages.{i}.content")}]
    if role not in ("user", "assistant"):
        raise RequestError(f"messages.{i}.role must be user, assistant or system, not {role!r}")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise RequestError(f"messages.{i}.content must be a string or a list of blocks")
    text, calls, results = [], [], []
    for j, block in enumerate(content):
        where = f"messages.{i}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text.append(_text_block(block, where))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            _check_thought(block, where, signer)  # then dropped, as templates drop it
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, where))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, where))
        elif kind == "image" and role == "user":
            text.append(_image_block(block, where))
        else:
            raise RequestError(f"{where}: a {role} message cannot hold a {kind!r} block here")
    out = results
    if role == "assistant":
        turn = {"role": "assistant", "content": "".join(text)}
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    elif text or not results:
        out.append({"role": "user", "content": _user_content(text)})
    return out


def _user_content(pieces: list) -> str | list[dict]:
    """A user turn's text, or its OpenAI parts when it holds an image."""
    if all(isinstance(p, str) for p in pieces):
        return "".join(pieces)
    return [{"type": "text", "text": p} if isinstance(p, str) else p for p in pieces]


def _image_block(block: dict, where: str) -> dict:
    """An image block as OpenAI's image_url part (router.api.image_inputs reads it and
    names `where` in its errors)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str):
        url = f"data:{source.get('media_type', 'image/png')};base64,{source['data']}"
    elif kind == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise RequestError(f"{where}.source: an image source is base64 (with data) or a url")
    return {"type": "image_url", "image_url": {"url": url}, "_where": where}


def _text_block(block, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        raise RequestError(f"{where}: only text blocks are supported here")
    if not isinstance(block.get("text"), str):
        raise RequestError(f"{where}: a text block needs a string 'text'")
    return block["text"]


def _tool_use(block: dict, where: str) -> dict:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise RequestError(f"{where}: a tool_use block needs a string id and name")
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise RequestError(f"{where}.input must be an object")
    call = {"name": block["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}
    return {"id": block["id"], "type": "function", "function": call}


def _tool_result(block: dict, where: str) -> dict:
    if not isinstance(block.get("tool_use_id"), str):
        raise RequestError(f"{where}: a tool_result block needs a string tool_use_id")
    content = block.get("content", "")
    if isinstance(content, list):
        content = "".join(_text_block(b, f"{where}.content.{k}") for k, b in enumerate(content))
    elif not isinstance(content, str):
        raise RequestError(f"{where}.content must be a string or a list of text blocks")
    if block.get("is_error"):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}
