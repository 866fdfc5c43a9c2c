"""Anthropic cache_control breakpoints as a token count (router/api/cache_control.py), on the
tiny model's real tokenizer and template: the prompt's tokens up to the end of the last
marked block, and never more than the prompt has."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from router.api.anthropic_api import MessagesRequest
from router.api.cache_control import marked_prefix_len
from router.api.generation import Tokenization

MARK = {"type": "ephemeral"}


@pytest.fixture(scope="module")
def tok(tiny_model):
    return Tokenization(AutoTokenizer.from_pretrained(tiny_model), None)


def marked(tok: Tokenization, **body) -> tuple[int, list[int]]:
    req = MessagesRequest(model="m", max_tokens=1, **body)
    text = tok.render_chat(req.openai_messages(), req.openai_tools(), req.template_kwargs())
    ids = tok.encode_rendered(text)
    return marked_prefix_len(tok, req, ids), ids


def prefix_tokens(tok: Tokenization, text: str) -> int:
    return len(tok.encode_rendered(text))


def test_no_breakpoint_marks_nothing(tok):
    assert marked(tok, messages=[{"role": "user", "content": "hi"}])[0] == 0


def test_a_marked_system_block_ends_where_its_text_does(tok):
    system = [{"type": "text", "text": "Rules one."},
              {"type": "text", "text": " Rules two.", "cache_control": MARK},
              {"type": "text", "text": " Unmarked tail."}]  # fmt: skip
    n, ids = marked(tok, system=system, messages=[{"role": "user", "content": "hi"}])
    assert n == prefix_tokens(tok, "<|im_start|>system\nRules one. Rules two.")
    assert 0 < n < len(ids)


def test_the_last_breakpoint_wins_and_tool_results_carry_one(tok):
    use = {"type": "tool_use", "id": "t1", "name": "f", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "42", "cache_control": MARK}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "ask", "cache_control": MARK}]},
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [result, {"type": "text", "text": "and then?"}]},
    ]
    n, ids = marked(tok, messages=messages)
    text = tok.render_chat(MessagesRequest(model="m", max_tokens=1, messages=messages)
                           .openai_messages())  # fmt: skip
    cut = text.index("42") + 2
    assert n == prefix_tokens(tok, text[:cut]) and n < len(ids)


def test_a_mark_on_a_tool_use_counts_from_the_marked_text_before_it(tok):
    use = {"type": "tool_use", "id": "t1", "name": "f", "input": {}, "cache_control": MARK}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "ask", "cache_control": MARK}]},
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
    ]
    assert marked(tok, messages=messages)[0] == prefix_tokens(tok, "<|im_start|>user\nask")


def test_a_top_level_mark_covers_the_last_message(tok):
    messages = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
                {"role": "user", "content": "three"}]  # fmt: skip
    n, ids = marked(tok, messages=messages, cache_control=MARK)
    assert tok.tokenizer.decode(ids[:n]).endswith("three")
