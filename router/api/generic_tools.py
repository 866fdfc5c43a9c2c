"""The generic tool format: tools for a model whose chat template names no tool format
(or `--tool-call-parser generic`), so any model can serve an agent.

The template is given no tools; the router writes them into the chat itself, in the
Hermes / Qwen 2.5 convention many models were trained on (README, "Tools on every
model"):

- a system block listing each function's JSON schema inside `<tools></tools>` and asking
  for calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, after the
  request's own system text (or as the first message when it has none);
- an assistant turn's earlier calls written into its text the same way;
- tool results as a user turn of `<tool_response>...</tool_response>` blocks
  (consecutive results in one turn), as templates without tools know no `tool` role.

Calls are read back by mlx-lm's `json_tools` parser and, when `tool_choice` requires one,
written under the grammar `router.api.tool_grammars` builds for that format.
"""

from __future__ import annotations

import json

GENERIC = "generic"  # the --tool-call-parser name of this format
PARSER = "json_tools"  # mlx-lm's parser (mlx_lm/tool_parsers/json_tools.py) that reads it

_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TAIL = (
    "</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def tools_block(tools: list[dict]) -> str:
    """The system text that lists the tools (OpenAI function tools) and the call format."""
    lines = [json.dumps(t, ensure_ascii=False) for t in tools]
    return "\n".join([_HEAD, *lines, _TAIL])


def call_text(function: dict) -> str:
    """One call as the model is asked to write it (and as the grammar forces it)."""
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI's JSON string (template_messages parses them)
        arguments = json.loads(arguments or "{}")
    call = {"name": function["name"], "arguments": arguments}
    return f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"


def generic_chat(
    messages: list[dict], tools: list[dict] | None, in_system: bool = True
) -> list[dict]:
    """`messages` (OpenAI's, text contents) with the tools, calls and results written in
    as text, for a template that renders none of them; the tools' block goes in the
    system message, or (`in_system` False) before the first message's text."""
    out: list[dict] = []
    results = False  # the last turn is tool results: the next one joins it
    for message in messages:
        if message["role"] in ("tool", "function"):
            result = f"<tool_response>\n{message['content']}\n</tool_response>"
            if results:
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result})
            results = True
            continue
        results = False
        calls = [c.get("function", c) for c in message.get("tool_calls") or []]
        message = {k: v for k, v in message.items() if k != "tool_calls"}
        if calls:
            texts = [message["content"]] if message["content"] else []
            message["content"] = "\n".join(texts + [call_text(f) for f in calls])
        out.append(message)
    return _with_tools(out, tools, in_system) if tools else out


def _with_tools(chat: list[dict], tools: list[dict], in_system: bool) -> list[dict]:
    block = tools_block(tools)
    first = chat[0] if chat else None
    if first is not None and first["role"] in ("system", "developer"):
        return [{**first, "content": f"{first['content']}\n\n{block}".lstrip()}, *chat[1:]]
    if first is not None and not in_system:
        return [{**first, "content": f"{block}\n\n{first['content']}".rstrip()}, *chat[1:]]
    return [{"role": "system", "content": block}, *chat]
