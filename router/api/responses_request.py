"""OpenAI Responses API request bodies (`POST /v1/responses`) and their translation into
the chat the template renders: input items as OpenAI chat messages, Responses' flat
function tools and tool choice as chat's (router.api.constraints takes those), `text.format`
as a `response_format`, `reasoning` as the template's thinking switch.

Hosted tools this server cannot run (web search, file search, computer use, code
interpreter, image generation, local shell, custom and namespaced tools, any other type)
are dropped with one warning line per request rather than refused: agents such as Codex
send some of them with every request.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
from typing import Any

from pydantic import StrictBool, StrictFloat, StrictInt

from common.messages import SamplingParams
from router.api.chat_format import ChatFormat
from router.api.request_body import RequestBody
from router.api.thinking_signature import ThinkingSigner
from router.replicas.manager import RequestError

logger = logging.getLogger("router")

ROLES = ("user", "assistant", "system", "developer")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
ENCRYPTED_REASONING = "reasoning.encrypted_content"  # the `include` value that asks for it


class ResponsesRequest(RequestBody):
    """The body of `POST /v1/responses`. Unknown fields are ignored, as on the chat route."""

    SAMPLING_NAMES = {"max_new_tokens": "max_output_tokens"}

    model: str | None = None
    input: str | list[Any] | None = None
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    stream: StrictBool | None = False
    store: StrictBool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None
    prompt_cache_key: str | None = None
    background: StrictBool | None = None
    # as on the chat route: the template's arguments, SGLang's regex / ebnf output formats,
    # ignore_eos (benchmarks use it for outputs of a fixed length)
    chat_template_kwargs: dict[str, Any] | None = None
    ignore_eos: StrictBool | None = False
    regex: str | None = None
    ebnf: str | None = None

    def unsupported(self) -> str | None:
        if self.background:
            return "background: true is not supported; send the request and wait for it"
        if self.truncation not in (None, "disabled", "auto"):
            return "truncation must be 'disabled' or 'auto'"
        if self.input is None and self.previous_response_id is None:
            return "input is required"
        return None

    def stop_strings(self) -> list[str]:
        return []

    def sampling(self, max_new_tokens: int, grammar: tuple[str, str] | None) -> SamplingParams:
        d = SamplingParams()
        kind, source = grammar or ("", "")
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=d.temperature if self.temperature is None else self.temperature,
            top_p=d.top_p if self.top_p is None else self.top_p,
            ignore_eos=bool(self.ignore_eos),
            grammar_kind=kind,
            grammar=source,
        )

    @property
    def wants_encrypted_reasoning(self) -> bool:
        return ENCRYPTED_REASONING in (self.include or [])

    def template_kwargs(self) -> dict:
        """chat_template_kwargs, with `reasoning` as the thinking switch unless they set
        it: an effort other than "none" turns it on, and so does asking for a summary
        alone; no `reasoning`: no thinking (router.api.chat_format.ChatFormat.template_kwargs)."""
        kwargs = dict(self.chat_template_kwargs or {})
        reasoning = self.reasoning or {}
        effort, summary = reasoning.get("effort"), reasoning.get("summary")
        if effort is not None and effort not in EFFORTS:
            raise RequestError(
                f"reasoning.effort must be one of {', '.join(EFFORTS)}, not {effort!r}",
                param="reasoning.effort",
            )
        if effort is not None:
            kwargs.setdefault("enable_thinking", effort != "none")
        elif summary is not None:
            kwargs.setdefault("enable_thinking", True)
        return kwargs

    def response_format(self) -> dict | None:
        """text.format as chat's response_format (router.constraints.output_grammar)."""
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind == "json_schema":
            spec = {"name": fmt.get("name", "output"), "schema": fmt.get("schema", {})}
            return {"type": "json_schema", "json_schema": spec}
        raise RequestError(
            f"text.format.type must be text, json_object or json_schema, not {kind!r}",
            param="text.format.type",
        )

    def function_tools(self) -> list[dict]:
        """The function tools in Responses' flat shape; other tool types are dropped, with
        one warning line for the request."""
        kept, dropped = [], []
        for i, tool in enumerate(self.tools or []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if not isinstance(kind, str):
                raise RequestError(f"tools[{i}] must be an object with a string 'type'",
                                   param=f"tools[{i}].type")  # fmt: skip
            if kind != "function":
                dropped.append(kind)
                continue
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                raise RequestError(f"tools[{i}].name: a function tool needs a string name",
                                   param=f"tools[{i}].name")  # fmt: skip
            parameters = tool.get("parameters")
            if parameters is not None and not isinstance(parameters, dict):
                raise RequestError(f"tools[{i}].parameters must be a JSON schema object",
                                   param=f"tools[{i}].parameters")  # fmt: skip
            kept.append(tool)
        if dropped:
            logger.warning(
                "responses: dropped tools this server cannot run (types %s); %d function "
                "tool(s) kept", ", ".join(sorted(set(dropped))), len(kept),
            )  # fmt: skip
        return kept


def chat_tools(functions: list[dict]) -> list[dict] | None:
    """Responses' flat function tools as chat's nested ones."""
    out = []
    for tool in functions:
        function = {"name": tool["name"], "parameters": tool.get("parameters") or _NO_PARAMETERS}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out or None


_NO_PARAMETERS = {"type": "object", "properties": {}}


def chat_tool_choice(choice):
    """Responses' tool_choice as chat's: the options as they are, a named function nested;
    a hosted tool's type names a tool that was dropped, so it is `auto`."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(kind, str) and kind not in ("function", "allowed_tools", "custom", "mcp"):
        return "auto"
    raise RequestError(
        "tool_choice must be auto, none, required or {'type': 'function', 'name': NAME}",
        param="tool_choice",
    )


# ---------------------------------------------------------------- input items


class ReasoningSeal:
    """`encrypted_content` of a reasoning item: the thought's text, signed so that one sent
    back is known to be this server's (router.api.thinking_signature). Opaque to clients, as
    OpenAI's is; not secret from them (they were shown the thought)."""

    def __init__(self, signer: ThinkingSigner):
        self.signer = signer

    def seal(self, text: str) -> str:
        payload = base64.urlsafe_b64encode(text.encode("utf-8")).decode("ascii")
        return f"{payload}.{self.signer.sign(payload)}"

    def open(self, blob, where: str) -> str:
        payload, _, signature = blob.partition(".") if isinstance(blob, str) else ("", "", "")
        if not self.signer.valid(payload, signature):
            raise RequestError(
                f"{where}.encrypted_content: invalid encrypted_content (not made by this server)",
                param=f"{where}.encrypted_content",
            )
        try:
            return base64.urlsafe_b64decode(payload).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            raise RequestError(f"{where}.encrypted_content is malformed",
                               param=f"{where}.encrypted_content") from None  # fmt: skip


def input_messages(items, fmt: ChatFormat, seal: ReasoningSeal) -> list[dict]:
    """The input as OpenAI chat messages: a string is one user message; items in order,
    with each run of an assistant's text and function calls as one assistant turn
    (which templates expect), a call's output as a `tool` message, and a signed
    reasoning item's thought rendered into the assistant turn after it."""
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    thought = None  # from a reasoning item, for the next assistant turn
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "reasoning":
            if item.get("encrypted_content") is not None:
                thought = seal.open(item["encrypted_content"], where)
        elif kind == "function_call_output":
            out.append(_call_output(item, where))
        elif kind == "message" and item.get("role") != "assistant":
            out.append(_message(item, where))
        elif kind in ("message", "function_call"):
            turn = out[-1] if out and out[-1]["role"] == "assistant" and thought is None else None
            if turn is None:
                turn = {"role": "assistant", "content": ""}
                out.append(turn)
            if kind == "message":
                turn["content"] += _message(item, where)["content"]
            else:
                turn.setdefault("tool_calls", []).append(_function_call(item, where))
            if thought is not None:
                with_thought(turn, thought, fmt)
                thought = None
        else:
            raise RequestError(
                f"{where}.type {kind!r} is not supported (message, function_call, "
                "function_call_output and reasoning items are)",
                param=f"{where}.type",
            )
    return out


def with_thought(turn: dict, thought: str, fmt: ChatFormat) -> None:
    """An assistant turn with its thought as the model wrote it after a generation prompt
    that opened its thinking block (`<think>\n`, as Qwen3's and DeepSeek's do): the
    thought, the end marker, then the answer's text, which keeps the space the model wrote
    after the marker. So a template that writes the turn's content as it is renders what
    the model saw, and one that keeps thoughts (Qwen3's) parses it back. A model without
    markers gets it as `reasoning_content`."""
    if fmt.think_start is None or fmt.think_end is None:
        turn["reasoning_content"] = thought
        return
    turn["content"] = f"{fmt.think_start}\n{thought}{fmt.think_end}" + turn["content"]


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in ROLES:
        raise RequestError(
            f"{where}.role must be one of {', '.join(ROLES)}, not {role!r}", param=f"{where}.role"
        )
    value = item.get("content")
    images = isinstance(value, list) and any(
        isinstance(p, dict) and p.get("type") == "input_image" for p in value
    )
    if images and role == "user":  # chat parts, for the image pipeline (api.image_inputs)
        content = [_part(p, f"{where}.content[{j}]") for j, p in enumerate(value)]
    else:
        content = _text(value, f"{where}.content")
    # developer messages are system text: chat templates know no developer role
    return {"role": "system" if role == "developer" else role, "content": content}


DETAILS = ("auto", "low", "high")


def _part(part, where: str) -> dict:
    """A user message's part as chat's: an `input_image` (its `image_url`, a data:, file:
    or http(s) URL, and `detail`) as an `image_url` part, anything else as text."""
    if not (isinstance(part, dict) and part.get("type") == "input_image"):
        return {"type": "text", "text": _text_part(part, where)}
    url, detail = part.get("image_url"), part.get("detail", "auto")
    if not isinstance(url, str):
        what = "file_id images are not served" if "file_id" in part else "it needs a string"
        raise RequestError(f"{where}.image_url: {what}; send the image as a data: URL",
                           param=f"{where}.image_url")  # fmt: skip
    if detail not in DETAILS:
        raise RequestError(f"{where}.detail must be one of {', '.join(DETAILS)}",
                           param=f"{where}.detail")  # fmt: skip
    # the model's processor decides the size, whatever the detail (as on the chat route)
    return {"type": "image_url", "image_url": {"url": url, "detail": detail}, "_where": where}


def _text(value, where: str) -> str:
    """A message's content or a call's output: a string, or text parts joined."""
    if isinstance(value, list):
        return "".join(_text_part(p, f"{where}[{j}]") for j, p in enumerate(value))
    if not isinstance(value, str):
        raise RequestError(f"{where} must be a string or a list of text parts", param=where)
    return value


def _text_part(part, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in ("input_text", "output_text", "text", "refusal"):
        raise RequestError(f"{where}.type: only text parts are supported, not {kind!r}",
                           param=f"{where}.type")  # fmt: skip
    text = part.get("refusal" if kind == "refusal" else "text")
    if not isinstance(text, str):
        raise RequestError(f"{where}: a text part needs a string 'text'", param=where)
    return text


def _function_call(item: dict, where: str) -> dict:
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str):
            raise RequestError(f"{where}.{name} must be a string", param=f"{where}.{name}")
    try:
        json.loads(item["arguments"] or "{}")
    except json.JSONDecodeError:
        raise RequestError(f"{where}.arguments is not JSON", param=f"{where}.arguments") from None
    function = {"name": item["name"], "arguments": item["arguments"] or "{}"}
    return {"id": item["call_id"], "type": "function", "function": function}


def _call_output(item: dict, where: str) -> dict:
    if not isinstance(item.get("call_id"), str):
        raise RequestError(f"{where}.call_id must be a string", param=f"{where}.call_id")
    output = _text(item.get("output"), f"{where}.output")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}
