"""Grammars that force a tool call written the way the model's own mlx-lm tool parser
(`mlx_lm/tool_parsers/<kind>.py`) reads it, so a `required` or named tool choice yields a
call that parser turns back into the function's name and arguments.

Each writer returns lark rules (llguidance's dialect) defining `call`: the start marker,
one call of one of the functions, the end marker. JSON formats hold the arguments to the
function's JSON schema; the XML-like formats (one tag per parameter) and the keyword-list
ones (pythonic, function_gemma) write each declared parameter, the required ones always,
a string one as raw text where the parser reads it so (without the closing tag or the
surrounding whitespace their parsers strip), any other as compact JSON of its schema.
A function whose call its format's parser cannot read back is refused with a RequestError.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from common.grammar_spec import JSON_OPTIONS
from router.request_error import RequestError


def json_rule(schema: dict | bool) -> str:
    """A lark expression for JSON of `schema`, compact (see common.grammar_spec)."""
    schema = {} if schema is True else schema
    return f"%json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}"


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object"}


def _alternatives(functions: list[dict], one: Callable[[int, dict], tuple[str, str]]) -> str:
    """`fn: f0 | f1 ...` with each function's rule from `one(i, function)` -> (expr, rules)."""
    exprs, rules = [], []
    for i, function in enumerate(functions):
        expr, extra = one(i, function)
        exprs.append(f"f{i}")
        rules.append(f"f{i}: {expr}\n{extra}")
    return f"fn: {' | '.join(exprs)}\n" + "".join(rules)


# ------------------------------------------------------------------- JSON-argument formats


def _json_tools(functions: list[dict]) -> str:
    """Hermes / Qwen: <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": _parameters(f)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return f'call: "<tool_call>\\n" {json_rule(schema)} "\\n</tool_call>"\n'


def _mistral(functions: list[dict]) -> str:
    """Mistral (v11+ templates): [TOOL_CALLS]name[ARGS]{...}; no end marker."""
    return 'call: "[TOOL_CALLS]" fn\n' + _alternatives(
        functions, lambda i, f: (f"{_lit(f['name'] + '[ARGS]')} {json_rule(_parameters(f))}", "")
    )


def _kimi_k2(functions: list[dict]) -> str:
    """Kimi K2: a section with one call `functions.<name>:0`, its arguments JSON."""
    head = "<|tool_calls_section_begin|><|tool_call_begin|>"
    tail = "<|tool_call_end|><|tool_calls_section_end|>"

    def one(i, f):
        name = _lit(f"functions.{f['name']}:0<|tool_call_argument_begin|>")
        return f"{name} {json_rule(_parameters(f))}", ""

    return f"call: {_lit(head)} fn {_lit(tail)}\n" + _alternatives(functions, one)


def _kimi_k3(functions: list[dict]) -> str:
    """Kimi K3 (XTML): a tools section with one call whose arguments are one JSON block,
    the form of the two its parser reads that carries any schema."""
    head, tail = "<|open|>tools<|sep|>", "<|close|>tools<|sep|>"
    close = "<|close|>json<|sep|><|close|>call<|sep|>"

    def one(i, f):
        name = f["name"].replace("&", "&amp;").replace('"', "&quot;")
        opening = f'<|open|>call tool="{name}" index="1"<|sep|><|open|>json type="object"<|sep|>'
        return f"{_lit(opening)} {json_rule(_parameters(f))} {_lit(close)}", ""

    return f"call: {_lit(head)} fn {_lit(tail)}\n" + _alternatives(functions, one)


# ------------------------------------------------------------------- one tag per parameter


def _tagged(
    head: str, tail: str, name: Callable[[str], str], param: Callable[[str], tuple],
    kind: str = "", needs_argument: bool = False, raw_strings: bool = True,
):  # fmt: skip
    """A writer for formats `head` <name(fn)> <param(k) per parameter> `tail`, where
    param(k) = (text before the value, text after it); `needs_argument`: the parser cannot
    read a call without one; `raw_strings`: its parser takes a string value as the text
    (else as JSON, which every value then is)."""

    def write(functions: list[dict]) -> str:
        def one(i: int, f: dict) -> tuple[str, str]:
            schema = _parameters(f)
            required = set(schema.get("required") or [])
            if needs_argument and not required & set(schema.get("properties") or {}):
                raise RequestError(
                    f"mlx-lm's {kind} tool parser cannot read a call without arguments, so "
                    f"a call of {f['name']!r} (no required parameter) cannot be forced"
                )
            parts, rules = [_lit(name(f["name"]))], []
            for j, (key, sub) in enumerate((schema.get("properties") or {}).items()):
                before, after = param(key)
                sub = sub if isinstance(sub, dict) else {}
                value, rule = (
                    _value(f"V{i}_{j}", sub, after) if raw_strings else (json_rule(sub), "")
                )
                part = f"{_lit(before)} {value} {_lit(after)}"
                parts.append(part if key in required else f"({part})?")
                rules.append(rule)
            return " ".join(parts), "".join(rules)

        return f"call: {_lit(head)} fn {_lit(tail)}\n" + _alternatives(functions, one)

    return write


def _value(terminal: str, schema: dict, after: str) -> tuple[str, str]:
    """(expression, extra rules) of a parameter's value, followed by the text `after`."""
    choices = _string_choices(schema)
    if choices:
        return "(" + " | ".join(_lit(c) for c in choices) + ")", ""
    if schema.get("type") != "string":
        return json_rule(schema), ""
    rule = (
        f"{terminal}: /(?s:.{_length(schema)})/ & ~(/(?s:.*)/ {_lit(after)} /(?s:.*)/)"
        " & ~(/(?s:\\s.*)/) & ~(/(?s:.*\\s)/)\n"
    )
    return terminal, rule


