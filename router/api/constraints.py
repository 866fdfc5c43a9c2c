"""A request's output constraint as a grammar for the worker: OpenAI's `response_format`
(json_object, json_schema), SGLang's `regex` and `ebnf`, and a tool choice that must call
a tool (`required`, or a named function). Checked by the grammar engine here, so a bad
one is a 400 naming the problem before anything is scheduled.
"""

from __future__ import annotations

import json

from common.grammar_spec import GrammarError, check
from router.api.chat_format import ChatFormat
from router.api.tool_grammars import forced_call_rules, json_rule
from router.request_error import RequestError


def output_grammar(response_format: dict | None, regex, ebnf) -> tuple[str, str] | None:
    """(grammar kind, source) for the request's output format, or None."""
    asked = []
    kind = (response_format or {}).get("type", "text")
    if kind == "json_object":
        asked.append(("json_schema", json.dumps({"type": "object"})))
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise RequestError("response_format.json_schema must be an object with a 'schema'")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict | bool):
            raise RequestError("response_format.json_schema.schema must be a JSON schema object")
        asked.append(("json_schema", json.dumps(schema)))
    elif kind != "text":
        raise RequestError(
            f"response_format.type must be text, json_object or json_schema, not {kind!r}"
        )
    if regex is not None:
        asked.append(("regex", _text(regex, "regex")))
    if ebnf is not None:
        asked.append(("ebnf", _text(ebnf, "ebnf")))
    if len(asked) > 1:
        raise RequestError("give at most one of response_format (json), regex and ebnf")
    return checked(asked[0]) if asked else None


def tool_grammar(
    fmt: ChatFormat, tools: list[dict], names: list[str], thinking: bool,
    think_budget: int | None = None,
) -> tuple[str, str]:  # fmt: skip
    """A grammar that makes the model call one of the tools `names` (OpenAI tool dicts) in
    its own tool format (router.api.tool_grammars); `thinking`: the prompt opened a thinking
    block, in which the model thinks first (see `_thought`)."""
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    for name in names:
        if name not in by_name:
            raise RequestError(f"tool_choice names {name!r}, which is not among the tools")
    rules = forced_call_rules(fmt.tool_parser_type, [by_name[n] for n in names])
    head = f"thought {_thought_end(fmt)} {json.dumps(chr(10) * 2)} " if thinking else ""
    thought = _thought(fmt, think_budget) if thinking else ""
    return checked(("lark", f"start: {head}call\n{rules}{thought}"))


def after_thinking(
    fmt: ChatFormat, grammar: tuple[str, str] | None, think_budget: int | None
) -> tuple[str, str] | None:
    """The grammar for a chat whose prompt opened a thinking block: a JSON answer comes
    after the model's thought (`_thought`); a regex or EBNF governs the whole output,
    thinking included; without a grammar, a `think_budget` alone bounds the thought and
    leaves the answer free but for one thing: it is not empty (a thought cut by its budget
    is followed by an answer, or by max_tokens, never by the end of the turn)."""
    kind, source = grammar or ("", "")
    if grammar is None and think_budget:
        answer = r"ANSWER: /(?s:\s*\S.*)/"
        lark = f"start: thought {_thought_end(fmt)} ANSWER\n{answer}\n{_thought(fmt, think_budget)}"
        return checked(("lark", lark))
    if kind != "json_schema":
        return grammar
    answer = json_rule(json.loads(source))
    closed = f"{_thought_end(fmt)} {json.dumps(chr(10) * 2)}"
    lark = f"start: thought {closed} answer\nanswer: {answer}\n{_thought(fmt, think_budget)}"
    return checked(("lark", lark))


def _thought(fmt: ChatFormat, budget: int | None) -> str:
    """The lark rules of a thought: any text without the block's end marker, which follows
    it when the model writes it, or after `budget` tokens at most (a thought may be empty)."""
    bound = f"[max_tokens={max(1, budget)}]" if budget else ""
    end = json.dumps(fmt.think_end)
    return f"thought{bound}: THOUGHT\nTHOUGHT: /(?s:.*)/ & ~(/(?s:.*)/ {end} /(?s:.*)/)\n"


def _thought_end(fmt: ChatFormat) -> str:
    """The lark expression of the thought's end marker: its text, or its token where the
    tokenizer has one (which the model writes, and which alone may follow thought text)."""
    text = json.dumps(fmt.think_end)
    return f"({text} | <[{fmt.think_end_id}]>)" if fmt.think_end_id is not None else text


def check_tools(fmt: ChatFormat, tools: list | None) -> list[dict] | None:
    """OpenAI function tools, each with a name; RequestError naming the first bad one. (A
    model whose template has no tool format takes them in the generic one.)"""
    if not tools:
        return None
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise RequestError(f"tools[{i}] must be a function tool")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(f"tools[{i}].function needs a string 'name'")
        if not isinstance(function.get("parameters", {}), dict):
            raise RequestError(f"tools[{i}].function.parameters must be a JSON schema object")
    return tools


def checked(grammar: tuple[str, str]) -> tuple[str, str]:
    try:
        check(*grammar)
    except GrammarError as exc:
        raise RequestError(str(exc), "invalid_grammar") from None
    return grammar


def _text(value, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise RequestError(f"{name} must be a non-empty string")
    return value


def tool_choice(choice, tools: list[dict] | None) -> tuple[bool, list[str] | None]:
    """(parse the output for tool calls, the tools one of which it must call, if it must)
    for OpenAI's tool_choice: auto (the default), none, required or a named function."""
    if choice is None or choice == "auto":
        return bool(tools), None
    if choice == "none":
        return False, None  # the tools stay in the prompt: its cached prefix stays the same
    if not tools:
        raise RequestError("tool_choice needs tools")
    if choice == "required":
        return True, [t["function"]["name"] for t in tools]
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise RequestError(
            "tool_choice must be auto, none, required or {'type': 'function', 'function': {'name'}}"
        )
    return True, [name]
