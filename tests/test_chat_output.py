"""The chat output splitter on fixed model outputs, with mlx-lm's own tool parsers: each
tool-call format the tiny agent model's template or mlx-lm's parsers cover, fed whole and
in pieces of every size (a marker may arrive split anywhere), unicode and nested JSON."""

from __future__ import annotations

import json

import pytest

from router.api.chat_format import ChatFormat, mlx_lm_module
from router.api.chat_output import OutputSplitter, finish_reason

NESTED = {"q": "Zürich 東京 😀", "opts": {"k": [1, {"deep": None}], "ok": True}}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def fmt(kind: str, thinking: bool = True) -> ChatFormat:
    module = mlx_lm_module(f"tool_parsers.{kind}")
    think = ("<think>", "</think>") if thinking else (None, None)
    return ChatFormat(*think, "enable_thinking", kind, module.tool_call_start,
                      module.tool_call_end, module.parse_tool_call)  # fmt: skip


CASES = {
    "json_tools": "<tool_call>\n"
    + json.dumps({"name": "f", "arguments": NESTED}, ensure_ascii=False)
    + "\n</tool_call>",
    "qwen3_coder": (
        "<tool_call>\n<function=f>\n<parameter=q>\nZürich 東京 😀\n</parameter>\n"
        f"<parameter=opts>\n{json.dumps(NESTED['opts'])}\n</parameter>\n</function>\n</tool_call>"
    ),
    "glm47": (
        "<tool_call>f<arg_key>q</arg_key><arg_value>Zürich 東京 😀</arg_value>"
        f"<arg_key>opts</arg_key><arg_value>{json.dumps(NESTED['opts'])}</arg_value></tool_call>"
    ),
    "kimi_k2": (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
        + json.dumps(NESTED, ensure_ascii=False)
        + "<|tool_call_end|><|tool_calls_section_end|>"
    ),
}
# no end marker: the call runs to the end of the output
MISTRAL = "[TOOL_CALLS]f[ARGS]" + json.dumps(NESTED, ensure_ascii=False)


def split(f: ChatFormat, text: str, piece: int, thinking: bool = False):
    s = OutputSplitter(f, TOOLS, thinking)
    content, reasoning, calls = "", "", []
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)] + [""]
    for i, p in enumerate(pieces):
        parts = s.feed(p, final=i == len(pieces) - 1)
        content, reasoning = content + parts.content, reasoning + parts.reasoning
        calls += parts.tool_calls
    return content, reasoning, calls, s


@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_tool_formats_parse_in_any_pieces(kind, piece):
    text = "Let me look. " + CASES[kind] + " done"
    content, reasoning, calls, s = split(fmt(kind), text, piece)
    assert content == "Let me look.  done" and reasoning == ""
    (call,) = calls
    assert call.name == "f"
    args = json.loads(call.arguments)
    assert args["q"] == NESTED["q"]
    assert args["opts"] == NESTED["opts"] or json.loads(args["opts"]) == NESTED["opts"]
    assert finish_reason("stop", s) == "tool_calls" and finish_reason("length", s) == "length"


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_reasoning_then_content_then_call(piece):
    text = "plan < not a marker</think>Answer <b>" + CASES["json_tools"]
    content, reasoning, calls, _ = split(fmt("json_tools"), text, piece, thinking=True)
    assert reasoning == "plan < not a marker" and content == "Answer <b>"
    assert [c.name for c in calls] == ["f"]


def test_without_tools_markers_are_content():
    s = OutputSplitter(fmt("json_tools", thinking=False), None, False)
    parts = s.feed(CASES["json_tools"], final=True)
    assert parts.content == CASES["json_tools"] and not parts.tool_calls


def test_unparsable_call_is_returned_as_content():
    content, _, calls, s = split(fmt("json_tools"), "<tool_call>\n{broken\n</tool_call>", 3)
    assert calls == [] and "{broken" in content and finish_reason("stop", s) == "stop"


@pytest.mark.parametrize("kind", ["json_tools", "kimi_k2", "mistral"])
@pytest.mark.parametrize("piece", [1, 5, 1000])
def test_json_arguments_stream_as_written(kind, piece):
    """The formats whose arguments are one JSON object stream them in pieces, which
    concatenate to the whole call's arguments; others stream each call whole."""
    text = "Sure. " + (MISTRAL if kind == "mistral" else CASES[kind])
    s = OutputSplitter(fmt(kind), TOOLS, False)
    deltas, calls = [], []
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)] + [""]
    for i, p in enumerate(pieces):
        parts = s.feed(p, final=i == len(pieces) - 1)
        deltas += parts.tool_deltas
        calls += parts.tool_calls
    (call,) = calls
    assert deltas[0].name == "f" and deltas[0].id == call.id
    assert all(d.index == 0 and d.name is None for d in deltas[1:])
    assert "".join(d.arguments for d in deltas) == call.arguments
    assert json.loads(call.arguments) == NESTED
    if piece == 1:
        assert len(deltas) > 20  # one piece per character of the arguments
    if kind == "kimi_k2":
        assert call.id == "functions.f:0"  # the id mlx-lm's parser reads


def test_a_format_without_streamed_arguments_sends_the_call_whole():
    s = OutputSplitter(fmt("glm47"), TOOLS, False)
    deltas = [d for ch in [*CASES["glm47"], ""] for d in s.feed(ch, final=ch == "").tool_deltas]
    (delta,) = deltas
    assert (delta.name, json.loads(delta.arguments)["q"]) == ("f", NESTED["q"])


def test_unterminated_call_is_parsed_at_the_end():
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}'
    _, _, calls, _ = split(fmt("json_tools"), text, 5)
    assert json.loads(calls[0].arguments) == {"a": 1}


def test_agent_template_is_inferred_as_json_tools(agent_model):
    from transformers import AutoTokenizer

    f = ChatFormat.of(AutoTokenizer.from_pretrained(agent_model))
    assert (f.tool_parser_type, f.think_start, f.think_end) == ("json_tools", "<think>", "</think>")
    assert f.template_kwargs(None) == {"enable_thinking": False}  # off unless asked for
    assert f.template_kwargs({"enable_thinking": True}) == {"enable_thinking": True}
    assert f.starts_thinking("<|im_start|>assistant\n<think>\n")
    assert not f.starts_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_tiny_model_takes_generic_tools_and_has_no_thinking(tiny_model):
    from transformers import AutoTokenizer

    f = ChatFormat.of(AutoTokenizer.from_pretrained(tiny_model))
    assert f.generic_tools and f.tool_parser_type == "json_tools" and f.think_start is None
    assert f.template_kwargs({"x": 1}) == {"x": 1, "enable_thinking": False}


def test_tool_call_parser_flag_overrides_detection(tiny_model, agent_model):
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from router.api.chat_overrides import apply_chat_overrides

    tiny = AutoTokenizer.from_pretrained(tiny_model)
    apply_chat_overrides(tiny, SimpleNamespace(tool_call_parser="mistral"), None)
    f = ChatFormat.of(tiny)
    assert (f.tool_parser_type, f.tool_call_start, f.generic_tools) == (
        "mistral",
        "[TOOL_CALLS]",
        False,
    )
    agent = AutoTokenizer.from_pretrained(agent_model)  # its template: json_tools
    apply_chat_overrides(agent, SimpleNamespace(tool_call_parser="generic"), None)
    assert ChatFormat.of(agent).generic_tools