# ------------------------------------------------------------------- keyword arguments


def _keyword_call(head: str, tail: str, call: str, kv: Callable, kind: str):
    """A writer for formats `head` call(name) <k=v, ...> `tail`, comma-separated, where
    kv(key, schema, terminal, kind) = (expression, extra rules) of one argument."""
    call_head, call_tail = call.split("{}")

    def write(functions: list[dict]) -> str:
        def one(i: int, f: dict) -> tuple[str, str]:
            schema = _parameters(f)
            required = set(schema.get("required") or [])
            items, rules = [], []
            for j, (key, sub) in enumerate((schema.get("properties") or {}).items()):
                expr, rule = kv(key, sub if isinstance(sub, dict) else {}, f"V{i}_{j}", kind)
                items.append((expr, key in required))
                rules.append(rule)
            arguments = _comma_list(items)
            head_lit = _lit(call_head.replace("NAME", f["name"]))
            return f"{head_lit} {arguments} {_lit(call_tail)}", "".join(rules)

        return f"call: {_lit(head)} fn {_lit(tail)}\n" + _alternatives(functions, one)

    return write


def _comma_list(items: list[tuple[str, bool]]) -> str:
    """The (expression, required) items joined by commas, the optional ones maybe left out
    (required ones first: keyword arguments are read in any order)."""
    required = [e for e, r in items if r]
    optional = [e for e, r in items if not r]
    if required:
        return ' "," '.join(required) + "".join(f' ("," {e})?' for e in optional)
    if not optional:
        return '""'
    leads = [e + "".join(f' ("," {o})?' for o in optional[k + 1 :]) for k, e in enumerate(optional)]
    return "(" + " | ".join(leads) + ")?"


def _python_keyword(key: str, schema: dict, terminal: str, kind: str) -> tuple[str, str]:
    """pythonic: key=<JSON>, which its parser reads as a Python literal (true/false/null
    included)."""
    return f"{_lit(key + '=')} {json_rule(schema)}", ""


def _gemma_keyword(key: str, schema: dict, terminal: str, kind: str) -> tuple[str, str]:
    """function_gemma: key:<escape>text<escape> for a string, key:<JSON scalar> otherwise;
    its parser ends the call at the first `}` and a value at the first `,`, so a string
    holds neither `}` nor the escape, and objects and arrays cannot be written."""
    key_lit = _lit(key + ":")
    choices = _string_choices(schema)
    if choices:
        values = " | ".join(_lit(f"<escape>{c}<escape>") for c in choices)
        return f"{key_lit} ({values})", ""
    kind_of = schema.get("type")
    if kind_of == "string":
        rule = f'{terminal}: /[^}}]{_length(schema)}/ & ~(/(?s:.*)/ "<escape>" /(?s:.*)/)\n'
        return f'{key_lit} "<escape>" {terminal} "<escape>"', rule
    if kind_of not in ("integer", "number", "boolean", "null"):
        raise RequestError(
            f"mlx-lm's {kind} tool parser cannot read the value of parameter {key!r} "
            "(only strings, numbers, booleans and null), so this call cannot be forced"
        )
    return f"{key_lit} {json_rule(schema)}", ""


GEMMA4_QUOTE = '<|"|>'


def _gemma4_keyword(key: str, schema: dict, terminal: str, kind: str) -> tuple[str, str]:
    """gemma4: key:VALUE, its parser quoting the bare keys (word characters only) and
    reading <|"|>text<|"|> as a string; objects and arrays nest in the same syntax."""
    if not key.isidentifier():
        raise RequestError(
            f"mlx-lm's gemma4 tool parser reads only word characters in a key, so parameter "
            f"{key!r} cannot be forced"
        )
    value, rules = _gemma4_value(schema, terminal, key)
    return f"{_lit(key + ':')} {value}", rules


