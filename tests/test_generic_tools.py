"""The generic tool format as the router renders it (router/api/generic_tools.py), on the
tiny model's real tokenizer and template, and on a template that refuses a system turn."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from router.api.chat_format import mlx_lm_module
from router.api.generation import Tokenization
from router.api.generic_tools import call_text, tools_block
from tests.test_tools_api import TOOLS

ARGUMENTS = '{"city": "Paris", "days": 2}'
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL, CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c1", "content": "rainy"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def test_tools_calls_and_results_are_written_into_the_chat(tokenizer):
    text = Tokenization(tokenizer, None).render_chat(HISTORY, TOOLS)
    block = tools_block(TOOLS)
    assert text.startswith(f"<|im_start|>system\n{block}<|im_end|>\n<|im_start|>user\n")
    assert all(json.dumps(t, ensure_ascii=False) in block for t in TOOLS)
    call = call_text(CALL["function"])
    assert f"<|im_start|>assistant\n{call}\n{call}<|im_end|>" in text
    results = "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrainy\n</tool_response>"
    assert f"<|im_start|>user\n{results}<|im_end|>\n<|im_start|>assistant\n" in text
    # the request's own system text comes first, the tools after it
    with_system = [{"role": "system", "content": "Be brief."}, *HISTORY]
    text = Tokenization(tokenizer, None).render_chat(with_system, TOOLS)
    assert text.startswith(f"<|im_start|>system\nBe brief.\n\n{block}<|im_end|>")


def test_without_tools_the_history_is_still_written(tokenizer):
    text = Tokenization(tokenizer, None).render_chat(HISTORY)
    assert "# Tools" not in text and call_text(CALL["function"]) in text


def test_a_written_call_reads_back_with_mlx_lm_s_parser():
    parser = mlx_lm_module("tool_parsers.json_tools")
    call = call_text({"name": "f", "arguments": {"q": "Zürich"}})
    assert call.startswith(parser.tool_call_start) and call.endswith(parser.tool_call_end)
    inner = call[len(parser.tool_call_start) : -len(parser.tool_call_end)]
    assert parser.parse_tool_call(inner) == {"name": "f", "arguments": {"q": "Zürich"}}


def test_a_template_without_a_system_turn_gets_the_tools_in_the_first_turn(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
    )
    text = Tokenization(tokenizer, None).render_chat(HISTORY[:1], TOOLS)
    assert text.startswith(f"[user] {tools_block(TOOLS)}\n\nWeather in Paris and Rome?\n")