def _gemma4_value(schema: dict, terminal: str, key: str) -> tuple[str, str]:
    choices = _string_choices(schema)
    if choices:
        return "(" + " | ".join(_lit(GEMMA4_QUOTE + c + GEMMA4_QUOTE) for c in choices) + ")", ""
    kind = schema.get("type")
    if kind == "string":
        quote = _lit(GEMMA4_QUOTE)
        rule = f"{terminal}: /(?s:.{_length(schema)})/ & ~(/(?s:.*)/ {quote} /(?s:.*)/)\n"
        return f"{quote} {terminal} {quote}", rule
    if kind in ("integer", "number", "boolean", "null") or "enum" in schema or "const" in schema:
        return json_rule(schema), ""
    if kind == "array" and isinstance(schema.get("items", {}), dict):
        item, rules = _gemma4_value(schema.get("items", {}), terminal + "_i", key)
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        return f'"[" {_bounded_list(item, low, high)} "]"', rules
    if kind == "object" and schema.get("properties"):
        required = set(schema.get("required") or [])
        items, rules = [], []
        for j, (name, sub) in enumerate(schema["properties"].items()):
            expr, rule = _gemma4_keyword(name, sub if isinstance(sub, dict) else {},
                                         f"{terminal}_{j}", "gemma4")  # fmt: skip
            items.append((expr, name in required))
            rules.append(rule)
        return f'"{{" {_comma_list(items)} "}}"', "".join(rules)
    raise RequestError(
        f"parameter {key!r}: radix-mlx writes gemma4 calls for strings, numbers, booleans, "
        "null, enums, arrays and objects with properties, so this call cannot be forced"
    )


def _bounded_list(item: str, low: int, high: int | None) -> str:
    """`item` repeated low..high times (high None: unbounded), comma-separated."""
    if high is not None and high < low:
        raise RequestError(f"maxItems {high} is below minItems {low}")
    required = ' "," '.join([item] * low)
    if high is None:
        more = f'("," {item})*'
        return f"{required} {more}" if low else f"({item} {more})?"
    if high == 0:
        return '""'
    further = ""  # each optional item only after the one before it
    for _ in range(high - max(low, 1)):
        further = f'("," {item} {further})?'
    return f"{required} {further}" if low else f"({item} {further})?"


def _string_choices(schema: dict) -> list[str] | None:
    """The strings a const or enum of strings allows, else None."""
    choices = [schema["const"]] if "const" in schema else schema.get("enum")
    return choices if choices and all(isinstance(c, str) for c in choices) else None


def _length(schema: dict) -> str:
    """A regex repetition for a string schema's length bounds: {min,max}."""
    high = schema.get("maxLength")
    return f"{{{schema.get('minLength', 0)},{'' if high is None else high}}}"


_WRITERS: dict[str, Callable[[list[dict]], str]] = {
    "json_tools": _json_tools,
    "mistral": _mistral,
    "kimi_k2": _kimi_k2,
    "kimi_k3": _kimi_k3,
    "qwen3_coder": _tagged(
        "<tool_call>\n<function=", "</function>\n</tool_call>",
        lambda n: f"{n}>\n", lambda k: (f"<parameter={k}>\n", "\n</parameter>\n"),
    ),
    "glm47": _tagged(
        "<tool_call>", "</tool_call>",
        lambda n: n, lambda k: (f"<arg_key>{k}</arg_key><arg_value>", "</arg_value>"),
    ),
    "longcat": _tagged(
        "<longcat_tool_call>", "</longcat_tool_call>", lambda n: n,
        lambda k: (f"<longcat_arg_key>{k}</longcat_arg_key><longcat_arg_value>",
                   "</longcat_arg_value>"),
        "longcat", needs_argument=True,
    ),
    "minimax_m2": _tagged(
        "<minimax:tool_call>\n<invoke name=", "</invoke>\n</minimax:tool_call>",
        lambda n: f'"{n}">\n', lambda k: (f'<parameter name="{k}">', "</parameter>\n"),
    ),
    "minicpm5": _tagged(
        "<function name=", "</function>",
        lambda n: f'"{n}">', lambda k: (f'<param name="{k}">', "</param>"),
    ),
    "muse_spark": _tagged(
        "<atem:function_calls>", "</atem:invoke></atem:function_calls>",
        lambda n: f'<atem:invoke name="{n}">',
        lambda k: (f'<atem:parameter name="{k}">', "</atem:parameter>"),
        raw_strings=False,
    ),
    "pythonic": _keyword_call(
        "<|tool_call_start|>[", "]<|tool_call_end|>", "NAME({})", _python_keyword, "pythonic"
    ),
    "gemma4": _keyword_call(
        "<|tool_call>", "<tool_call|>", "call:NAME{{}}", _gemma4_keyword, "gemma4"
    ),
    "function_gemma": _keyword_call(
        "<start_function_call>", "<end_function_call>", "call:NAME{{}}", _gemma_keyword,
        "function_gemma",
    ),
}  # fmt: skip
_WRITERS["laguna"] = _WRITERS["glm47"]  # mlx-lm's laguna parser is glm47's

FORCEABLE_FORMATS = sorted(_WRITERS)


def forced_call_rules(kind: str | None, functions: list[dict]) -> str:
    """Lark rules defining `call`: one call, in the tool format `kind`, of one of
    `functions` (OpenAI function dicts); a RequestError for a format no grammar here writes,
    so a forced call is never left to chance."""
    writer = _WRITERS.get(kind)
    if writer is None:
        raise RequestError(
            "this tool choice must be enforced by a grammar, which radix-mlx builds for the "
            f"{', '.join(FORCEABLE_FORMATS)} tool formats; this model's is {kind!r}: "
            "use tool_choice auto"
        )
    return writer(functions)
